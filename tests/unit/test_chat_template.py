"""LLMEngine.apply_chat_template: tools and tool calls reach the template; a template's own
error is a ValueError (the server's 400 naming messages), not an internal error."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kiln.runtime.engine import LLMEngine
from kiln.server.protocol import ChatMessage, chat_dicts
from kiln.sources.tokenizer import make_byte_tokenizer

# Renders what a tools-aware template reads: the tools, each call's arguments with tojson
# (so they must be an object, not JSON text), the tool message's call id.
TEMPLATE = (
    "{% for t in tools or [] %}T:{{ t.function.name }}|{% endfor %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}C:{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}{% if m.tool_call_id %}@{{ m.tool_call_id }}{% endif %};{% endfor %}"
    "{% if messages[-1].content == 'boom' %}{{ raise_exception('no booms') }}{% endif %}")


def _render(messages: list[dict], tools: list[dict] | None = None) -> str:
    tok = make_byte_tokenizer()
    tok.chat_template = TEMPLATE
    ids = LLMEngine.apply_chat_template(SimpleNamespace(tokenizer=tok), messages, tools)
    return tok.decode(ids)


def test_tools_and_calls_reach_the_template():
    msgs = [ChatMessage(role="user", content="hi"),
            ChatMessage(role="assistant", tool_calls=[{"id": "call_1", "type": "function",
                        "function": {"name": "f", "arguments": '{"a": 1}'}}]),
            ChatMessage(role="tool", tool_call_id="call_1", content="2")]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert _render(chat_dicts(msgs), tools) == ('T:f|user:hi;assistant:C:f' + json.dumps({"a": 1})
                                                + ';tool:2@call_1;')


def test_a_template_error_is_a_value_error():
    with pytest.raises(ValueError, match="chat template rejected the messages: no booms"):
        _render([{"role": "user", "content": "boom"}])
