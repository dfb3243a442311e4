"""Hermes / Qwen2.5 / Qwen3 tool calls: ``<tool_call>`` blocks of JSON.

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Small Qwen coder models often skip the tags and answer with the call alone, in a fenced
``json`` block or as bare JSON; that output is taken as calls when it is nothing else and
every name is one of the request's functions.
"""

from __future__ import annotations

from typing import Any

from kiln.tools import tags as st
from kiln.tools.base import (
    ParsedMessage,
    ToolCall,
    ToolMode,
    ToolParser,
    ToolStreamer,
    split_marked,
)
from kiln.tools.json_scan import (
    CallScan,
    ValueEnd,
    held_suffix,
    scan_call,
    scan_call_list,
    skip_space,
)
from kiln.tools.streaming import CallStreamer

START = "<tool_call>"
END = "</tool_call>"
FENCE = "```"
_FENCE_LINES = ("```", "```json")  # a fence's first line, lowercased and right-stripped


class HermesParser(ToolParser):
    """``<tool_call>`` blocks, plus the whole-output fenced / bare JSON call."""

    name = "hermes"

    def parse(self, text: str) -> ParsedMessage:
        """Content (the text outside well-formed blocks, stripped) and the blocks' calls."""
        lenient = self.lenient_calls(text)
        if lenient is not None:
            return ParsedMessage(None, tuple(lenient))
        def read(text: str, i: int) -> tuple[list[ToolCall], int] | None:
            block = _block(text, i)
            return None if block is None else ([block[0]], block[1])

        return split_marked(text, START, read)

    def lenient_calls(self, text: str) -> list[ToolCall] | None:
        """The calls when the whole output is a fenced (```` ``` ```` or ```` ```json ````)
        or bare JSON call object or list of them, every name one of the request's."""
        if not self.names:
            return None
        s = text.strip()
        if s.startswith("`"):
            nl = s.find("\n")
            if nl < 0 or s[:nl].rstrip().lower() not in _FENCE_LINES or not s.endswith(FENCE):
                return None
            body, start = s[:len(s) - len(FENCE)], nl + 1
            if len(body) < start:
                return None
            start = skip_space(body, start)
        else:
            body, start = s, 0
        got = self.json_calls(body, start)
        if got is None or body[got[1]:].strip():
            return None
        return got[0]

    def json_calls(self, text: str, pos: int) -> tuple[list[ToolCall], int] | None:
        """A call object or list of them at ``text[pos]``, all of known functions, and the
        index after it."""
        if text.startswith("[", pos):
            got = scan_call_list(text, pos)
        else:
            one = scan_call(text, pos)
            got = None if one is None else ([one[0]], one[1])
        if got is None or any(c.name not in self.names for c in got[0]):
            return None
        return got

    def streamer(self) -> ToolStreamer:
        """A fresh incremental parser for one output."""
        return HermesStreamer(self)

    def structural_tag(self, mode: ToolMode, parallel: bool,
                       name: str | None = None) -> dict[str, Any]:
        """Blocks ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``:
        between free text ("auto"), alone and "\\n"-separated ("required"), or one block
        of ``name`` ("named")."""
        tags = [st.call_tag(f'{START}\n{{"name": {st.quoted(f["name"])}, "arguments": ', f,
                            f"}}\n{END}")
                for f in st.chosen(self.functions, mode, name)]
        if mode == "named":
            return st.structural_tag(tags[0])
        if mode == "required":
            return st.structural_tag(st.calls(tags, "\n", parallel))
        return st.structural_tag({"type": "triggered_tags", "triggers": [START], "tags": tags,
                                  "at_least_one": False, "stop_after_first": not parallel})


def _block(text: str, i: int) -> tuple[ToolCall, int] | None:
    """The call of the block whose marker is at ``text[i]`` and the index after the block."""
    got = scan_call(text, skip_space(text, i + len(START)))
    if got is None:
        return None
    end = skip_space(text, got[1])
    return (got[0], end + len(END)) if text.startswith(END, end) else None


class HermesStreamer(CallStreamer):
    """States: "lenient" (the output so far could still be a whole-output call: hold it),
    "content", "block" (after ``<tool_call>``), "call" (the object), "close" (before
    ``</tool_call>``)."""

    def __init__(self, parser: HermesParser):
        super().__init__()
        self.parser = parser
        self.state = "lenient" if parser.names else "content"
        self.block = 0  # where the block in progress starts
        self.json: ValueEnd | None = None  # the lenient JSON value
        self.verdict: str | None = None  # the lenient verdict once the JSON is complete

    def _run(self, final: bool) -> None:
        text = self.text
        while True:
            if self.state == "lenient":
                if self._lenient() == "no":
                    self.state, self.pos = "content", 0
                    continue
                if final:  # nothing was emitted: the events are the whole parse
                    self._emit(self.parser.parse(text))
                    self.state = "over"
                return
            if self.state == "content":
                i = text.find(START, self.pos)
                if i < 0:
                    stop = len(text) - (0 if final else held_suffix(text, self.pos, START))
                    self.out.content(text[self.pos:stop])
                    self.pos = stop
                    return
                self.out.content(text[self.pos:i])
                self.block, self.pos, self.state = i, i + len(START), "block"
            elif self.state == "block":
                j = skip_space(text, self.pos)
                if j == len(text) and not final:
                    return
                if j == len(text) or text[j] != "{":
                    self._unblock()
                else:
                    self.begin_call(CallScan(j))
                    self.state = "call"
            elif self.state == "call":
                step = self.step_call()
                if step == "more" and not final:
                    return
                if step != "done":
                    self._break()
                else:
                    assert self.call is not None and self.call.end is not None
                    self.pos, self.state = self.call.end, "close"
            elif self.state == "close":
                j = skip_space(text, self.pos)
                if text.startswith(END, j):
                    self.pos, self.state, self.call = j + len(END), "content", None
                elif END.startswith(text[j:]) and not final:
                    return
                else:  # a committed call without its end marker: the rest is content
                    self.state, self.call = "content", None
            else:
                return

    def _unblock(self) -> None:
        """The block is not a call and nothing of it was emitted: its marker is content and
        the text after it is looked at again, as ``parse`` does."""
        self.out.content(START)
        self.pos, self.state, self.call = self.block + len(START), "content", None

    def _break(self) -> None:
        if not self.committed:
            return self._unblock()
        self.pos, self.state, self.call = self.break_pos(), "content", None

    def _emit(self, msg: ParsedMessage) -> None:
        if msg.content:
            self.out.content(msg.content)
        for call in msg.tool_calls:
            self.out.start_call(call.name)
            self.out.arguments(call.arguments)

    def _lenient(self) -> str:
        """"hold" while the output so far could still be a whole-output call, else "no"."""
        text = self.text
        s = skip_space(text, 0)
        if s == len(text):
            return "hold"
        fenced = text[s] == "`"
        if fenced:
            nl = text.find("\n", s)
            line = text[s:nl if nl >= 0 else len(text)].rstrip().lower()
            if nl < 0:
                return "hold" if "```json".startswith(line) else "no"
            if line not in _FENCE_LINES:
                return "no"
            s = skip_space(text, nl + 1)
            if s == len(text):
                return "hold"
        if text[s] not in "{[":
            return "no"
        if self.json is None:
            self.json = ValueEnd(text, s)
        end = self.json.advance(text)
        if end is None:
            return "hold"
        if self.verdict is None:
            got = self.parser.json_calls(text, s)
            self.verdict = "no" if got is None or got[1] != end else "hold"
        tail = text[end:].strip()
        if self.verdict == "no" or (tail and not (fenced and FENCE.startswith(tail))):
            return "no"
        return "hold"
