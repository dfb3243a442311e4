"""Tool calling through `kiln serve` on the real qwen2.5-coder-0.5b (float32, CPU).

The official openai client and instructor talk to a real server. Forced calls (``required``,
a named function) are grammar-constrained, so every one parses and validates against its
schema; ``auto`` leaves the model free, and kiln's parsed answer must equal what transformers'
greedy output over the same rendered prompt parses to with the same parser (hermes, which
the Qwen2.5 template speaks). A lookahead engine of the same model must give the plain
engine's answers, token for token. The model is small: it often writes calls as a ```json
fence instead of <tool_call> blocks, which the hermes parser accepts for known function names.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import module_dir

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from kiln.server.testing import ServerProcess  # noqa: E402
from kiln.tools import get_parser  # noqa: E402

pytestmark = pytest.mark.slow

ALIAS = "qwen2.5-coder-0.5b"
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "the city, e.g. Paris"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": WEATHER_PARAMS}}
TIME_PARAMS = {"type": "object", "properties": {"timezone": {"type": "string"}},
               "required": ["timezone"]}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in an IANA time zone, e.g. "
    "Europe/Paris", "parameters": TIME_PARAMS}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
CITIES = ["Paris", "Tokyo", "Berlin", "Lima", "Oslo", "Cairo", "Austin", "Seoul", "Quito",
          "Perth"]
AUTO_PROMPTS = [
    "What's the weather like in Paris right now?",
    "Write a haiku about the sea.",
    "What time is it in Tokyo?",
    "Explain what a Python list comprehension is, in one sentence.",
    "Is it going to be cold in Oslo today? Answer in fahrenheit.",
    "Write a Python function that adds two numbers.",
    "Tell me the weather in Berlin and in Madrid.",
    "What is 17 times 3?",
    "I fly to New York tomorrow. What's the weather there?",
    "Say hello in French.",
]
MAX_TOKENS = 64
# Greedy as transformers does it: the engine's generation defaults (Qwen's
# repetition_penalty 1.1) would apply otherwise, and a lookahead engine records none.
GREEDY = dict(temperature=0, extra_body={"repetition_penalty": 1.0})


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(plain, lookahead) engine dirs of the real model, float32."""
    from kiln.artifact.speculative import SpeculativeConfig
    from kiln.builder import build_engine

    with module_dir(tmp_path_factory, "tools") as root:
        limits = dict(dtype="float32", max_seq_len=1024, max_batch_size=8, max_num_tokens=1024,
                      progress=False)
        build_engine(ALIAS, root / "plain", **limits)
        build_engine(ALIAS, root / "lookahead", **limits,
                     speculative=SpeculativeConfig.from_cli("lookahead",
                                                            lookahead_config="4,3,4"))
        yield root / "plain", root / "lookahead"


@pytest.fixture(scope="module")
def server(engines):
    with ServerProcess(engines[0], "--served-model-name", "qwen", timeout_s=300) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=600)


def _chat(client, content: str, **kw):
    return client.chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": content}], **kw)


def _valid_calls(message) -> list[tuple[str, dict]]:
    """The message's calls as (name, arguments), each checked against its schema."""
    out = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_engine_records_the_hermes_parser(engines):
    from kiln.artifact.loader import load_engine

    for path in engines:
        tools = load_engine(path).spec.tools
        assert (tools.parser, tools.source) == ("hermes", "chat template")


def _many(fn, n: int):
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, range(n)))


def test_required_20_of_20(client):
    """Sampled (the model's defaults, a seed each): every answer is calls only, and every
    call parses and validates."""
    def one(i):
        return _chat(client, f"I am planning a trip to {CITIES[i % 10]}. Can you help?",
                     tools=TOOLS, tool_choice="required", seed=i, max_tokens=MAX_TOKENS)

    for r in _many(one, 20):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert _valid_calls(choice.message), choice.message


def test_named_20_of_20(client):
    def one(i):
        return _chat(client, f"Anything interesting about {CITIES[i % 10]}?", tools=TOOLS,
                     tool_choice={"type": "function", "function": {"name": "get_time"}},
                     seed=i, max_tokens=MAX_TOKENS, parallel_tool_calls=False)

    for r in _many(one, 20):
        choice = r.choices[0]
        calls = _valid_calls(choice.message)
        assert [name for name, _ in calls] == ["get_time"], choice.message
        assert choice.finish_reason == "tool_calls"


def _greedy_transformers(messages: list[dict], engine_dir) -> str:
    """transformers' greedy answer over the chat template's rendering (float32)."""
    import torch

    from kiln.artifact.loader import load_engine

    tok = load_engine(engine_dir).load_tokenizer()
    hf = _hf_model()
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=[151645, 151643], pad_token_id=151643)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


_HF = []


def _hf_model():
    if not _HF:
        import torch
        from transformers import AutoModelForCausalLM

        from kiln.sources.builtin import fetch_builtin

        gguf = fetch_builtin(ALIAS, progress=False)
        _HF.append(AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval())
    return _HF[0]


def _parsed(message) -> tuple[str | None, list[tuple[str, str]]]:
    return (message.content,
            [(c.function.name, c.function.arguments) for c in message.tool_calls or []])


@pytest.fixture(scope="module")
def auto_answers(client):
    """The 10 auto prompts' greedy answers from the plain engine."""
    def one(i):
        return _chat(client, AUTO_PROMPTS[i], tools=TOOLS, **GREEDY,
                     max_tokens=MAX_TOKENS).choices[0]

    return _many(one, len(AUTO_PROMPTS))


def test_auto_matches_transformers(auto_answers, engines):
    hermes = get_parser("hermes")([t["function"] for t in TOOLS])
    called = 0
    for prompt, choice in zip(AUTO_PROMPTS, auto_answers):
        ref = hermes.parse(_greedy_transformers([{"role": "user", "content": prompt}],
                                                engines[0]))
        got = _parsed(choice.message)
        assert got == (ref.content, [(c.name, c.arguments) for c in ref.tool_calls]), prompt
        assert choice.finish_reason == ("tool_calls" if ref.tool_calls else "stop")
        called += bool(ref.tool_calls)
    assert 0 < called < len(AUTO_PROMPTS)  # the set has both kinds of answer


def test_multi_turn_with_a_tool_result(client, engines):
    """A call, its result as a tool message, and the model's answer: equal to transformers
    over the same conversation, and it uses the result."""
    first = _chat(client, "What's the weather in Paris?", tools=TOOLS, **GREEDY,
                  tool_choice="required", max_tokens=MAX_TOKENS).choices[0].message
    call = first.tool_calls[0]
    messages = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature_c": 31, "sky": "sunny"})},
    ]
    r = client.chat.completions.create(model="qwen", messages=messages, tools=TOOLS,
                                       **GREEDY, max_tokens=MAX_TOKENS)
    answer = r.choices[0].message
    ref_messages = [messages[0], {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0],
        "function": {"name": call.function.name,
                     "arguments": json.loads(call.function.arguments)}}]}, messages[2]]
    ref = get_parser("hermes")([t["function"] for t in TOOLS]).parse(
        _greedy_transformers(ref_messages, engines[0]))
    assert _parsed(answer) == (ref.content, [(c.name, c.arguments) for c in ref.tool_calls])
    assert answer.content and "31" in answer.content, answer


def _streamed(client, **kw):
    """A streamed answer reassembled the way OpenAI clients do it."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert entry["id"] is None, "a call's id comes once"
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            reason = ch.finish_reason or reason
    assert all(e["id"] for e in calls.values())
    return (content or None, [(e["name"], e["arguments"]) for _, e in sorted(calls.items())],
            reason)


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_streaming_reassembles_to_the_same_calls(client, choice):
    tool_choice = ({"type": "function", "function": {"name": "get_weather"}}
                   if choice == "named" else choice)
    for prompt in (AUTO_PROMPTS[1], AUTO_PROMPTS[6]):
        kw = dict(model="qwen", messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                  tool_choice=tool_choice, **GREEDY, max_tokens=MAX_TOKENS)
        whole = client.chat.completions.create(**kw).choices[0]
        assert _streamed(client, **kw) == (*_parsed(whole.message), whole.finish_reason)


def test_instructor_tools_mode(server):
    instructor = pytest.importorskip("instructor")
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        unit: str

    client = instructor.from_openai(
        openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0),
        mode=instructor.Mode.TOOLS)
    got = client.chat.completions.create(
        model="qwen", response_model=Weather, max_retries=0, **GREEDY, max_tokens=64,
        messages=[{"role": "user", "content": "Paris, in celsius."}])
    assert isinstance(got, Weather) and got.city


def test_lookahead_engine_gives_the_plain_answers(engines, auto_answers, client):
    with ServerProcess(engines[1], "--served-model-name", "qwen", timeout_s=300) as s:
        la = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0,
                           timeout=600)
        for i in (0, 1, 2, 6, 7):  # calls and plain answers
            prompt, plain = AUTO_PROMPTS[i], auto_answers[i]
            got = _chat(la, prompt, tools=TOOLS, **GREEDY, max_tokens=MAX_TOKENS)
            assert _parsed(got.choices[0].message) == _parsed(plain.message), prompt
        for tool_choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            kw = dict(tools=TOOLS, tool_choice=tool_choice, **GREEDY,
                      max_tokens=MAX_TOKENS)
            got = _chat(la, AUTO_PROMPTS[2], **kw).choices[0]
            want = _chat(client, AUTO_PROMPTS[2], **kw).choices[0]
            assert _parsed(got.message) == _parsed(want.message)
            assert _valid_calls(got.message)
            assert _streamed(la, model="qwen", messages=[
                {"role": "user", "content": AUTO_PROMPTS[2]}], **kw)[:2] == _parsed(got.message)
        metrics = httpx.get(s.url + "/metrics").text
        steps = next(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("kiln_spec_decode_steps_total"))
        assert steps > 0, "the lookahead engine never speculated"


def test_pydantic_function_tool_parses(client):
    """The openai client's strict pydantic tools: the arguments parse into the model."""
    from pydantic import BaseModel

    class Forecast(BaseModel):
        city: str
        days: int

    r = client.chat.completions.parse(
        model="qwen", messages=[{"role": "user", "content": "Three-day forecast for Lima."}],
        tools=[openai.pydantic_function_tool(Forecast)], max_tokens=MAX_TOKENS,
        tool_choice={"type": "function", "function": {"name": "Forecast"}}, **GREEDY)
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, Forecast) and parsed.city
