"""Tool calling's OpenAI shapes on a tiny random engine served with `--tool-parser hermes`.

Random weights write garbage, but ``required`` and named calls are grammar-constrained: the
output is a well-formed hermes call whatever the weights, so the response shapes (ids,
``finish_reason: "tool_calls"``, streamed ``delta.tool_calls``) are checked here in seconds.
The real model's behaviour is tests/integration/test_server_tools.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from kiln.server.testing import ServerProcess  # noqa: E402

PAINT_PARAMS = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"], "additionalProperties": False}
SIZE_PARAMS = {"type": "object", "properties": {"size": {"enum": ["s", "m", "l"]}},
               "required": ["size"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "paint", "parameters": PAINT_PARAMS}},
         {"type": "function", "function": {"name": "size", "parameters": SIZE_PARAMS}}]
SCHEMAS = {"paint": PAINT_PARAMS, "size": SIZE_PARAMS}
MESSAGES = [{"role": "user", "content": "go"}]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    from kiln.builder import build_engine

    out = tmp_path_factory.mktemp("serve-tools") / "tiny"
    build_engine("random:tiny-llama", out, dtype="float32", max_seq_len=256,
                 max_batch_size=8, progress=False)
    return out


@pytest.fixture(scope="module")
def server(engine_dir):
    with ServerProcess(engine_dir, "--tool-parser", "hermes", "--served-model-name",
                       "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _calls(message) -> list[tuple[str, dict]]:
    out = []
    for c in message.tool_calls or []:
        assert c.type == "function" and c.id.startswith("call_") and len(c.id) == 29
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


def test_inspect_shows_the_parser(engine_dir):
    out = subprocess.run([sys.executable, "-m", "kiln", "inspect", str(engine_dir), "--json"],
                         capture_output=True, text=True, check=True).stdout
    # random:tiny-llama's ChatML template renders no tools
    assert json.loads(out)["tools"] == {"parser": None, "source": "none"}


@pytest.mark.parametrize("seed", range(4))
def test_required_single_call(client, seed):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, seed=seed, temperature=1.0, max_tokens=128)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(_calls(choice.message)) == 1
    assert choice.message.content is None
    assert r.usage.completion_tokens > 0


def test_named_call(client):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=128,
        tool_choice={"type": "function", "function": {"name": "size"}}, n=2)
    for choice in r.choices:
        assert [name for name, _ in _calls(choice.message)] == ["size"]
        assert choice.finish_reason == "tool_calls"


def _stream(client, **kw) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    reason = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.type == "function" and tc.function.name, tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and not (tc.function and tc.function.name), tc
                calls[tc.index]["arguments"] += (tc.function.arguments or "")
            reason = ch.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason


def test_streamed_calls_equal_the_whole_answer(client):
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
              temperature=0, max_tokens=128, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    calls, reason = _stream(client, **kw)
    assert reason == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_auto_strict_keeps_calls_well_formed(client):
    strict = [{"type": "function", "function": {**t["function"], "strict": True}}
              for t in TOOLS]
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=strict,
                                       temperature=0, max_tokens=32)
    _calls(r.choices[0].message)  # whatever it wrote, any call in it validates


def test_tools_with_response_format_is_a_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": MESSAGES, "tools": TOOLS, "response_format": {"type": "json_object"}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format" and "cannot be combined" in err["message"]


def test_serve_rejects_an_unknown_parser(engine_dir):
    p = subprocess.run([sys.executable, "-m", "kiln", "serve", str(engine_dir), "--port", "0",
                        "--tool-parser", "nope"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "nope" in p.stderr and "hermes" in p.stderr and "Traceback" not in p.stderr


def test_no_traceback(server):
    assert not [line for line in server.log if "Traceback" in line], "\n".join(server.log)


BAD_SCHEMAS = [
    # (parameters, the path in the schema the 400 names)
    ({"type": "object", "properties": {"color": {"type": "colour"}}}, "properties.color.type"),
    ({"type": "nope"}, "type"),
    ({"type": "object", "required": "ok"}, "required"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": "1"}}},
     "properties.n.minimum"),
    ({"type": "object", "anyOf": [{"type": "string"}, 5]}, "anyOf[1]"),
]


@pytest.mark.parametrize("choice", ["required", "auto"])
@pytest.mark.parametrize("params, where", BAD_SCHEMAS, ids=[w for _, w in BAD_SCHEMAS])
def test_invalid_tool_schema_names_the_tool_and_the_path(server, params, where, choice):
    tools = [TOOLS[0], {"type": "function", "function": {"name": "broken", "parameters": params}}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": MESSAGES, "tools": tools, "tool_choice": choice, "max_tokens": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == f"tools[1].function.parameters.{where}".replace(".[", "["), err
    assert "'broken'" in err["message"] and "structural_tag" not in err["message"], err


def test_a_schema_xgrammar_cannot_compile_names_the_tool(server):
    params = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    tools = [{"type": "function", "function": {"name": "dangling", "parameters": params}}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": MESSAGES, "tools": tools, "tool_choice": "required", "max_tokens": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools[0].function.parameters", err
    assert "'dangling'" in err["message"] and "structural_tag" not in err["message"], err
