"""`kiln bench throughput|latency --baseline hf`: the same workload through transformers.

Real subprocesses on a tiny float32 ``random:tiny-llama`` engine (CPU). Checked: the
``baseline`` JSON object, that both sides counted the same tokens, that the ratio is kiln /
transformers from the printed numbers, the start-up record, and a bad --baseline value.
Timed numbers never make a test pass or fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASELINE_KEYS = {"name", "version", "mode", "tokens_per_s", "kiln_tokens_per_s", "ratio",
                 "output_tokens", "kiln_output_tokens", "dtype", "weights", "fallbacks"}


def kiln(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "NO_COLOR": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                       os.environ.get("PYTHONPATH")]))}
    env.pop("KILN_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True,
                          text=True, encoding="utf-8", errors="replace", env=env, timeout=600,
                          check=False)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("engines") / "tiny"
    ok(kiln("build", "random:tiny-llama", "-o", str(out), "--dtype", "float32"))
    return str(out)


def check_baseline(r: dict, kiln_tokens_per_s: float, tokens: int) -> dict:
    b = r["baseline"]
    assert set(b) >= BASELINE_KEYS
    assert b["name"] == "transformers" and b["version"]
    assert b["dtype"] == "float32" and b["fallbacks"] == []
    assert b["output_tokens"] == b["kiln_output_tokens"] == tokens
    assert b["kiln_tokens_per_s"] == kiln_tokens_per_s
    assert b["tokens_per_s"] > 0
    assert b["ratio"] == pytest.approx(kiln_tokens_per_s / b["tokens_per_s"])
    assert r["startup_s"] > 0
    return b


def test_latency_baseline_hf(engine_dir, tmp_path):
    path = tmp_path / "lat.json"
    proc = ok(kiln("bench", "latency", engine_dir, "--batch-size", "2", "--input-len", "8",
                   "--output-len", "4", "--num-iters", "2", "--warmup", "1", "--device", "cpu",
                   "--baseline", "hf", "--json", str(path)))
    r = json.loads(path.read_text())
    b = check_baseline(r, r["output_tokens_per_s"], 2 * 2 * 4)
    assert b["mode"] == "static-cache (eager)"  # CPU: no compile unless --hf-compile
    assert b["compile_requested"] is False
    assert [it["output_tokens"] for it in b["iterations"]] == [8, 8]
    assert b["latency_s"]["count"] == 2
    for needle in ("kiln / transformers", "transformers", "engine start-up"):
        assert needle in proc.stdout


def test_throughput_baseline_hf(engine_dir, tmp_path):
    path = tmp_path / "tp.json"
    proc = ok(kiln("bench", "throughput", engine_dir, "--num-prompts", "6", "--input-len", "8",
                   "--output-len", "5", "--device", "cpu", "--baseline", "hf",
                   "--json", str(path)))
    r = json.loads(path.read_text())
    b = check_baseline(r, r["output_tokens_per_s"], r["output_tokens"])
    assert r["output_tokens"] == 30
    assert b["mode"] == "generate_batch" and b["subset"] is False
    assert b["num_requests"] == b["kiln_num_requests"] == 6
    assert b["prompt_tokens"] == r["prompt_tokens"]
    assert "kiln / transformers" in proc.stdout


def test_throughput_baseline_subset_in_process(engine_dir, tmp_path):
    from typer.testing import CliRunner

    from kiln.cli.app import app

    path = tmp_path / "tp.json"
    res = CliRunner().invoke(app, ["bench", "throughput", engine_dir, "--num-prompts", "4",
                                   "--input-len", "6", "--output-len", "3", "--device", "cpu",
                                   "--baseline", "hf", "--baseline-num-prompts", "2",
                                   "--json", str(path)])
    assert res.exit_code == 0, res.output
    b = json.loads(path.read_text())["baseline"]
    assert b["subset"] is True and b["num_requests"] == 2 and b["kiln_num_requests"] == 4
    assert b["output_tokens"] == 6 and b["kiln_output_tokens"] == 12
    assert "transformers ran 2 of 4 requests" in res.output


def test_unknown_baseline_is_one_line_error(engine_dir):
    proc = kiln("bench", "latency", engine_dir, "--baseline", "foo", "--device", "cpu")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "'foo'" in lines[0] and "none, hf" in lines[0]
