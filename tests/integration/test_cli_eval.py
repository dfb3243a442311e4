"""`kiln eval perplexity` as a person and a pipeline run it: a progress bar on a terminal
(from the start: loading takes seconds), nothing but the result when stderr is not one."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def engine_and_text(tmp_path_factory):
    from kiln.builder import build_engine

    root = tmp_path_factory.mktemp("eval-cli")
    build_engine("random:tiny-llama", root / "tiny", dtype="float32", max_seq_len=128,
                 max_batch_size=2, progress=False)
    text = root / "text.txt"
    text.write_text("A kiln is a thermally insulated chamber.\n=====\nIt fires pottery.\n" * 8)
    return root / "tiny", text


def _in_a_terminal(args: list[str], timeout: float = 120) -> str:
    """Everything ``python -m kiln ARGS`` writes to a pseudo-terminal (stdout and stderr)."""
    import pty

    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "kiln", *args], stdin=slave, stdout=slave,
                            stderr=slave, env=env)
    os.close(slave)
    out = b""
    try:
        while chunk := os.read(master, 65536):
            out += chunk
    except OSError:  # EIO: the child closed the terminal
        pass
    finally:
        os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))  # no colours
    assert proc.wait(timeout) == 0, text
    return text


def test_perplexity_shows_progress_on_a_terminal_only(engine_and_text):
    engine, text = engine_and_text
    args = ["eval", "perplexity", str(engine), "--data", str(text), "--seq-len", "16"]
    shown = _in_a_terminal(args)
    assert f"Loading {engine}" in shown, shown  # before the engine is loaded
    assert "Perplexity" in shown and "━" in shown, shown
    assert "perplexity " in shown and " windows of 16" in shown
    r = subprocess.run([sys.executable, "-m", "kiln", *args, "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] > 0
    assert "Loading" not in r.stderr and "━" not in r.stderr, r.stderr
