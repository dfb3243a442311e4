"""`kiln serve` structured output, concurrency with disconnects, engine death, bench serve.

Tiny random models produce garbage, but the grammar forces valid output; schemas are kept
bounded (enum, boolean, short patterned strings) so every output completes within max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import pytest
from helpers import wait_all_free

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from kiln.server.testing import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    },
    "required": ["ok", "color", "tag"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-c]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    from kiln.builder import build_engine

    out = tmp_path_factory.mktemp("serve-structured") / "tiny"
    build_engine("random:tiny-llama", out, dtype="float32", max_seq_len=256,
                 max_batch_size=16, progress=False)
    return out


@pytest.fixture(scope="module")
def server(engine_dir):
    with ServerProcess(engine_dir, "--max-queue", "256") as s:
        yield s


def run(coro, timeout: float = 120):
    """Run ``coro`` under a watchdog: a hang fails the test instead of stalling CI."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _post_many(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        return await asyncio.gather(*(c.post(b.pop("_path", "/v1/completions"), json=b)
                                      for b in bodies))


def test_json_schema_50(server):
    jsonschema = pytest.importorskip("jsonschema")
    bodies = []
    for i in range(50):
        rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
        if i % 2:
            bodies.append({"_path": "/v1/chat/completions", "max_tokens": 80, "seed": i,
                           "messages": [{"role": "user", "content": f"json {i}"}],
                           "response_format": rf})
        else:
            bodies.append({"prompt": f"json {i}", "max_tokens": 80, "seed": i,
                           "response_format": rf})
    for r in run(_post_many(server.url, bodies)):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice.get("text", (choice.get("message") or {}).get("content"))
        assert choice["finish_reason"] == "stop", (text, choice)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": "obj", "max_tokens": 200, "temperature": 0,
        "response_format": {"type": "json_object"}})
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    else:  # unbounded grammar: a random model may nest until max_tokens; still JSON-shaped
        assert choice["text"].startswith("{")


def test_regex_and_choice(server):
    bodies = [{"prompt": f"r{i}", "max_tokens": 20, "seed": i, "regex": REGEX}
              for i in range(10)]
    bodies += [{"prompt": f"c{i}", "max_tokens": 20, "seed": i, "choice": CHOICES}
               for i in range(10)]
    bodies += [{"prompt": f"g{i}", "max_tokens": 20, "seed": i,
                "grammar": 'root ::= "yes" | "no" | "x" [0-9]'} for i in range(5)]
    results = run(_post_many(server.url, bodies))
    texts = [r.json()["choices"][0]["text"] for r in results]
    assert all(re.fullmatch(REGEX, t) for t in texts[:10]), texts[:10]
    assert all(t in CHOICES for t in texts[10:20]), texts[10:20]
    assert all(re.fullmatch(r"yes|no|x[0-9]", t) for t in texts[20:]), texts[20:]


async def _stream_client(c: httpx.AsyncClient, i: int, disconnect: bool) -> str:
    body = {"model": "tiny", "prompt": f"client {i}", "max_tokens": 60, "seed": i,
            "stream": True, "stream_options": {"include_usage": True}}
    if i % 3 == 0:
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    elif i % 3 == 1:
        body["regex"] = REGEX
    else:
        body.update(ignore_eos=True, max_tokens=180)
    text = ""
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return "done"
            obj = json.loads(data)
            assert "error" not in obj, obj
            if obj["choices"]:
                text += obj["choices"][0]["text"]
            if disconnect and text:
                return "left"  # leaving the `stream` block closes the connection
    return "eof"


def test_no_hang_concurrent_streams_with_disconnects(server):
    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as c:
            return await asyncio.gather(*(_stream_client(c, i, disconnect=i % 2 == 1)
                                          for i in range(32)))

    outcomes = run(main(), timeout=120)
    assert outcomes.count("done") == 16 and outcomes.count("left") == 16, outcomes
    kv = wait_all_free(server.url)
    assert kv["free_blocks"] == kv["total_blocks"]
    assert httpx.get(server.url + "/health").status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert re.search(r"^kiln_kv_blocks_used 0\.0$", metrics, re.MULTILINE), metrics
    assert re.search(r"^kiln_num_requests_running 0\.0$", metrics, re.MULTILINE)
    aborted = float(re.search(r"^kiln_requests_aborted_total (\S+)$", metrics, re.MULTILINE)[1])
    assert aborted >= 4, metrics  # the long (ignore_eos) leavers were still generating


def test_non_streaming_disconnect_aborts(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            task = asyncio.create_task(c.post("/v1/completions", json={
                "prompt": "long", "max_tokens": 250, "ignore_eos": True, "n": 8}))
            while not (await c.get("/debug/kv")).json()["has_unfinished"]:
                assert not task.done(), "finished before it could be abandoned"
                await asyncio.sleep(0.01)
            task.cancel()  # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await task

    before = _aborted(server.url)
    run(main())
    wait_all_free(server.url)
    assert _aborted(server.url) >= before + 1


def _aborted(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^kiln_requests_aborted_total (\S+)$", text, re.MULTILINE)[1])


def test_bench_serve(server, engine_dir, tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "kiln", "bench", "serve", "--base-url",
                        server.url, "--tokenizer", str(engine_dir), "--num-prompts", "8",
                        "--input-len", "16", "--output-len", "8", "--json", str(out)],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["output_tokens"] == 64


_DYING_SERVER = """
import sys
from kiln.runtime.engine import LLMEngine
real = LLMEngine.step
def step(self):
    if any(r.prompt_token_ids[:4] == list(b"boom") for r in self._requests.values()):
        raise RuntimeError("injected step failure")
    return real(self)
LLMEngine.step = step
from kiln.cli.app import main
main(sys.argv[1:])
"""


def test_engine_death_exits_nonzero(engine_dir):
    proc = ServerProcess(engine_dir)
    proc.cmd = [sys.executable, "-c", _DYING_SERVER, *proc.cmd[3:]]
    with proc:
        ok = httpx.post(proc.url + "/v1/completions", json={"prompt": "fine", "max_tokens": 2})
        assert ok.status_code == 200
        r = httpx.post(proc.url + "/v1/completions", timeout=30,
                       json={"prompt": "boom", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert proc.proc.wait(30) == 1
        assert any("injected step failure" in line for line in proc.log)
