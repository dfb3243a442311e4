"""`kiln serve` request validation: every bad input is a 400 naming the field, never a 500.

A real server subprocess over a tiny random float32 engine (byte-level tokenizer: ids 0-255
are bytes, vocabulary 512, max_seq_len 256), plus unit tests of the pieces that format
responses and build SamplingParams.
"""

from __future__ import annotations

import json
import math

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kiln.runtime.outputs import TokenLogprob
from kiln.server.openai_api import Choice, Generation
from kiln.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    sampling_params,
)
from kiln.server.testing import ServerProcess

MAX_SEQ_LEN = 256
VOCAB = 512
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    from kiln.builder import build_engine

    out = tmp_path_factory.mktemp("serve-validation") / "tiny"
    build_engine("random:tiny-llama", out, dtype="float32", max_seq_len=MAX_SEQ_LEN,
                 max_batch_size=16, progress=False)
    return out


@pytest.fixture(scope="module")
def server(engine_dir):
    with ServerProcess(engine_dir) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity (not JSON; OpenAI clients choke on them)."""
    def bad(name: str):
        raise AssertionError(f"non-finite number {name} in the response: {text[:300]}")

    return json.loads(text, parse_constant=bad)


def post(client, path: str, body: dict | None = None, raw: bytes | None = None):
    if raw is not None:
        return client.post(path, content=raw, headers={"content-type": "application/json"})
    return client.post(path, json=body)


def ok(client, path: str, body: dict) -> dict:
    r = post(client, path, body)
    assert r.status_code == 200, r.text
    return strict_json(r.text)


def bad(client, path: str, body: dict | None = None, *, raw: bytes | None = None,
        param: str | None, status: int = 400, code: str | None = None) -> dict:
    """Post a bad request; check the OpenAI error body and the named field."""
    r = post(client, path, body, raw)
    assert r.status_code == status, r.text
    err = strict_json(r.text)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param, err
    assert err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


def sse(client, path: str, body: dict) -> list[dict]:
    chunks = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line and line != "data: [DONE]":
                assert line.startswith("data: "), line
                chunks.append(strict_json(line[len("data: "):]))
    return chunks


def msgs(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


# -- 1. lone surrogates ----------------------------------------------------------------------
LONE = {"hi": b"\\ud800", "lo": b"\\udfff", "emoji-half": b"\\ud83d"}


@pytest.mark.parametrize("lone", LONE)
@pytest.mark.parametrize("path, raw, param", [
    (COMP, b'{"prompt": "a@b", "max_tokens": 2}', "prompt"),
    (COMP, b'{"prompt": ["ok", "a@b"], "max_tokens": 2}', "prompt[1]"),
    (COMP, b'{"prompt": "a", "stop": ["x", "@"], "max_tokens": 2}', "stop[1]"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a@b"}], "max_tokens": 2}',
     "messages[0].content"),
    (CHAT, (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "@"}]}], '
           b'"max_tokens": 2}'), "messages[0].content[0].text"),
    ("/tokenize", b'{"prompt": "a@b"}', "prompt"),
])
def test_lone_surrogate(client, path, raw, param, lone):
    err = bad(client, path, raw=raw.replace(b"@", LONE[lone]), param=param)
    assert "surrogate" in err["message"] and "UTF-8" in err["message"], err
    # a surrogate *pair* is one valid character (U+1F600) and is served
    assert post(client, path, raw=raw.replace(b"@", b"\\ud83d\\ude00")).status_code == 200


# -- 2. nesting ------------------------------------------------------------------------------
def test_deep_nesting(client):
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    err = bad(client, COMP, raw=deep, param=None)
    assert "nested" in err["message"] and "64" in err["message"], err
    # past the limit but within what json.loads parses: named by its top-level field
    schema: dict = {"type": "string"}
    for _ in range(70):
        schema = {"type": "array", "items": schema}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    err = bad(client, COMP, {"prompt": "a", "response_format": rf}, param="response_format")
    assert "64" in err["message"], err


# -- 3. logprobs stay finite -----------------------------------------------------------------
def test_logprobs_json_clamps_non_finite():
    """-inf (a token the grammar or top-k masked out) and NaN become -9999.0 (vLLM's clamp)."""
    lps = [TokenLogprob(65, float("-inf"), {65: float("-inf"), 66: float("nan"), 67: -0.5})]
    for chat in (False, True):
        gen = Generation(None, "m", chat=chat, include_usage=False)
        c = Choice(0, 1, token_text={65: "A", 66: "B", 67: "C"})
        out = gen.logprobs_json(c, lps, 0)
        text = json.dumps(out, allow_nan=False)  # raises on any non-finite float
        assert "-9999.0" in text and "-0.5" in text
        strict_json(gen.chunk([{"index": 0, "logprobs": out}])[len("data: "):])


def test_structured_output_logprobs(client):
    pytest.importorskip("xgrammar")
    body = {"prompt": "a", "regex": "[0-9]{3}", "logprobs": 5, "max_tokens": 5}
    for out in (ok(client, COMP, body), *sse(client, COMP, body)):
        for choice in out["choices"]:
            for v in (choice["logprobs"] or {}).get("token_logprobs", ()):
                assert math.isfinite(v) and v <= 0
    body = {"messages": msgs("x"), "choice": ["yes", "no"], "logprobs": True,
            "top_logprobs": 5, "max_tokens": 5}
    out = ok(client, CHAT, body)
    assert out["choices"][0]["message"]["content"] in ("yes", "no")
    assert out["choices"][0]["logprobs"]["content"]
    sse(client, CHAT, body)  # strict_json on every chunk


# -- 4. seed ---------------------------------------------------------------------------------
def test_seed_range(client):
    err = bad(client, COMP, {"prompt": "a", "seed": 2**64, "max_tokens": 2}, param="seed")
    assert "18446744073709551615" in err["message"], err
    bad(client, COMP, raw=b'{"prompt": "a", "max_tokens": 2, "seed": 1' + b"0" * 400 + b"}",
        param="seed")
    bad(client, COMP, {"prompt": "a", "seed": -(2**63) - 1, "max_tokens": 2}, param="seed")
    bad(client, COMP, {"prompt": "a", "seed": 1.5, "max_tokens": 2}, param="seed")
    kw = {"prompt": "seed", "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    ok(client, COMP, {**kw, "seed": -(2**63)})
    # choice i uses seed + i modulo 2**64: the last seed's second choice is seed 0
    two = ok(client, COMP, {**kw, "seed": 2**64 - 1, "n": 2})["choices"]
    zero = ok(client, COMP, {**kw, "seed": 0})["choices"][0]["text"]
    assert sorted(two, key=lambda c: c["index"])[1]["text"] == zero


# -- 5. context length -----------------------------------------------------------------------
def test_context_length(client):
    prompt = [65] * 200
    err = bad(client, COMP, {"prompt": prompt, "max_tokens": 100}, param="max_tokens")
    assert err["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested 300 "
        "tokens (200 in the prompt, 100 in the completion)."), err
    assert "56" in err["message"]  # the largest max_tokens that fits
    ok(client, COMP, {"prompt": prompt, "max_tokens": 56})
    # two prompts: the longer one decides
    bad(client, COMP, {"prompt": [[65], prompt], "max_tokens": 57}, param="max_tokens")
    # omitted: completions default to 16, capped to what is left
    out = ok(client, COMP, {"prompt": [65] * 250, "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 6, out["usage"]
    n = client.post("/tokenize", json={"messages": msgs("x" * 100)}).json()["count"]
    for field in ("max_tokens", "max_completion_tokens"):
        err = bad(client, CHAT, {"messages": msgs("x" * 100), field: 200}, param=field)
        assert (f"you requested {n + 200} tokens ({n} in the messages, 200 in the "
                "completion)") in err["message"], err
    # omitted: chat gets the remaining context
    out = ok(client, CHAT, {"messages": msgs("x" * 100), "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == MAX_SEQ_LEN - n, out["usage"]
    # a prompt longer than the engine accepts is still the prompt's fault
    bad(client, COMP, {"prompt": [65] * 300, "max_tokens": 5}, param="prompt")
    bad(client, COMP, {"prompt": [65] * 300, "max_tokens": 500}, param="prompt")


# -- 6. penalties, logit_bias, tools ---------------------------------------------------------
def test_penalties_and_logit_bias_reach_sampling_params():
    req = CompletionRequest(prompt="a", frequency_penalty=0.5, presence_penalty=-1.25,
                            logit_bias={"65": 100, "7": -50.5})
    p = sampling_params(req, max_tokens=4, logprobs=None, seed=None, guided=None, vocab=VOCAB)
    assert p.frequency_penalty == 0.5 and p.presence_penalty == -1.25
    assert dict(p.logit_bias) == {65: 100.0, 7: -50.5}
    for bias, why in (({"512": 1}, "vocabulary"), ({"x": 1}, "token id")):
        with pytest.raises(BadRequest) as e:
            sampling_params(CompletionRequest(prompt="a", logit_bias=bias), max_tokens=4,
                            logprobs=None, seed=None, guided=None, vocab=VOCAB)
        assert e.value.param == "logit_bias" and why in e.value.message


def test_logit_bias_served(client):
    out = ok(client, COMP, {"prompt": "hello", "max_tokens": 6, "temperature": 0,
                            "ignore_eos": True, "logit_bias": {"65": 100}})
    assert out["choices"][0]["text"] == "A" * 6, out


def test_generation_defaults():
    """Omitted sampling fields come from the engine's generation defaults, then kiln's."""
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    req = ChatCompletionRequest(messages=msgs(), top_p=0.5)
    p = sampling_params(req, max_tokens=4, logprobs=None, seed=None, guided=None,
                        vocab=VOCAB, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == \
        (0.6, 0.5, 20, 0.0, 1.1)
    p = sampling_params(ChatCompletionRequest(messages=msgs()), max_tokens=4, logprobs=None,
                        seed=None, guided=None, vocab=VOCAB)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == \
        (1.0, 1.0, 0, 0.0, 1.0)


FN = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("extra, param, words", [
    # this engine's template (ChatML) has no tools: calls could not be read back
    ({"tools": [FN]}, "tools", "no tool-call format"),
    ({"tools": [FN], "tool_choice": "required"}, "tools", "--tool-parser"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [FN, FN]}, "tools", "more than once"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools.function.name", "a-z, A-Z, 0-9, _ and -"),
    ({"tools": [{"type": "retrieval"}]}, "tools.type", "'function'"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "use tools"),
    ({"function_call": "auto"}, "function_call", "use tools and tool_choice"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "audio output is not supported"),
    ({"modalities": ["text", "audio"]}, "modalities", "'text'"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "not supported"),
    ({"web_search_options": {}}, "web_search_options", "web search is not supported"),
])
def test_tools_errors(client, extra, param, words):
    err = bad(client, CHAT, {"messages": msgs(), "max_tokens": 2, **extra}, param=param)
    assert words in err["message"], err


def test_tool_choice_without_tools_passes(client):
    ok(client, CHAT, {"messages": msgs(), "max_tokens": 2, "tool_choice": "none"})
    ok(client, CHAT, {"messages": msgs(), "max_tokens": 2, "tool_choice": "auto"})
    ok(client, CHAT, {"messages": msgs(), "max_tokens": 2, "tools": [], "tool_choice": None})
    # tools with tool_choice "none" are not rendered nor parsed: any template serves them
    ok(client, CHAT, {"messages": msgs(), "max_tokens": 2, "tools": [FN], "tool_choice": "none"})


def test_tool_call_history(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    ok(client, CHAT, {"messages": history, "max_tokens": 2})
    for arguments, words in (("{bad", "not valid JSON"), ("[1]", "not an object")):
        broken = [history[0], {**history[1], "tool_calls": [
            {**call, "function": {"name": "f", "arguments": arguments}}]}, history[2]]
        err = bad(client, CHAT, {"messages": broken, "max_tokens": 2},
                  param="messages[1].tool_calls[0].function.arguments")
        assert words in err["message"], err
    err = bad(client, CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": [call]}],
                             "max_tokens": 2}, param="messages[0].tool_calls")
    assert "only assistant" in err["message"]


def _history(arguments: str) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}]


SCHEMA_CASES = [
    # (path, body, the server accepts it, /openapi.json admits it): what the schema admits
    # the server accepts; what the server refuses the schema does not admit
    (COMP, {"prompt": "a", "best_of": 2}, False, False),
    (COMP, {"prompt": "a", "best_of": 1, "n": 2}, False, False),
    (COMP, {"prompt": "a", "best_of": None, "n": 3}, True, True),
    (COMP, {"prompt": "a", "best_of": 2, "n": 2}, True, False),  # no field compares to n
    (CHAT, {"messages": _history("{}")}, True, True),
    (CHAT, {"messages": _history(' {"a": [1, {"b": null}]}\n')}, True, True),
    (CHAT, {"messages": _history("{bad")}, False, False),
    (CHAT, {"messages": _history("[1]")}, False, False),
    (CHAT, {"messages": _history("")}, False, False),
    (CHAT, {"messages": _history("42")}, False, False),
    # at most one structured-output field: a response_format of type text asks for nothing
    (COMP, {"prompt": "a", "choice": ["x", "y"]}, True, True),
    (COMP, {"prompt": "a", "choice": ["x"], "response_format": {"type": "json_object"}},
     False, False),
    (COMP, {"prompt": "a", "choice": ["x"], "response_format": {"type": "text"}}, True, True),
    (COMP, {"prompt": "a", "choice": ["x"], "regex": None}, True, True),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "regex": "a+",
            "grammar": 'root ::= "a"'}, False, False),
]


@pytest.mark.parametrize("path, body, accepted, admitted", SCHEMA_CASES,
                         ids=[str(i) for i in range(len(SCHEMA_CASES))])
def test_openapi_states_what_the_server_accepts(server, client, path, body, accepted,
                                                admitted):
    jsonschema = pytest.importorskip("jsonschema")
    doc = httpx.get(server.url + "/openapi.json").json()
    name = "CompletionRequest" if path == COMP else "ChatCompletionRequest"
    root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    valid = jsonschema.Draft202012Validator(root).is_valid(body)
    r = post(client, path, {**body, "max_tokens": 1})
    assert (valid, r.status_code) == (admitted, 200 if accepted else 400), r.text


# -- 7. bounds -------------------------------------------------------------------------------
BAD = [
    # (path, body or raw bytes, param)
    (COMP, {"repetition_penalty": 1e308}, "repetition_penalty"),
    (COMP, {"repetition_penalty": 0.001}, "repetition_penalty"),
    (COMP, {"repetition_penalty": 0}, "repetition_penalty"),
    (COMP, b'{"prompt": "a", "repetition_penalty": Infinity}', "repetition_penalty"),
    (COMP, b'{"prompt": "a", "temperature": NaN}', "temperature"),
    (COMP, b'{"prompt": "a", "top_p": -Infinity}', "top_p"),
    (COMP, b'{"prompt": "a", "min_p": 1e400}', "min_p"),
    (COMP, (b'{"prompt": "a", "response_format": {"type": "json_schema", "json_schema": '
           b'{"schema": {"type": "number", "minimum": -Infinity}}}}'),
     "response_format.json_schema.schema.minimum"),
    (COMP, {"frequency_penalty": 2.5}, "frequency_penalty"),
    (COMP, {"presence_penalty": -3}, "presence_penalty"),
    (COMP, {"frequency_penalty": "lots"}, "frequency_penalty"),
    (COMP, {"logit_bias": {"5": 101}}, "logit_bias"),
    (COMP, {"logit_bias": {"5": -100.5}}, "logit_bias"),
    (COMP, {"logit_bias": {"512": 1}}, "logit_bias"),
    (COMP, {"logit_bias": {"-1": 1}}, "logit_bias"),
    (COMP, {"logit_bias": {"abc": 1}}, "logit_bias"),
    (COMP, {"logit_bias": {"9" * 5000: 1}}, "logit_bias"),  # int() refuses > 4300 digits
    (COMP, {"logit_bias": [5]}, "logit_bias"),
    (COMP, {"top_k": 10**12}, "top_k"),
    (COMP, {"top_k": -2}, "top_k"),
    (COMP, {"stop_token_ids": [-1]}, "stop_token_ids"),
    (COMP, {"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    (COMP, {"max_tokens": 10**30}, "max_tokens"),
    (COMP, {"n": 10**30}, "n"),
    (COMP, {"temperature": 10**400}, "temperature"),
    (COMP, {"prompt": 5}, "prompt"),
    (COMP, {"prompt": [[]]}, "prompt"),
    (COMP, {"prompt": [1, "a"]}, "prompt"),
    (COMP, {"stream": True, "stream_options": 5}, "stream_options"),
    (COMP, {"suffix": "tail"}, "suffix"),
    (COMP, {"best_of": 3}, "best_of"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    (CHAT, {"messages": [5]}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": msgs(), "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    (CHAT, {"messages": msgs(), "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": msgs()}, "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [VOCAB]}, "tokens"),
    ("/detokenize", {"tokens": [10**30]}, "tokens"),
    ("/detokenize", {}, "tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_names_the_field(client, path, body, param):
    if isinstance(body, bytes):
        err = bad(client, path, raw=body, param=param)
    else:
        base = {COMP: {"prompt": "a", "max_tokens": 2},
                CHAT: {"messages": msgs(), "max_tokens": 2}}.get(path, {})
        err = bad(client, path, {**base, **body}, param=param)
    assert param in err["message"], err  # the message names the field too


@pytest.mark.parametrize("body", [
    {"top_k": -1}, {"top_k": 10**6}, {"top_k": 2**31 - 1}, {"repetition_penalty": 0.01},
    {"repetition_penalty": 100}, {"stop_token_ids": [VOCAB - 1]}, {"frequency_penalty": -2},
    {"presence_penalty": 2}, {"logit_bias": {"0": -100, "511": 100}}, {"best_of": 1},
    {"suffix": ""}, {"seed": 2**64 - 1},
])
def test_edges_accepted(client, body):
    ok(client, COMP, {"prompt": "a", "max_tokens": 2, **body})


def test_no_traceback(server, client):
    """Run last: nothing above made the server log an exception."""
    assert client.get("/health").status_code == 200
    assert not [line for line in server.log if "Traceback" in line], "\n".join(server.log)
