"""`kiln serve` end to end: a real server subprocess over a tiny random float32 engine."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kiln.server.testing import ServerProcess

KEY = "sk-test"


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    from kiln.builder import build_engine

    out = tmp_path_factory.mktemp("serve") / "tiny"
    build_engine("random:tiny-llama", out, dtype="float32", max_seq_len=256,
                 max_batch_size=16, progress=False)
    return out


@pytest.fixture(scope="module")
def server(engine_dir):
    with ServerProcess(engine_dir, "--api-key", KEY, "--served-model-name", "tiny",
                       "--max-body-bytes", "65536", "--log-level", "info") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def completion(client, **kw):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, **kw}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(client, path, body):
    """(parsed chunks, saw [DONE]) of one streaming request."""
    chunks, done = [], False
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            assert not done, "nothing may follow [DONE]"
            chunks.append(json.loads(data))
    return chunks, done


def test_health_version_models(client, server):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["startup_s"] > 0  # + start-up by phase
    assert "version" in client.get("/version").json()
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_completion(client):
    out = completion(client, temperature=0)
    choice = out["choices"][0]
    assert out["object"] == "text_completion" and out["model"] == "tiny"
    assert choice["finish_reason"] in ("stop", "length")
    u = out["usage"]
    assert u["prompt_tokens"] == 5 and 1 <= u["completion_tokens"] <= 8
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    # greedy is deterministic; token-id prompts work the same as text
    assert completion(client, temperature=0)["choices"][0]["text"] == choice["text"]
    ids = client.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    assert completion(client, prompt=ids, temperature=0)["choices"][0]["text"] == choice["text"]
    assert client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello"


def test_chat(client):
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    tok = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert out["usage"]["prompt_tokens"] == tok.json()["count"]


def test_streaming_completion_and_usage(client):
    body = {"model": "tiny", "prompt": "abc", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks, done = sse(client, "/v1/completions", body)
    assert done
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    plain = completion(client, prompt="abc", max_tokens=10, temperature=0, ignore_eos=True)
    assert plain["choices"][0]["text"] == text


def test_streaming_chat(client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "stream": True, "seed": 3}
    chunks, done = sse(client, "/v1/chat/completions", body)
    assert done
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_string(client):
    base = completion(client, prompt="xyz", max_tokens=12, temperature=0, ignore_eos=True)
    text = base["choices"][0]["text"]
    stop = text[4:6] if len(text) >= 6 else None
    if not stop or not stop.strip("\ufffd"):
        pytest.skip("greedy output too short or undecodable to pick a stop string")
    out = completion(client, prompt="xyz", max_tokens=12, temperature=0, ignore_eos=True,
                     stop=[stop])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert stop not in out["choices"][0]["text"]
    assert text.startswith(out["choices"][0]["text"])


def test_seed_and_n(client):
    kw = {"prompt": "seed", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    a = completion(client, seed=7, **kw)["choices"][0]["text"]
    assert completion(client, seed=7, **kw)["choices"][0]["text"] == a
    many = completion(client, seed=7, n=3, **kw)
    texts = [c["text"] for c in sorted(many["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert texts[0] == a  # choice i uses seed + i
    assert texts[1] == completion(client, seed=8, **kw)["choices"][0]["text"]
    assert many["usage"]["completion_tokens"] == 24


def test_logprobs(client):
    c = completion(client, logprobs=3, max_tokens=4, ignore_eos=True)["choices"][0]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert all(len(t) <= 3 for t in lp["top_logprobs"])
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
        "ignore_eos": True, "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(e["top_logprobs"]) == 2 for e in content)


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    out = oc.completions.create(model="tiny", prompt="Hi", max_tokens=5)
    assert out.choices[0].finish_reason in ("stop", "length")
    chat = oc.chat.completions.create(model="tiny", max_tokens=5,
                                      messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.role == "assistant"
    stream = oc.chat.completions.create(model="tiny", max_tokens=5, stream=True,
                                        stream_options={"include_usage": True},
                                        messages=[{"role": "user", "content": "Hi"}])
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError):
        oc.completions.create(model="nope", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong").models.list()


BAD = [
    # (path, body, expected status, expected param)
    ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x" * 300}, 400, "prompt"),  # engine max_input_len
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_schema",
                         "json_schema": {"schema": {"type": "nope"}}}}, 400,
     "response_format"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "xml"}}, 400,
     "response_format.type"),
    ("/v1/completions", {"prompt": "a", "regex": "(unclosed"}, 400, "regex"),
    ("/v1/completions", {"prompt": "a", "grammar": "root ::= "}, 400, "grammar"),
    ("/v1/completions", {"prompt": "a", "choice": []}, 400, "choice"),
    ("/v1/completions", {"prompt": "a", "regex": "a", "choice": ["b"]}, 400, "choice"),
    ("/v1/completions", {"prompt": "a", "lookahead": {"w": 64, "n": 64, "g": 64}}, 400,
     "lookahead"),
    ("/v1/completions", {"prompt": "a", "lookahead": {"w": 0, "n": 3, "g": 2}}, 400,
     "lookahead.w"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 400}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
]


@pytest.mark.parametrize("path, body, status, param", BAD,
                         ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_input(client, path, body, status, param):
    if "model" not in body:
        body = {"model": "tiny", **body}
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert err["message"]
    completion(client, max_tokens=2)  # the server still serves


def test_bad_transport(client, server):
    r = client.post("/v1/completions", content=b'{"prompt": "a", ',
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", content=b"[1, 2]")
    assert r.status_code == 400
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "a" * 70000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    for headers in ({}, {"Authorization": "Bearer nope"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    completion(client, max_tokens=2)


def test_metrics(client):
    completion(client, max_tokens=3)
    text = client.get("/metrics").text
    for name in ("kiln_requests_total", "kiln_prompt_tokens_total",
                 "kiln_generation_tokens_total", "kiln_time_to_first_token_seconds_bucket",
                 "kiln_inter_token_latency_seconds_bucket", "kiln_num_requests_waiting",
                 "kiln_num_requests_running", "kiln_kv_blocks_used", "kiln_kv_blocks_total",
                 "kiln_spec_decode_tokens_per_step"):
        assert name in text, name
    assert 'kiln_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'status="400"' in text


def _requests_total(client, status: str) -> float:
    text = client.get("/metrics").text
    m = re.search(r'^kiln_requests_total\{endpoint="/v1/completions",status="%s"\} (\S+)$'
                  % status, text, re.MULTILINE)
    return float(m[1]) if m else 0.0


def test_dropped_non_streaming_client_is_not_a_server_error(client, server):
    """A client that leaves a non-streaming request is counted as 499, not 500, and the
    server logs no traceback for it."""
    before = (_requests_total(client, "499"), _requests_total(client, "500"), len(server.log))

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60,
                                     headers={"Authorization": f"Bearer {KEY}"}) as c:
            task = asyncio.create_task(c.post("/v1/completions", json={
                "model": "tiny", "prompt": "long", "max_tokens": 240, "ignore_eos": True,
                "n": 4}))
            while not (await c.get("/debug/kv")).json()["has_unfinished"]:
                assert not task.done(), "finished before it could be abandoned"
                await asyncio.sleep(0.01)
            task.cancel()  # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(asyncio.wait_for(main(), 60))
    deadline = time.monotonic() + 10
    while _requests_total(client, "499") < before[0] + 1:
        assert time.monotonic() < deadline, client.get("/metrics").text
        time.sleep(0.05)
    assert _requests_total(client, "500") == before[1]
    log = "\n".join(server.log[before[2]:])
    assert "Traceback" not in log and "InvalidStateError" not in log, log


def test_never_admissible_request_is_a_400_naming_n_and_the_limit(client):
    """1,600 engine requests (100 prompts x n=16) against a server that holds 16 batch slots +
    --max-queue 1024: no retry can succeed, so a 400, not a 429 with Retry-After."""
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": ["hi"] * 100,
                                             "n": 16, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert "retry-after" not in r.headers
    err = r.json()["error"]
    assert err["param"] == "n" and err["code"] == "over_capacity", err
    assert "1600" in err["message"] and "1040" in err["message"], err
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": [[1, 2]] * 1041,
                                             "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    completion(client, max_tokens=2)  # the server still serves


PROTECTED = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
             ("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize"),
             ("GET", "/debug/kv")]
OPEN = ["/health", "/version", "/metrics", "/openapi.json", "/docs"]


def test_http_details_strict_clients_rely_on(client, server):
    # 405 names the methods the route takes in Allow
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST", (r.headers, r.text)
    assert r.json()["error"]["code"] == "method_not_allowed" and "POST" in r.text
    r = client.post("/v1/models", json={})
    assert r.status_code == 405 and "GET" in r.headers["allow"], r.headers
    # 401 says which scheme to use; the scheme is matched case-insensitively
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.headers
    for scheme in ("bearer", "BEARER", "Bearer"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, (scheme, r.text)
    for auth in ("Basic " + KEY, "Bearer", KEY, f"Bearer {KEY}x"):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": auth})
        assert r.status_code == 401, auth
    # --api-key's help names exactly the routes it protects, and those that stay open
    for method, path in PROTECTED:
        r = httpx.request(method, server.url + path, json={})
        assert r.status_code == 401, (path, r.status_code)
    for path in OPEN:
        assert httpx.get(server.url + path).status_code == 200, path
    from typer.testing import CliRunner

    from kiln.cli.app import app

    res = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    text = " ".join(res.output.replace("│", " ").split())
    api_key_help = text[text.index("--api-key"):text.index("KILN_API_KEY")]
    for path in [p for _, p in PROTECTED] + OPEN:
        assert path in api_key_help, (path, api_key_help)
    # a tool message must name the call it answers, as in OpenAI's API
    r = client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "tool", "content": "4"}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[1].tool_call_id" and "tool_call_id" in err["message"]


def _log_lines(server, needle: str, timeout: float = 10) -> list[str]:
    """The server's log lines holding ``needle``, once there is at least one."""
    deadline = time.monotonic() + timeout
    while not (lines := [ln for ln in list(server.log) if needle in ln]):
        assert time.monotonic() < deadline, (needle, server.log[-20:])
        time.sleep(0.05)
    return lines


def test_log_level_info_logs_one_line_per_request(client, server):
    out = completion(client, prompt="Hello", max_tokens=3, ignore_eos=True)
    [line] = _log_lines(server, out["id"] + " ")
    assert re.search(r"INFO: .*POST /v1/completions 200 prompt_tokens=5 output_tokens=3 "
                     r"\d+\.\d{3}s$", line), line
    chunks, _ = sse(client, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "ignore_eos": True, "stream": True})
    [line] = _log_lines(server, chunks[0]["id"] + " ")
    assert "POST /v1/chat/completions 200 prompt_tokens=" in line and "output_tokens=2 " in line
    client.post("/v1/completions", json={"model": "tiny", "prompt": "a", "top_p": 9})
    assert _log_lines(server, "POST /v1/completions 400 ")
    n = len(_log_lines(server, "GET /version 200 "))
    client.get("/version")
    time.sleep(0.3)
    assert len(_log_lines(server, "GET /version 200 ")) == n + 1
