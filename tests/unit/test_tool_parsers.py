"""kiln.tools: the hermes / llama3_json / mistral tool-call parsers, streaming, template
detection and structural tags."""


from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest
import xgrammar as xgr

from kiln.tools import (
    PARSERS,
    ParsedMessage,
    ToolCall,
    ToolDelta,
    ToolParser,
    detect_parser,
    get_parser,
)

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
    "additionalProperties": False,
}
FUNCTIONS = [
    {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_SCHEMA},
    {"name": "get_time", "description": "The time now"},  # no parameters: any object
]

# (text, content, [(name, arguments)]). parse() must give exactly this, and streaming
# must give the same at every split.
WELL_FORMED = {
    "hermes": [
        # recorded: qwen2.5-coder-0.5b, greedy, get_weather in the system prompt
        (('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris",\n'
         '    "unit": "celsius"\n  }\n}\n```'), None,
         [("get_weather", '{\n    "city": "Paris",\n    "unit": "celsius"\n  }')]),
        ("Sea whispers,\nWhispers of the sea,\nWhispers of the sea.",
         "Sea whispers,\nWhispers of the sea,\nWhispers of the sea.", []),
        # the form of Qwen2.5 / Qwen3 chat templates
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         None, [("get_weather", '{"city": "Paris"}')]),
        (('Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": '
         '{"city": "Paris", "unit": "celsius"}}\n</tool_call>'), "Let me check the weather.",
         [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
        (('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'), None,
         [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
        (('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "note": '
         '"東京 ☀ \\u00e9"}}\n</tool_call>'), None,
         [("get_weather", '{"city": "Zürich", "note": "東京 ☀ \\u00e9"}')]),
        ('<tool_call>\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n</tool_call>',
         None, [("get_weather", '{"city": "Oslo"}')]),
        (('<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
         '"arguments": {"q": "a } b { \\" c ]"}}\n</tool_call>\nDone.'),
         "<think>\nThe user wants weather.\n</think>\n\n\nDone.",
         [("get_weather", '{"q": "a } b { \\" c ]"}')]),
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', None,
         [("get_weather", '{"city": "Paris"}')]),
        (('  [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
         '"arguments": {}}]\n'), None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
        ('```\n{"name": "get_time", "arguments": {}}\n```', None, [("get_time", "{}")]),
        # lenient form with an unknown function, a non-JSON fence, trailing text: content
        ('```json\n{"name": "send_mail", "arguments": {}}\n```',
         '```json\n{"name": "send_mail", "arguments": {}}\n```', []),
        ('```python\nprint("hi")\n```', '```python\nprint("hi")\n```', []),
        ('```json\n{"name": "get_time", "arguments": {}}\n```\nThat calls the tool.',
         '```json\n{"name": "get_time", "arguments": {}}\n```\nThat calls the tool.', []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
        ("[1] See the docs.", "[1] See the docs.", []),
        ("Wrap calls in a <tool_call> tag.", "Wrap calls in a <tool_call> tag.", []),
        ("`x` < y <tool", "`x` < y <tool", []),
        # a malformed block stays content; the stream agrees because it fails before the
        # call is committed
        ('<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>',
         '<tool_call>\n{"name": "get_weather", "arguments": "Paris"}\n</tool_call>', []),
        (('<tool_call>\n{"function": "get_weather"}\n</tool_call> then\n<tool_call>\n'
         '{"name": "get_time", "arguments": {}}\n</tool_call>'),
         '<tool_call>\n{"function": "get_weather"}\n</tool_call> then', [("get_time", "{}")]),
        ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ],
    "llama3_json": [
        # the form of Llama 3.1 / 3.2 model cards (custom tools, JSON-based)
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
         [("get_weather", '{"city": "Paris"}')]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
         [("get_weather", '{"city": "Paris"}')]),
        (('{"type": "function", "name": "get_weather", "parameters": {"city": "Paris", '
         '"unit": "celsius"}}'), None,
         [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
        (('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", '
         '"parameters": {}}'), None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
        (('[{"name": "get_weather", "arguments": {"city": "Paris"}},\n {"name": "get_time", '
         '"arguments": {}}]'), None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
        ('\n{"name": "get_weather", "parameters": {"city": "Zürich ☀"}}\n', None,
         [("get_weather", '{"city": "Zürich ☀"}')]),
        ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
        ('{"name": "get_weather", "parameters": "Paris"}',
         '{"name": "get_weather", "parameters": "Paris"}', []),
        ('<|python_tag|>brave_search.call(query="weather")',
         '<|python_tag|>brave_search.call(query="weather")', []),
        ("[]", "[]", []),
        ("<|python", "<|python", []),
    ],
    "mistral": [
        # Mistral-7B-Instruct-v0.3 (tokenizer v3) and Mistral Small 3.2 (v11+) forms
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
         [("get_weather", '{"city": "Paris"}')]),
        (('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
         '"celsius"}}, {"name": "get_time", "arguments": {}}]'), None,
         [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None,
         [("get_weather", '{"city": "Paris"}')]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', None,
         [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
        ('Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "東京"}', "Let me check.",
         [("get_weather", '{"city": "東京"}')]),
        ("It is sunny [in] Paris.", "It is sunny [in] Paris.", []),
        ('[TOOL_CALLS]get_weather{"city": "Paris"}', '[TOOL_CALLS]get_weather{"city": "Paris"}',
         []),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": [1]}]',
         '[TOOL_CALLS][{"name": "get_weather", "arguments": [1]}]', []),
        ('[TOOL_CALLS]get_weather[ARGS]"Paris"', '[TOOL_CALLS]get_weather[ARGS]"Paris"', []),
        ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
        ("Ends with [TOOL_CA", "Ends with [TOOL_CA", []),
    ],
}

# (text, parse() content). parse() keeps all of it as content; the stream may already have
# committed a call when the text goes wrong, but must not crash or lose text.
MALFORMED = {
    "hermes": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # truncated
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',  # unterminated
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}, "x": }'
        "\n</tool_call> tail"),
        '<tool_call>\n{"name": "get_weather", "arguments": {}}} extra\n</tool_call>',
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Pa',
        '{"name": "get_weather", "parameters": {"city": "Paris"}} and some words',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": 5}',
        '[{"name": "get_weather", "parameters": {}}, 7]',
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}} oops',
        '[TOOL_CALLS]get_weather[ARGS]{"city": Paris} more',
    ],
}

# the syntaxes' own words (a call object's other members, like Llama's "type": "function",
# belong to the call)
FRAMING = {"tool_call", "TOOL_CALLS", "ARGS", "python_tag", "name", "arguments", "parameters",
           "type", "function", "json"}


def parser(family: str) -> ToolParser:
    return get_parser(family)(FUNCTIONS)


def splits(text: str, seeds: int = 12):
    """The output cut into pieces at many granularities."""
    yield [text]
    yield [p for c in text for p in ("", c)] + [""]  # empty pieces in between
    for k in range(1, len(text)):
        yield [text[i:i + k] for i in range(0, len(text), k)]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield re.findall(r"<tool_call>|</tool_call>|\[TOOL_CALLS\]|\[ARGS\]|<\|python_tag\|>"
                     r"|\s+|\w+|[^\w\s]+", text)
    for seed in range(seeds):
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            k = rng.randint(1, 6)
            pieces.append(text[i:i + k])
            i += k
        yield pieces


def stream(p: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Feeds the pieces; checks the event shape; returns (content, calls) as parse would."""
    s = p.streamer()
    events: list[ToolDelta] = []
    for piece in pieces:
        events += s.feed(piece)
    events += s.finish()
    content, calls = "", []
    for e in events:
        if e.index is None:
            assert e.content and e.name is None and not e.arguments
            content += e.content
            continue
        assert not e.content
        if e.name is not None:  # a call opens with its name, indices in order
            assert e.index == len(calls)
            calls.append([e.name, ""])
        assert e.index == len(calls) - 1
        calls[-1][1] += e.arguments
    return content or None, [tuple(c) for c in calls]


def expected(content, calls) -> ParsedMessage:
    return ParsedMessage(content, tuple(ToolCall(n, a) for n, a in calls))


CASES = [(f, *case) for f, cases in WELL_FORMED.items() for case in cases]


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_parse(family, text, content, calls):
    got = parser(family).parse(text)
    assert got == expected(content, calls)
    for call in got.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
        assert call.arguments in text  # the model's own text, not a re-dump


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_stream_matches_parse(family, text, content, calls):
    p = parser(family)
    for pieces in splits(text):
        assert stream(p, pieces) == (content, calls), pieces


def _letters(text: str) -> Counter:
    """The letters and digits of ``text`` outside the syntaxes' own words."""
    return Counter("".join(w for w in re.findall(r"\w+", text) if w not in FRAMING))


@pytest.mark.parametrize("family,text", [(f, t) for f, ts in MALFORMED.items() for t in ts])
def test_malformed(family, text):
    p = parser(family)
    assert p.parse(text) == ParsedMessage(text.strip())
    for pieces in splits(text, seeds=4):
        content, calls = stream(p, pieces)
        # nothing is lost: every letter is in the content, a call's name or arguments
        out = _letters(" ".join([content or "", *(f"{n} {a}" for n, a in calls)]))
        assert not _letters(text) - out, (pieces, content, calls)
        if not calls:
            assert content == text.strip()


@pytest.mark.parametrize("family,text,content,calls", CASES)
def test_prefixes_do_not_crash(family, text, content, calls):
    """Every truncation of a good output streams without error and loses nothing."""
    p = parser(family)
    for i in range(len(text)):
        cut = text[:i]
        got, got_calls = stream(p, list(cut))
        out = _letters(" ".join([got or "", *(f"{n} {a}" for n, a in got_calls)]))
        assert not _letters(cut) - out, cut


def test_stream_is_incremental():
    # hermes: content goes out at once; only a possible "<tool_call>" start is held
    s = parser("hermes").streamer()
    assert s.feed("Hello") == [ToolDelta(content="Hello")]
    assert s.feed(" <tool") == []
    assert s.feed("kit> ok") == [ToolDelta(content=" <toolkit> ok")]
    # the name goes out before the arguments are complete, then fragments follow
    s = parser("hermes").streamer()
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    first = text.index('{"city"') + 1
    assert s.feed(text[:first - 1]) == []
    assert s.feed(text[first - 1:first]) == [
        ToolDelta(index=0, name="get_weather", arguments="{")]
    assert s.feed('"city": "Pa') == [ToolDelta(index=0, arguments='"city": "Pa')]
    assert s.feed('ris"}}\n</tool_call>') == [ToolDelta(index=0, arguments='ris"}')]
    assert s.finish() == []


def test_lenient_hold_and_release():
    s = parser("hermes").streamer()
    assert s.feed("```js") == []
    assert s.feed("on\n{") == []  # could still be a fenced call
    s = parser("hermes").streamer()
    assert s.feed("```py") == [ToolDelta(content="```py")]  # not a json fence: content
    s = parser("hermes").streamer()
    assert s.feed('{"name": "get_time", "arguments": {}}') == []
    assert s.feed("\nSo") == [ToolDelta(content='{"name": "get_time", "arguments": {}}\nSo')]
    # with no functions in the request the lenient form is off
    s = get_parser("hermes")([]).streamer()
    assert s.feed("{") == [ToolDelta(content="{")]
    assert get_parser("hermes")([]).parse('{"name": "f", "arguments": {}}').tool_calls == ()


def test_llama_and_mistral_hold_only_while_undecided():
    s = parser("llama3_json").streamer()
    assert s.feed(" <|py") == []
    assert s.feed("thon_tag|>Sure") == [ToolDelta(content="<|python_tag|>Sure")]
    s = parser("llama3_json").streamer()
    assert s.feed("The") == [ToolDelta(content="The")]
    s = parser("mistral").streamer()
    assert s.feed("Hi [TOOL") == [ToolDelta(content="Hi")]
    assert s.feed("_CALLS]get_weather[AR") == []
    assert s.feed("GS]{") == [ToolDelta(index=0, name="get_weather", arguments="{")]


def test_registry():
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral"}
    for name, cls in PARSERS.items():
        assert get_parser(name) is cls and cls.name == name
    with pytest.raises(ValueError, match="tool parser 'foo' is unknown; use one of "
                                         "hermes, llama3_json, mistral"):
        get_parser("foo")


# Qwen2.5 (-Coder) -Instruct's chat template, as the q05 engine carries it
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user \
query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# excerpts of Llama 3.1-Instruct's and Llama 3.2-Instruct's templates
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}{%- set tools = custom_tools %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and \
its value}.' }}
{%- for message in messages %}
    {%- if 'tool_calls' in message %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
        {%- else %}
            {{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | \
tojson }}{{- "}" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
    {%- endif %}
{%- endfor %}"""
LLAMA32_TEMPLATE = LLAMA31_TEMPLATE.replace(
    '{{- "<|python_tag|>" + tool_call.name + ".call(" }}', "")

# excerpts of Mistral-7B-Instruct-v0.3's (v3) and Mistral-Small-3.2's (v11) templates
MISTRAL_V3_TEMPLATE = """{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}{%- for tool in tools %}{{- tool|tojson }}{%- endfor \
%}{{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
    {%- endif %}
{%- endfor %}"""
MISTRAL_V11_TEMPLATE = """{%- if tools is defined and tools %}[AVAILABLE_TOOLS]{{ tools|tojson \
}}[/AVAILABLE_TOOLS]{%- endif %}
{%- for tool_call in message['tool_calls'] %}{{- '[TOOL_CALLS]' + tool_call['function']['name'] + \
'[ARGS]' + tool_call['function']['arguments']|tojson }}{%- endfor %}"""


def test_detect_parser():
    from kiln.sources.tokenizer import CHATML_TEMPLATE

    assert detect_parser(QWEN25_TEMPLATE) == "hermes"
    assert detect_parser(LLAMA31_TEMPLATE) == "llama3_json"
    assert detect_parser(LLAMA32_TEMPLATE) == "llama3_json"
    assert detect_parser(MISTRAL_V3_TEMPLATE) == "mistral"
    assert detect_parser(MISTRAL_V11_TEMPLATE) == "mistral"
    assert detect_parser(CHATML_TEMPLATE) is None  # no tools support
    assert detect_parser(None) is None
    assert detect_parser("") is None
    assert detect_parser("{% if tools %}{{ tools | tojson }}{% endif %}") is None  # unknown


# ---- structural tags ----

VOCAB = 260  # the byte tokenizer: 256 bytes + 4 specials
EOS = 257


@pytest.fixture(scope="module")
def compiler():
    from kiln.sources import make_byte_tokenizer

    info = xgr.TokenizerInfo.from_huggingface(make_byte_tokenizer(), vocab_size=VOCAB)
    return xgr.GrammarCompiler(info)


def accepts(compiler, tag: dict, text: str) -> bool:
    grammar = compiler.compile_structural_tag(json.dumps(tag))
    matcher = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def call_text(family: str, name: str, args: str) -> str:
    if family == "hermes":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
    if family == "llama3_json":
        return f'{{"name": "{name}", "parameters": {args}}}'
    return f'{{"name": "{name}", "arguments": {args}}}'


def calls_text(family: str, calls: list[tuple[str, str]]) -> str:
    if family == "mistral":
        return "[TOOL_CALLS][" + ", ".join(call_text(family, *c) for c in calls) + "]"
    sep = "\n" if family == "hermes" else "; "
    return sep.join(call_text(family, *c) for c in calls)


W = ("get_weather", '{"city": "Paris"}')
W2 = ("get_weather", '{"city":"Oslo","unit":"fahrenheit"}')
T = ("get_time", '{"any": [1, {"x": null}]}')


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_structural_tag_required(compiler, family):
    p = parser(family)
    tag = p.structural_tag("required", parallel=True)
    assert json.loads(json.dumps(tag)) == tag
    for calls in ([W], [W2], [T], [W, T], [T, W2, W]):
        text = calls_text(family, calls)
        assert accepts(compiler, tag, text), text
        assert p.parse(text) == expected(None, calls)  # what the grammar allows parses back
    bad_args = [("get_weather", '{"city": "Paris", "unit": "kelvin"}'),
                ("get_weather", '{"unit": "celsius"}'), ("get_weather", '{"town": "Paris"}'),
                ("get_weather", '"Paris"'), ("get_weather_now", '{"city": "Paris"}')]
    for bad in bad_args:
        assert not accepts(compiler, tag, calls_text(family, [bad])), bad
    assert not accepts(compiler, tag, "")
    assert not accepts(compiler, tag, "Sure! " + calls_text(family, [W]))  # no free text
    assert not accepts(compiler, tag, calls_text(family, [W]) + " done")
    single = p.structural_tag("required", parallel=False)
    assert accepts(compiler, single, calls_text(family, [W]))
    assert not accepts(compiler, single, calls_text(family, [W, T]))


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_structural_tag_named(compiler, family):
    p = parser(family)
    tag = p.structural_tag("named", parallel=True, name="get_weather")
    assert accepts(compiler, tag, calls_text(family, [W]))
    assert not accepts(compiler, tag, calls_text(family, [T]))
    assert not accepts(compiler, tag, calls_text(family, [W, W]))
    assert not accepts(compiler, tag, calls_text(family, [("get_weather", '{"city": 1}')]))
    with pytest.raises(ValueError, match="not among"):
        p.structural_tag("named", parallel=True, name="nope")
    with pytest.raises(ValueError, match="unknown"):
        p.structural_tag("sometimes", parallel=True)
    with pytest.raises(ValueError, match="at least one function"):
        get_parser(family)([]).structural_tag("required", parallel=True)


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_structural_tag_auto(compiler, family):
    p = parser(family)
    tag = p.structural_tag("auto", parallel=True)
    assert accepts(compiler, tag, "It is sunny in Paris.")
    assert accepts(compiler, tag, calls_text(family, [W, T]))
    bad = calls_text(family, [("get_weather", '{"city": "Paris", "unit": "kelvin"}')])
    assert not accepts(compiler, tag, bad)
    if family != "llama3_json":  # llama calls are the whole output; others mix with text
        text = "Let me check. " + calls_text(family, [W])
        assert accepts(compiler, tag, text)
        assert p.parse(text) == expected("Let me check.", [W])


def _walk(compiler, tag: dict, seed: int, limit: int = 600) -> str:
    """Samples uniformly among the tokens the grammar allows until it ends."""
    import torch

    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    rng = random.Random(seed)
    out = []
    for _ in range(limit):
        matcher.fill_next_token_bitmask(bitmask)
        logits = torch.zeros(1, VOCAB)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
        token = rng.choice(allowed)
        assert matcher.accept_token(token)
        if token == EOS:
            return bytes(out).decode()
        out.append(token)
    raise AssertionError("the walk did not end")


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_structural_tag_outputs_parse(compiler, family):
    """Random outputs the "required" grammar allows all parse as valid calls."""
    functions = [{"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Oslo"]}, "ok": {"type": "boolean"}}}}]
    p = get_parser(family)(functions)
    tag = p.structural_tag("required", parallel=True)
    for seed in range(6):
        text = _walk(compiler, tag, seed)
        msg = p.parse(text)
        assert msg.content is None and msg.tool_calls, text
        for call in msg.tool_calls:
            args = json.loads(call.arguments)
            assert call.name == "get_weather" and args["city"] in ("Paris", "Oslo"), text
        assert stream(p, list(text)) == (None, [(c.name, c.arguments) for c in msg.tool_calls])


def test_only_mistral_keeps_special_tokens():
    """Mistral's [TOOL_CALLS] / [ARGS] are special tokens: its output is decoded with them."""
    assert {name: cls.keeps_special_tokens for name, cls in PARSERS.items()} == {
        "hermes": False, "llama3_json": False, "mistral": True}


def test_call_ids():
    """OpenAI's call_ + 24 hex digits; Mistral's templates accept only 9 letters and digits."""
    import re

    ids = {name: {cls.new_call_id() for _ in range(50)} for name, cls in PARSERS.items()}
    assert all(len(v) == 50 for v in ids.values())  # fresh each time
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids["hermes"] | ids["llama3_json"])
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids["mistral"])
