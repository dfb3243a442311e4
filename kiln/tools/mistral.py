"""Mistral tool calls after the ``[TOOL_CALLS]`` marker.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]   (older templates)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                          (tokenizer v11+)

The v11 form repeats the marker for each call. Text before a marker is content. The
markers are special tokens in Mistral's tokenizers: the output must be decoded with them
kept, or the calls read as plain text.
"""

from __future__ import annotations

import re
import secrets
import string
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
    ArgsScan,
    decode_value,
    held_suffix,
    scan_call_list,
    skip_json_ws,
    skip_space,
)
from kiln.tools.streaming import CallStreamer

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralParser(ToolParser):
    """``[TOOL_CALLS]`` followed by a JSON list of calls or by ``name[ARGS]{...}``."""

    name = "mistral"
    keeps_special_tokens = True

    @classmethod
    def new_call_id(cls) -> str:
        """Nine letters and digits: Mistral's templates refuse any other id when the call
        comes back in the conversation."""
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def parse(self, text: str) -> ParsedMessage:
        """Content (the text outside well-formed call groups, stripped) and the calls."""
        return split_marked(text, MARKER, lambda text, i: _group(text, i + len(MARKER)))

    def streamer(self) -> ToolStreamer:
        """A fresh incremental parser for one output."""
        return MistralStreamer()

    def structural_tag(self, mode: ToolMode, parallel: bool,
                       name: str | None = None) -> dict[str, Any]:
        """``[TOOL_CALLS][`` + calls ``{"name": "NAME", "arguments": ARGS}`` separated by
        ", " + ``]``: the whole output ("required"), one call of ``name`` ("named"), or
        after free text ("auto").

        The marker is a plain string here. In real Mistral tokenizers it is a special
        token, which a string in the grammar never matches; constraining those models
        needs the marker as a token format instead."""
        functions = st.chosen(self.functions, mode, name)
        if mode == "named":
            f = functions[0]
            return st.structural_tag(st.call_tag(
                f'{MARKER}[{{"name": {st.quoted(f["name"])}, "arguments": ', f, "}]"))
        tags = [st.call_tag(f'{{"name": {st.quoted(f["name"])}, "arguments": ', f, "}")
                for f in functions]
        group = {"type": "tag", "begin": f"{MARKER}[", "content": st.calls(tags, ", ", parallel),
                 "end": "]"}
        if mode == "required":
            return st.structural_tag(group)
        return st.structural_tag({"type": "triggered_tags", "triggers": [MARKER],
                                  "tags": [group], "at_least_one": False,
                                  "stop_after_first": True})


def _group(text: str, pos: int) -> tuple[list[ToolCall], int] | None:
    """The calls of the group whose marker ends at ``pos`` and the index after them."""
    pos = skip_space(text, pos)
    if text.startswith("[", pos):
        return scan_call_list(text, pos)
    m = _NAME.match(text, pos)
    if m is None or not text.startswith(ARGS, m.end()):
        return None
    start = skip_json_ws(text, m.end() + len(ARGS))
    got = decode_value(text, start) if text.startswith("{", start) else None
    if got is None or not isinstance(got[0], dict):
        return None
    return [ToolCall(m.group(), text[start:got[1]])], got[1]


class MistralStreamer(CallStreamer):
    """States: "content", "group" (after the marker), "list", "name" (v11), "args" (after
    ``[ARGS]``), "call" (the v11 arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "content"
        self.group = 0  # where the group in progress starts (its marker)
        self.name = ""
        self.group_calls = 0  # calls emitted before the group in progress

    def _run(self, final: bool) -> None:
        text = self.text
        while True:
            if self.state == "content":
                i = text.find(MARKER, self.pos)
                if i < 0:
                    stop = len(text) - (0 if final else held_suffix(text, self.pos, MARKER))
                    self.out.content(text[self.pos:stop])
                    self.pos = stop
                    return
                self.out.content(text[self.pos:i])
                self.group, self.pos, self.state = i, i + len(MARKER), "group"
                self.group_calls = self.out.calls
            elif self.state in ("list", "call"):
                step = self.step_list() if self.state == "list" else self.step_call()
                if step == "more" and not final:
                    return
                if step != "done":
                    self._break()
                    continue
                if self.state == "call":
                    assert self.call is not None and self.call.end is not None
                    self.pos = self.call.end
                self.state, self.call = "content", None
            elif self.state == "name":
                m = _NAME.match(text, self.pos)
                rest = text[m.end() if m else self.pos:]
                if ARGS.startswith(rest) and not final:
                    return  # the name or "[ARGS]" may still be arriving
                if m is None or not rest.startswith(ARGS):
                    self._break()
                else:
                    self.name, self.pos, self.state = m.group(), m.end() + len(ARGS), "args"
            else:  # "group" or "args": waiting for the first character that tells
                j = (skip_json_ws if self.state == "args" else skip_space)(text, self.pos)
                if j == len(text) and not final:
                    return
                if j == len(text):
                    self._break()
                elif self.state == "args":
                    if text[j] != "{":
                        self._break()
                        continue
                    self.begin_call(ArgsScan(text, self.name, j))
                    self.state = "call"
                elif text[j] == "[":
                    self.pos, self.list_state, self.state = j + 1, "first", "list"
                else:
                    self.pos, self.state = j, "name"

    def _break(self) -> None:
        """The group broke off: before anything of it was emitted its marker is content and
        the text after it is looked at again (as ``parse`` does); after, the rest is."""
        if self.out.calls == self.group_calls:
            self.out.content(MARKER)
            self.pos = self.group + len(MARKER)
        else:
            self.pos = self.break_pos()
        self.state, self.call = "content", None
