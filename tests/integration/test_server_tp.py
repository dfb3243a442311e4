"""`kiln serve` of a tp-2 engine on the CPU.

It answers the official openai client, survives a storm of 32 streams of which half
disconnect (every KV block freed, the follower still serving), and Ctrl-C (SIGINT to every
process, as a terminal sends it) drains and exits 0 with the follower. When a rank fails
the server notices at once (a killed rank) or within the heartbeat timeout (a stopped one,
even while it idles), the requests in flight end with the engine's error naming the rank,
/health answers 503, and the process exits non-zero within a bound, leaving no rank
behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import rank_workers, wait_all_free

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kiln.server.testing import ServerProcess  # noqa: E402


def _worker_pids(engine: Path) -> list[int]:
    return list(rank_workers(engine))


@pytest.fixture(scope="module")
def tp2_engine(tmp_path_factory) -> Path:
    from kiln.builder import build_engine

    engine = tmp_path_factory.mktemp("tp2") / "engine"
    build_engine("random:tiny-llama", engine, dtype="float32", max_seq_len=512, tp=2,
                 progress=False)
    return engine


async def _stream(c: httpx.AsyncClient, i: int, leave: bool) -> str:
    body = {"prompt": f"client {i}", "max_tokens": 40 + i, "temperature": 0,
            "ignore_eos": True, "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "done"
            assert "error" not in json.loads(line[6:]), line
            if leave:
                return "left"  # leaving the `stream` block closes the connection
    return "eof"


def test_openai_client_and_a_disconnect_storm(tp2_engine):
    openai = pytest.importorskip("openai")
    with ServerProcess(tp2_engine, "--device", "cpu", "--max-queue", "256") as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
        (model,) = [m.id for m in client.models.list().data]
        done = client.completions.create(model=model, prompt="kilns", max_tokens=8,
                                         temperature=0)
        assert done.usage.completion_tokens == 8 and done.choices[0].text
        chunks = list(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
            temperature=0, stream=True))
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")

        async def storm():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=s.url, timeout=120, limits=limits) as c:
                return await asyncio.gather(*(_stream(c, i, leave=i % 2 == 1)
                                              for i in range(32)))

        outcomes = asyncio.run(asyncio.wait_for(storm(), 240))
        assert outcomes.count("done") == 16 and outcomes.count("left") == 16, outcomes
        kv = wait_all_free(s.url)
        assert kv["free_blocks"] == kv["total_blocks"]
        assert httpx.get(s.url + "/health").status_code == 200
        (pid,) = _worker_pids(tp2_engine)  # the follower still serves
        again = client.completions.create(model=model, prompt="kilns", max_tokens=8,
                                          temperature=0)
        assert again.choices[0].text == done.choices[0].text  # greedy, same answer


def test_ctrl_c_drains_and_exits_0_with_the_follower(tp2_engine):
    """SIGINT to the server and its follower at once (a terminal's Ctrl-C reaches the
    whole foreground group): the follower ignores it, the stream in flight finishes, the
    server exits 0 and the follower with it."""
    body = {"prompt": "kilns", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with ServerProcess(tp2_engine, "--device", "cpu") as s:
        (pid,) = _worker_pids(tp2_engine)
        events = []
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 1:
                    os.kill(s.proc.pid, signal.SIGINT)
                    os.kill(pid, signal.SIGINT)
        assert events[-1] == "[DONE]"
        assert all("error" not in e for e in events[:-1]), events[-2]
        assert s.proc.wait(30) == 0, "\n".join(s.log)
    assert _worker_pids(tp2_engine) == []


def test_a_rank_killed_mid_request_ends_the_request_and_the_server(tp2_engine):
    """SIGKILL on the follower while a stream runs: the stream's last chunk is the engine's
    error (engine_dead, naming rank 1 and the signal) before [DONE], and the server exits
    with code 1 within seconds."""
    body = {"prompt": "kilns", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with ServerProcess(tp2_engine, "--device", "cpu") as s:
        (pid,) = _worker_pids(tp2_engine)
        events = []
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 1:
                    os.kill(pid, signal.SIGKILL)
                    t0 = time.monotonic()
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead", error
        assert "tensor-parallel engine (tp=2) stopped: rank 1" in error["message"], error
        assert "SIGKILL" in error["message"], error
        assert len(events) < 480  # it did not finish
        assert s.proc.wait(15) == 1
        assert time.monotonic() - t0 < 15
        log = "\n".join(s.log)
        assert "error: the engine stopped: TensorParallelError" in log, log
    assert _worker_pids(tp2_engine) == []


def test_a_rank_stopped_while_idle_ends_the_server_within_the_heartbeat_timeout(tp2_engine):
    """SIGSTOP on the follower of an idle server, heartbeat timeout 2 s: no request is
    needed for the server to notice; it exits with code 1 naming the rank, and the stopped
    follower is ended too."""
    env = {"KILN_TP_HEARTBEAT_TIMEOUT_S": "2"}
    with ServerProcess(tp2_engine, "--device", "cpu", env=env) as s:
        r = httpx.get(s.url + "/health", timeout=10)
        assert r.status_code == 200
        (pid,) = _worker_pids(tp2_engine)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert s.proc.wait(20) == 1
        took = time.monotonic() - t0
        assert 1.5 < took < 15, took
        log = "\n".join(s.log)
        assert "rank 1 sent no heartbeat" in log and "every rank was ended" in log, log
    assert _worker_pids(tp2_engine) == []


def test_health_is_503_naming_the_rank_once_the_supervisor_finds_it(tp2_engine, monkeypatch):
    """The app in this process (so that its answers can be read after the failure, which
    `kiln serve` follows with its exit): a stopped follower of an idle engine makes /health
    and new requests 503 engine_dead naming the rank, and on_dead runs once."""
    from fastapi.testclient import TestClient

    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.server.app import ServerConfig, create_app

    monkeypatch.setenv("KILN_TP_HEARTBEAT_TIMEOUT_S", "2")
    engine = LLMEngine.from_engine_dir(tp2_engine, RuntimeConfig(device="cpu"))
    (proc,) = engine.tp.procs
    dead: list[BaseException] = []
    try:
        app = create_app(engine, ServerConfig("tp2"), on_dead=dead.append)
        with TestClient(app) as client:
            assert client.get("/health").status_code == 200
            os.kill(proc.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 10
            while not dead and time.monotonic() < deadline:
                time.sleep(0.05)
            r = client.get("/health")
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "engine_dead"
            assert "rank 1 sent no heartbeat" in r.json()["error"]["message"]
            r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and "rank 1 sent no heartbeat" in r.text, r.text
        assert len(dead) == 1 and "rank 1 sent no heartbeat" in str(dead[0])
        assert proc.poll() == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        engine.close()
