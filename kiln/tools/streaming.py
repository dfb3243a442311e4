"""Streaming machinery shared by the tool parsers: event building and the call in progress."""

from __future__ import annotations

from abc import abstractmethod

from kiln.tools.base import ToolDelta, ToolStreamer
from kiln.tools.json_scan import ArgsScan, CallScan, skip_json_ws


class Emitter:
    """Builds ``ToolDelta`` events. Content is stripped as a whole, as ``parse`` strips it:
    leading whitespace is dropped and trailing whitespace is held until more content
    follows, so the content events concatenate to ``parse(text).content``."""

    def __init__(self) -> None:
        self.events: list[ToolDelta] = []
        self.calls = 0
        self._started = False
        self._pending = ""

    def content(self, text: str) -> None:
        """Add content text."""
        if not self._started:
            text = text.lstrip()
            if not text:
                return
            self._started = True
        body = text.rstrip()
        if not body:
            self._pending += text
            return
        piece = self._pending + body
        self._pending = text[len(body):]
        last = self.events[-1] if self.events else None
        if last is not None and last.index is None:  # merge adjacent content
            self.events[-1] = ToolDelta(content=last.content + piece)
        else:
            self.events.append(ToolDelta(content=piece))

    def start_call(self, name: str) -> None:
        """Open the next call (its first event carries the name)."""
        self.events.append(ToolDelta(index=self.calls, name=name))
        self.calls += 1

    def arguments(self, text: str) -> None:
        """Add a fragment of the open call's arguments."""
        if not text:
            return
        last = self.events[-1] if self.events else None
        if last is not None and last.index == self.calls - 1:  # merge within one feed
            self.events[-1] = ToolDelta(index=last.index, name=last.name,
                                        arguments=last.arguments + text)
        else:
            self.events.append(ToolDelta(index=self.calls - 1, arguments=text))

    def take(self) -> list[ToolDelta]:
        """The events built since the last take."""
        events, self.events = self.events, []
        return events


class CallStreamer(ToolStreamer):
    """A streamer over the whole output so far (``self.text``), with the call in progress.

    Subclasses implement ``_run(final)``: advance their state machine over ``self.text``
    from ``self.pos``, emitting through ``self.out``. A call is committed (its name event
    sent) once its name is complete and its arguments object has begun; from then on its
    arguments stream out as they arrive, never past the object's closing brace.
    """

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.out = Emitter()
        self.call: CallScan | ArgsScan | None = None
        self.committed = False
        self.sent = 0  # end of the arguments text already emitted
        self.list_state = "first"  # inside a JSON list of calls: first | item | sep

    def feed(self, text: str) -> list[ToolDelta]:
        """The events that ``text`` (the next piece of the output) completes."""
        self.text += text
        self._run(final=False)
        return self.out.take()

    def finish(self) -> list[ToolDelta]:
        """The events left when the output ends: held-back text becomes content."""
        self._run(final=True)
        return self.out.take()

    @abstractmethod
    def _run(self, final: bool) -> None:
        """Advance over ``self.text``; ``final``: no more text will come."""

    def begin_call(self, scan: CallScan | ArgsScan) -> None:
        """Start scanning a call."""
        self.call, self.committed = scan, False

    def step_call(self) -> str:
        """Advance the call in progress: "more" (needs text), "done" or "failed"."""
        call = self.call
        assert call is not None
        call.advance(self.text)
        if (not self.committed and not call.failed and call.name is not None
                and call.args_start is not None):
            self.out.start_call(call.name)
            self.committed, self.sent = True, call.args_start
        if self.committed:
            upto = call.args_upto()
            if upto > self.sent:
                self.out.arguments(self.text[self.sent:upto])
                self.sent = upto
        return "failed" if call.failed else "done" if call.done else "more"

    def break_pos(self) -> int:
        """Where content resumes when a call group breaks off after something in it was
        emitted: right after the arguments already sent (the rest of a broken committed
        call is content), at a broken uncommitted call, else at ``self.pos``."""
        if self.call is None:
            return self.pos
        return self.sent if self.committed else self.call.start

    def step_list(self) -> str:
        """Advance through a JSON list of call objects (``self.pos`` is past its "["):
        "more", "done" (``self.pos`` past the "]") or "failed" (``self.pos`` is where the
        list stopped making sense, or the call in progress failed)."""
        while True:
            if self.call is not None:
                state = self.step_call()
                if state != "done":
                    return state
                assert self.call.end is not None
                self.pos, self.call, self.list_state = self.call.end, None, "sep"
            j = skip_json_ws(self.text, self.pos)
            if j == len(self.text):
                return "more"
            c = self.text[j]
            if self.list_state in ("first", "item") and c == "{":
                self.begin_call(CallScan(j))
            elif self.list_state == "sep" and c in ",]":
                self.pos, self.list_state = j + 1, "item"
                if c == "]":
                    return "done"
            else:
                self.pos = j
                return "failed"
