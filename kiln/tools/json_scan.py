"""JSON scanning shared by the tool parsers.

Whole outputs are scanned key by key with ``json.JSONDecoder.raw_decode``, so each value's
span in the output is known: a call's arguments are the model's own text, not a re-dump.
Streams use ``ValueEnd`` and ``CallScan``, which look at each new character once and hand
the finished pieces to ``raw_decode`` for validation; for well-formed text the two agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln.tools.base import ToolCall

_DECODER = json.JSONDecoder()
_JSON_WS = " \t\n\r"
_SCALAR_END = ",:}] \t\n\r"
NAME_KEY = "name"
ARGS_KEYS = ("arguments", "parameters")


def skip_space(text: str, pos: int) -> int:
    """The first index at or after ``pos`` that is not whitespace (``str.isspace``): the
    space the call syntaxes allow around their markers."""
    n = len(text)
    while pos < n and text[pos].isspace():
        pos += 1
    return pos


def skip_json_ws(text: str, pos: int) -> int:
    """The first index at or after ``pos`` that is not JSON whitespace."""
    n = len(text)
    while pos < n and text[pos] in _JSON_WS:
        pos += 1
    return pos


def held_suffix(text: str, start: int, marker: str) -> int:
    """How many trailing characters of ``text[start:]`` could be the start of ``marker``:
    those must wait for the next piece before they can be called content."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass(frozen=True)
class Span:
    """One decoded JSON value and where its text lies in the output."""

    value: Any
    start: int
    end: int


def scan_object(text: str, pos: int) -> tuple[dict[str, Span], int] | None:
    """The members of the JSON object starting at ``text[pos]`` (each with its span) and the
    index after its closing brace; None when no well-formed object starts there. A repeated
    key is malformed too: which value a client would see is ambiguous."""
    if not text.startswith("{", pos):
        return None
    members: dict[str, Span] = {}
    pos = skip_json_ws(text, pos + 1)
    if text.startswith("}", pos):
        return members, pos + 1
    try:
        while True:
            if not text.startswith('"', pos):
                return None
            key, pos = _DECODER.raw_decode(text, pos)
            pos = skip_json_ws(text, pos)
            if key in members or not text.startswith(":", pos):
                return None
            start = skip_json_ws(text, pos + 1)
            value, pos = _DECODER.raw_decode(text, start)
            members[key] = Span(value, start, pos)
            pos = skip_json_ws(text, pos)
            if text.startswith("}", pos):
                return members, pos + 1
            if not text.startswith(",", pos):
                return None
            pos = skip_json_ws(text, pos + 1)
    except ValueError:  # json.JSONDecodeError: not JSON there
        return None


def call_from_members(text: str, members: dict[str, Span]) -> ToolCall | None:
    """The call an object's members describe: a non-empty string "name" and exactly one of
    "arguments" / "parameters", an object. None for any other shape."""
    name = members.get(NAME_KEY)
    args = [members[k] for k in ARGS_KEYS if k in members]
    if name is None or not isinstance(name.value, str) or not name.value:
        return None
    if len(args) != 1 or not isinstance(args[0].value, dict):
        return None
    return ToolCall(name.value, text[args[0].start:args[0].end])


def scan_call(text: str, pos: int) -> tuple[ToolCall, int] | None:
    """The call object starting at ``text[pos]`` and the index after it, or None."""
    got = scan_object(text, pos)
    if got is None:
        return None
    call = call_from_members(text, got[0])
    return None if call is None else (call, got[1])


def scan_call_list(text: str, pos: int) -> tuple[list[ToolCall], int] | None:
    """A non-empty JSON list of call objects starting at ``text[pos]`` and the index after
    its closing bracket, or None."""
    if not text.startswith("[", pos):
        return None
    calls: list[ToolCall] = []
    pos = skip_json_ws(text, pos + 1)
    while True:
        got = scan_call(text, pos)
        if got is None:
            return None
        calls.append(got[0])
        pos = skip_json_ws(text, got[1])
        if text.startswith("]", pos):
            return calls, pos + 1
        if not text.startswith(",", pos):
            return None
        pos = skip_json_ws(text, pos + 1)


def decode_value(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value at ``text[start]`` and the index after it, or None."""
    try:
        return _DECODER.raw_decode(text, start)
    except ValueError:
        return None


def decode_at(text: str, start: int, end: int) -> tuple[bool, Any]:
    """``(True, value)`` when ``text[start:end]`` is exactly one JSON value, else
    ``(False, None)``."""
    try:
        value, stop = _DECODER.raw_decode(text, start)
    except ValueError:
        return False, None
    return stop == end, value


class ValueEnd:
    """Where the JSON value starting at ``text[start]`` ends, found as the text grows. It
    only delimits (strings, nesting, a scalar's closing delimiter); validation is left to
    ``raw_decode`` once the end is known."""

    def __init__(self, text: str, start: int):
        first = text[start]
        self.start = start
        self.scalar = first not in '"{['
        self.in_string = first == '"'
        self.escaped = False
        self.depth = 1 if first in "{[" else 0
        self.pos = start if self.scalar else start + 1  # text[start:pos] is inside the value
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        """The index after the value once it is complete, else None (more text needed)."""
        if self.end is None:
            self.end = self._scan(text)
        return self.end

    def _scan(self, text: str) -> int | None:
        n, i = len(text), self.pos
        if self.scalar:  # a number or literal ends at the next delimiter
            while i < n and text[i] not in _SCALAR_END:
                i += 1
            self.pos = i
            return i if i < n else None
        while i < n:
            c = text[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.pos = i
                        return i
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i
                    return i
        self.pos = i
        return None


class CallScan:
    """One call object (``{"name": ..., "arguments": {...}}``) scanned as a stream grows.

    It tells the name once complete, where the arguments object starts and how much of it
    has arrived (``args_upto``), and whether the object ended as a call (``done``) or
    stopped making sense (``failed``). Its rules are those of
    ``scan_object`` + ``call_from_members``, checked as early as the text allows.
    """

    def __init__(self, start: int):
        self.start = start
        self.pos = start + 1
        self.state = "first"  # first | key | colon | value | sep | done | failed
        self.members: dict[str, Span] = {}
        self.key = ""
        self.reading: ValueEnd | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None  # once delimited, valid JSON or not
        self.end: int | None = None

    @property
    def name(self) -> str | None:
        """The function name once its string is complete."""
        span = self.members.get(NAME_KEY)
        return span.value if span is not None else None

    @property
    def done(self) -> bool:
        """The object ended and is a well-formed call."""
        return self.state == "done"

    @property
    def failed(self) -> bool:
        """The text stopped being a well-formed call."""
        return self.state == "failed"

    def args_upto(self) -> int:
        """The end of the arguments text received so far (all of it inside the value)."""
        if self.args_start is None:
            return 0
        if self.args_end is not None:
            return self.args_end
        return self.reading.pos if self.reading is not None else self.args_start

    def _fail(self) -> None:
        self.state, self.reading = "failed", None

    def advance(self, text: str) -> None:
        """Scan what ``text`` (the whole output so far) adds."""
        while self.state not in ("done", "failed"):
            if self.reading is not None:
                if not self._finish_token(text):
                    return
                continue
            pos = self.pos = skip_json_ws(text, self.pos)
            if pos >= len(text):
                return
            c = text[pos]
            if self.state == "first" and c == "}":
                self._close(pos)
            elif self.state in ("first", "key"):
                if c != '"':
                    return self._fail()
                self.state, self.reading = "key", ValueEnd(text, pos)
            elif self.state == "colon":
                if c != ":":
                    return self._fail()
                self.pos, self.state = pos + 1, "value"
            elif self.state == "value":
                if self.key in ARGS_KEYS:
                    if c != "{" or self.args_start is not None:
                        return self._fail()
                    self.args_start = pos
                elif self.key == NAME_KEY and c != '"':
                    return self._fail()
                self.reading = ValueEnd(text, pos)
            elif c == ",":  # state "sep"
                self.pos, self.state = pos + 1, "key"
            elif c == "}":
                self._close(pos)
            else:
                return self._fail()

    def _finish_token(self, text: str) -> bool:
        """Completes the key or value being read; False while it needs more text."""
        assert self.reading is not None
        end = self.reading.advance(text)
        if end is None:
            return False
        start, self.reading = self.reading.start, None
        if start == self.args_start:
            self.args_end = end
        ok, value = decode_at(text, start, end)
        if not ok:
            self._fail()
        elif self.state == "key":
            if value in self.members:
                self._fail()
            else:
                self.key, self.state, self.pos = value, "colon", end
        elif (self.key == NAME_KEY and not value) or (
                self.key in ARGS_KEYS and not isinstance(value, dict)):
            self._fail()
        else:
            self.members[self.key] = Span(value, start, end)
            self.state, self.pos = "sep", end
        return True

    def _close(self, pos: int) -> None:
        if self.name is None or self.args_start is None:
            return self._fail()
        self.state, self.end = "done", pos + 1


class ArgsScan:
    """A call whose name is already known (Mistral's ``name[ARGS]{...}``): only the
    arguments object, starting at ``text[start]`` (a "{"), is scanned. Same interface as
    ``CallScan``."""

    def __init__(self, text: str, name: str, start: int):
        self.name = name
        self.start = self.args_start = start
        self.reading = ValueEnd(text, start)
        self.end: int | None = None
        self.failed = False

    @property
    def done(self) -> bool:
        """The arguments object ended and is a JSON object."""
        return self.end is not None

    def args_upto(self) -> int:
        """The end of the arguments text received so far."""
        return self.end if self.end is not None else self.reading.pos

    def advance(self, text: str) -> None:
        """Scan what ``text`` (the whole output so far) adds."""
        if self.done or self.failed:
            return
        end = self.reading.advance(text)
        if end is not None:
            ok, value = decode_at(text, self.start, end)
            if ok and isinstance(value, dict):
                self.end = end
            else:
                self.failed = True
