"""`kiln serve` of a tp-2 engine on the CPU: one endpoint over two ranks, and a rank killed
while the server idles takes the server down (the request that finds it out gets the
engine's error naming the rank) with a non-zero exit, leaving no rank behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kiln.server.testing import ServerProcess  # noqa: E402


def _worker_pids(engine: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "kiln.runtime.parallel.worker" in cmd and str(engine) in cmd:
            pids.append(int(proc.name))
    return pids


def test_a_killed_rank_takes_the_server_down_with_an_error(tmp_path):
    from kiln.builder import build_engine

    engine = tmp_path / "tp2"
    build_engine("random:tiny-llama", engine, dtype="float32", max_seq_len=256, tp=2,
                 progress=False)
    body = {"prompt": "kilns", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with ServerProcess(engine, "--device", "cpu") as s:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        (pid,) = _worker_pids(engine)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        # the request in flight when the engine stops: 500 engine_dead (the server's rule for
        # any engine failure; /health answers 503 until the process exits)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead", r.text
        assert "rank 1" in r.text and "SIGKILL" in r.text, r.text
        assert s.proc.wait(30) != 0
        assert time.monotonic() - t0 < 30
    assert _worker_pids(engine) == []
