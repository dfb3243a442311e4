"""Llama 3.1+ / 3.2 JSON tool calls: the whole output is the call.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after ``<|python_tag|>``; several calls are separated by ";" (vLLM's
``llama3_json`` convention) or written as a JSON list. Any other output is content.
"""

from __future__ import annotations

from typing import Any

from kiln.tools import tags as st
from kiln.tools.base import ParsedMessage, ToolCall, ToolMode, ToolParser, ToolStreamer
from kiln.tools.json_scan import CallScan, scan_call, scan_call_list, skip_space
from kiln.tools.streaming import CallStreamer

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"
_TRIGGER = '{"name"'


class Llama3JsonParser(ToolParser):
    """Llama 3 JSON calls: one object, ";"-separated objects, or a list of them."""

    name = "llama3_json"

    def parse(self, text: str) -> ParsedMessage:
        """Calls (content None) when the whole output is calls, else the stripped text."""
        calls = self.calls(text)
        if calls is None:
            return ParsedMessage(text.strip() or None)
        return ParsedMessage(None, tuple(calls))

    @staticmethod
    def calls(text: str) -> list[ToolCall] | None:
        """The calls when the whole output is calls, else None."""
        pos = skip_space(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = skip_space(text, pos + len(PYTHON_TAG))
        if text.startswith("[", pos):
            got = scan_call_list(text, pos)
            return got[0] if got is not None and not text[got[1]:].strip() else None
        calls: list[ToolCall] = []
        while True:
            one = scan_call(text, pos)
            if one is None:
                return None
            calls.append(one[0])
            pos = skip_space(text, one[1])
            if text.startswith(SEPARATOR, pos):  # optional between calls, and after the last
                pos = skip_space(text, pos + 1)
            if pos == len(text):
                return calls

    def streamer(self) -> ToolStreamer:
        """A fresh incremental parser for one output."""
        return Llama3JsonStreamer()

    def structural_tag(self, mode: ToolMode, parallel: bool,
                       name: str | None = None) -> dict[str, Any]:
        """Calls ``{"name": "NAME", "parameters": ARGS}``: "; "-separated ("required"),
        exactly one of ``name`` ("named"), or ("auto") either those calls or free text
        without ``{"name"`` in it (this parser reads text around a call as content, so a
        call is only ever the whole output)."""
        tags = [st.call_tag(f'{{"name": {st.quoted(f["name"])}, "parameters": ', f, "}")
                for f in st.chosen(self.functions, mode, name)]
        if mode == "named":
            return st.structural_tag(tags[0])
        calls = st.calls(tags, f"{SEPARATOR} ", parallel)
        if mode == "required":
            return st.structural_tag(calls)
        return st.structural_tag({"type": "or", "elements": [
            calls, {"type": "any_text", "excludes": [_TRIGGER]}]})


class Llama3JsonStreamer(CallStreamer):
    """States: "start" (before the first "{" or "["; held), "call", "sep" (after a call),
    "next" (after ";"), "list", "tail" (after the list), "content" (all the rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "start"

    def _run(self, final: bool) -> None:
        text = self.text
        while True:
            if self.state == "content":
                self.out.content(text[self.pos:])
                self.pos = len(text)
                return
            if self.state == "start":
                j = skip_space(text, 0)
                if text.startswith(PYTHON_TAG, j):
                    j = skip_space(text, j + len(PYTHON_TAG))
                elif PYTHON_TAG.startswith(text[j:]) and not final:
                    return
                if j == len(text) and not final:
                    return
                if text.startswith("{", j):
                    self.begin_call(CallScan(j))
                    self.state = "call"
                elif text.startswith("[", j):
                    self.pos, self.state = j + 1, "list"
                else:
                    self._to_content(0)
            elif self.state in ("call", "list"):
                step = self.step_call() if self.state == "call" else self.step_list()
                if step == "more" and not final:
                    return
                if step == "failed" or step == "more":
                    self._break()
                elif self.state == "list":
                    self.state = "tail"
                else:
                    assert self.call is not None and self.call.end is not None
                    self.pos, self.state, self.call = self.call.end, "sep", None
            else:  # "sep", "next", "tail": only space, a ";" or the next call may follow
                j = skip_space(text, self.pos)
                if j == len(text):
                    return
                if self.state == "sep" and text[j] == SEPARATOR:
                    self.pos, self.state = j + 1, "next"
                elif self.state != "tail" and text[j] == "{":
                    self.begin_call(CallScan(j))
                    self.state = "call"
                else:
                    self._to_content(j)

    def _to_content(self, pos: int) -> None:
        self.pos, self.state, self.call = pos, "content", None

    def _break(self) -> None:
        """The call syntax broke off: before anything was emitted the whole output is
        content (as ``parse`` sees it); after, the rest is."""
        self._to_content(0 if self.out.calls == 0 else self.break_pos())
