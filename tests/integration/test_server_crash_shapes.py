"""The request shapes that used to kill `kiln serve` (engine_dead, exit 1), over real HTTP.

1. Greedy json_schema chat on a lookahead engine (smollm2-135m, window 5,5,5): a draft that
   completed the JSON and then the stop token left a terminated grammar matcher that was
   asked for another mask. Streaming, a request window (3,3,2) and the openai client's
   ``chat.completions.parse`` too.
2. Structured output with a degenerate float: a top_p that is 0 in float32, a temperature
   that overflows the logits, penalties at the edge of their range (the bounds reject what
   is past it, naming the field). Without a grammar the same values used to return token 0
   repeated.

After each, the server still answers, /health is 200 and every KV block is free.
"""

from __future__ import annotations

import json

import pytest
from helpers import module_dir

httpx = pytest.importorskip("httpx")
pytest.importorskip("xgrammar")

from kiln.server.testing import ServerProcess

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# The example ends with the stop token (the chat template's <|im_end|>, parsed as the special
# token): the pool then offers drafts that complete the JSON and stop, which crashed.
MESSAGES = [{"role": "user", "content": 'Reply with exactly this JSON: {"name":"Ada","age":36}'
             '<|im_end|> and nothing else: {"name":"Ada","age":36}<|im_end|>'}]


@pytest.fixture(scope="module")
def lookahead_server(tmp_path_factory, smollm2_gguf):
    from kiln.artifact.speculative import SpeculativeConfig
    from kiln.builder import build_engine

    with module_dir(tmp_path_factory, "crash") as root:
        out = root / "smol-la"
        build_engine("smollm2-135m", out, dtype="float32", max_seq_len=512, max_batch_size=8,
                     speculative=SpeculativeConfig.from_cli("lookahead", "5,5,5", None, None),
                     progress=False)
        with ServerProcess(out, "--served-model-name", "smol") as s:
            yield s


@pytest.fixture(scope="module")
def client(lookahead_server):
    with httpx.Client(base_url=lookahead_server.url, timeout=120) as c:
        yield c


def _healthy(client) -> None:
    assert client.get("/health").status_code == 200
    kv = client.get("/debug/kv").json()
    assert kv["all_free"], kv


def _json_schema(stream: bool = False, **extra) -> dict:
    return {"model": "smol", "messages": MESSAGES, "temperature": 0, "max_tokens": 60,
            "stream": stream, **extra,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "schema": SCHEMA}}}


@pytest.mark.parametrize("window", [None, {"w": 3, "n": 3, "g": 2}], ids=["engine", "3,3,2"])
def test_greedy_json_schema_on_a_lookahead_engine(client, window):
    extra = {} if window is None else {"lookahead": window}
    r = client.post("/v1/chat/completions", json=_json_schema(**extra))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    obj = json.loads(choice["message"]["content"])
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)
    # plain decoding gives the same text (greedy lookahead == plain greedy)
    plain = client.post("/v1/chat/completions",
                        json=_json_schema(lookahead={"w": 1, "n": 1, "g": 0}))
    assert plain.json()["choices"][0]["message"]["content"] == choice["message"]["content"]
    _healthy(client)


def test_greedy_json_schema_streamed_on_a_lookahead_engine(client):
    text, done = "", False
    with client.stream("POST", "/v1/chat/completions", json=_json_schema(stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            assert "error" not in obj, obj
            text += obj["choices"][0]["delta"].get("content", "") or ""
    assert done
    assert set(json.loads(text)) == {"name", "age"}
    _healthy(client)


def test_openai_client_parse_with_a_pydantic_model(lookahead_server, client):
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    oc = openai.OpenAI(base_url=lookahead_server.url + "/v1", api_key="none")
    done = oc.chat.completions.parse(model="smol", messages=MESSAGES, response_format=Person,
                                     temperature=0, max_tokens=60)
    person = done.choices[0].message.parsed
    assert isinstance(person, Person)
    _healthy(client)


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "regex": "J", "top_p": 5e-324, "max_tokens": 4},
    {"prompt": "hi", "choice": ["yes", "no"], "top_p": 1e-300, "max_tokens": 4},
    {"prompt": "hi", "choice": ["yes", "no"], "top_p": 5e-324, "max_tokens": 4},
    {"prompt": "hi", "regex": "J+", "temperature": 1e-300, "max_tokens": 4},
    {"prompt": "hi", "regex": "[a-z]+", "repetition_penalty": 0.01, "n": 5, "max_tokens": 4},
    {"prompt": "hi", "regex": "[a-z]+", "repetition_penalty": 100, "n": 5, "max_tokens": 4},
], ids=["regex-top_p-5e-324", "choice-top_p-1e-300", "choice-top_p-5e-324",
        "regex-temperature-1e-300", "regex-rp-min-n5", "regex-rp-max-n5"])
def test_degenerate_floats_with_structured_output(client, body):
    r = client.post("/v1/completions", json={"model": "smol", **body})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        text = choice["text"]
        if "choice" in body:
            assert text in body["choice"]
        else:
            assert text and "\x00" not in text
    _healthy(client)


@pytest.mark.parametrize("value", [5e-324, 1.1e307])
def test_repetition_penalty_past_its_range_is_a_named_400(client, value):
    for extra in ({"regex": "J"}, {}):
        r = client.post("/v1/completions", json={"model": "smol", "prompt": "hi",
                                                 "repetition_penalty": value,
                                                 "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "repetition_penalty"
    _healthy(client)


def test_degenerate_floats_without_a_grammar_do_not_return_token_zero(client):
    r = client.post("/v1/completions", json={"model": "smol", "prompt": "The capital of France",
                                             "top_p": 5e-324, "max_tokens": 8,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert "\x00" not in r.json()["choices"][0]["text"]
    _healthy(client)


def test_a_request_that_fails_in_the_engine_fails_alone(client):
    """A real fault in one request of a running batch: a regex that dead-ends after its first
    token leaves its request with no allowed token (the engine fails it: 500 request_failed,
    or an error chunk and [DONE] when streamed), while the requests running beside it finish
    with the tokens they get alone, /health stays 200 and every KV block comes back."""
    from concurrent.futures import ThreadPoolExecutor

    def plain(i: int) -> dict:
        return {"model": "smol", "prompt": f"Count to ten: {i}", "max_tokens": 24,
                "temperature": 0, "ignore_eos": True}

    alone = [client.post("/v1/completions", json=plain(i)).json()["choices"][0]["text"]
             for i in range(3)]
    dead_end = {"model": "smol", "prompt": "hi", "regex": "a[^\\x00-\\U0010ffff]",
                "max_tokens": 8}

    def streamed_dead_end() -> list[str]:
        with client.stream("POST", "/v1/completions", json={**dead_end, "stream": True}) as r:
            return [line for line in r.iter_lines() if line]

    with ThreadPoolExecutor(5) as pool:
        futs = [pool.submit(client.post, "/v1/completions", json=plain(i)) for i in range(3)]
        bad = pool.submit(client.post, "/v1/completions", json=dead_end)
        bad_stream = pool.submit(streamed_dead_end)
        texts = [f.result().json()["choices"][0]["text"] for f in futs]
        r = bad.result()
        lines = bad_stream.result()
    assert texts == alone
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "request_failed" and "no token is allowed" in err["message"]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "request_failed"
    _healthy(client)
