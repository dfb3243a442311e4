"""The tool-calling interface every chat-template family implements (see ``kiln.tools``)."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

ToolMode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as the model wrote them (the text of
    a JSON object; clients ``json.loads`` it)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedMessage:
    """A finished assistant output: ``content`` (None when the output was only calls) and
    the calls in the order written."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


def split_marked(text: str, marker: str,
                 read: Callable[[str, int], tuple[list[ToolCall], int] | None]
                 ) -> ParsedMessage:
    """The ``ParsedMessage`` of an output whose calls follow ``marker``: ``read(text, i)``
    reads the call group whose marker starts at ``i`` (its calls and the index after it, or
    None when the marker starts no well-formed group: the marker is then text). Content is
    the text outside the groups, stripped."""
    outside: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (i := text.find(marker, pos)) >= 0:
        outside.append(text[pos:i])
        group = read(text, i)
        if group is None:  # the marker is text; look for calls after it
            outside.append(marker)
            pos = i + len(marker)
            continue
        calls.extend(group[0])
        pos = group[1]
    outside.append(text[pos:])
    return ParsedMessage("".join(outside).strip() or None, tuple(calls))


@dataclass(frozen=True)
class ToolDelta:
    """One streaming event: plain ``content`` text, or a piece of call ``index``: its
    ``name`` (on the call's first event only) and/or a fragment of its ``arguments``.
    Concatenating a call's fragments gives ``ToolCall.arguments``."""

    content: str = ""
    index: int | None = None
    name: str | None = None
    arguments: str = ""


class ToolStreamer(ABC):
    """Incremental parsing of one streamed output. Text that might still turn into a call
    (a partial start marker) is held back until it is decided."""

    @abstractmethod
    def feed(self, text: str) -> list[ToolDelta]:
        """The events that ``text`` (the next piece of the output) completes."""

    @abstractmethod
    def finish(self) -> list[ToolDelta]:
        """The events left when the output ends (held-back text becomes content)."""


class ToolParser(ABC):
    """One chat-template family's tool-call syntax, for one request: ``functions`` are the
    request's tools (OpenAI function objects: name, description, parameters, strict)."""

    name: ClassVar[str]
    # The family's call markers are special tokens: its outputs are decoded keeping them.
    keeps_special_tokens: ClassVar[bool] = False

    @classmethod
    def new_call_id(cls) -> str:
        """A fresh id for one call (OpenAI's form, ``call_`` and 24 hex digits)."""
        return "call_" + uuid.uuid4().hex[:24]

    def __init__(self, functions: list[dict[str, Any]]):
        self.functions = functions
        self.names = frozenset(f["name"] for f in functions)

    @abstractmethod
    def parse(self, text: str) -> ParsedMessage:
        """Content and calls of a finished output. Output that is not a well-formed call
        (bad JSON, an unknown shape) stays content: nothing the model wrote is lost."""

    @abstractmethod
    def streamer(self) -> ToolStreamer:
        """A fresh incremental parser for one output."""

    @abstractmethod
    def structural_tag(self, mode: ToolMode, parallel: bool,
                       name: str | None = None) -> dict[str, Any]:
        """The xgrammar structural tag (a JSON-able dict) over ``self.functions``: "auto"
        lets text and calls mix, every call well-formed (its arguments match the function's
        parameters schema); "required" makes the output calls only, at least one; "named"
        makes it exactly one call of function ``name``. ``parallel`` False: at most one
        call."""
