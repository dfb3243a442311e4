"""Tool calling: what a chat-template family writes when the model calls a function.

A ``ToolParser`` knows one family's call syntax (Qwen2.5 / Hermes ``<tool_call>`` blocks,
Llama 3.1+ JSON calls, Mistral ``[TOOL_CALLS]``). It parses a finished output into content
and calls, parses a stream incrementally, and states the structural tag (xgrammar) that
makes the model write well-formed calls. Which family an engine speaks is chosen from its
chat template at build (``detect_parser``) and recorded in engine.json; the server reads it
from there (``kiln serve --tool-parser`` overrides it).

The interface is in ``base``, the families in ``hermes``, ``llama3_json`` and ``mistral``,
the names and the template detection in ``registry``; all of it is exported here.
"""

from __future__ import annotations

from kiln.tools.base import (
    ParsedMessage,
    ToolCall,
    ToolDelta,
    ToolMode,
    ToolParser,
    ToolStreamer,
)
from kiln.tools.registry import PARSERS, detect_parser, get_parser

__all__ = [
    "PARSERS", "ParsedMessage", "ToolCall", "ToolDelta", "ToolMode", "ToolParser",
    "ToolStreamer", "detect_parser", "get_parser",
]
