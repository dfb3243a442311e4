"""The tool parsers by name, and the family a chat template speaks."""

from __future__ import annotations

import re

from kiln.tools.base import ToolParser
from kiln.tools.hermes import HermesParser
from kiln.tools.llama3_json import Llama3JsonParser
from kiln.tools.mistral import MistralParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}

_TOOLS_VAR = re.compile(r"\btools\b")


def get_parser(name: str) -> type[ToolParser]:
    """The parser class called ``name``; ValueError naming the valid ones otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"tool parser {name!r} is unknown; use one of "
                         f"{', '.join(sorted(PARSERS))}") from None


def detect_parser(chat_template: str | None) -> str | None:
    """The parser family a chat template (jinja text) writes tool calls in, or None when it
    has no tools support (never mentions ``tools``) or speaks none of the known ones."""
    if not chat_template or not _TOOLS_VAR.search(chat_template):
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or (
            "ipython" in chat_template and "parameters" in chat_template):
        return "llama3_json"
    return None
