"""The engine on its own thread, fed by a command queue, answering into asyncio queues.

``LLMEngine`` is not thread-safe, so exactly one thread (this one) calls it. The HTTP event
loop never waits on a step: it enqueues commands (add, abort, call) and awaits futures or
per-request ``asyncio.Queue``s that the engine thread fills via ``call_soon_threadsafe``.

The loop: drain commands; ``step()`` while there is work; otherwise sleep on a condition
variable until a command arrives (no busy spinning). An exception from ``step()`` kills the
engine: every in-flight request receives an ``EngineDeadError`` and ``on_dead`` is called
(the server then stops and exits non-zero).
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.runtime.outputs import RequestOutput
from kiln.server.metrics import ServerMetrics


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an exception; nothing more will be served."""


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_queue`` allows."""


@dataclass
class StreamItem:
    """One step's output for a request, with text for the token ids its logprobs mention."""

    output: RequestOutput
    token_text: dict[int, str] = field(default_factory=dict)


@dataclass
class _Stream:
    queue: asyncio.Queue
    want_token_text: bool
    last_token_time: float | None = None


class EngineThread:
    """Owns the engine and the thread that drives it.

    ``max_queue``: most requests waiting for a slot (queued commands plus the scheduler's
    waiting list) before ``add`` raises ``QueueFullError``.
    """

    def __init__(self, engine: Any, *, max_queue: int, metrics: ServerMetrics | None = None,
                 on_dead: Callable[[BaseException], None] | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} must be >= 1")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self.on_dead = on_dead
        self.dead: BaseException | None = None
        self._cv = threading.Condition()
        self._commands: deque[tuple[str, Any]] = deque()
        self._pending_adds = 0
        self._streams: dict[str, _Stream] = {}  # touched only on the event loop thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Snapshots the engine thread writes after every step (plain reads elsewhere).
        self.num_waiting = 0
        self.num_running = 0
        self.num_free_blocks = engine.blocks.num_free_blocks
        self.num_blocks = engine.blocks.num_blocks

    # -- lifecycle (event loop side) ---------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return self._pending_adds + self.num_waiting

    # -- commands (event loop side) ------------------------------------------------------------
    def _submit(self, kind: str, payload: Any) -> None:
        with self._cv:  # the engine thread sets ``dead`` under this lock, then drains
            if self.dead is not None:
                raise EngineDeadError(f"the engine stopped: {self.dead!r}")
            self._commands.append((kind, payload))
            self._cv.notify()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; its result or exception."""
        fut = asyncio.get_running_loop().create_future()
        self._submit("call", (fn, fut))
        return await fut

    async def add(self, request_id: str, prompt: list[int], params: Any,
                  want_token_text: bool = False,
                  queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue a request; returns the queue its ``StreamItem``s (or an exception) arrive on.

        Several requests may share one ``queue`` (the n choices of one HTTP request). Raises
        ``QueueFullError``, ``EngineDeadError``, or the engine's ``ValueError``.
        """
        if self.queue_depth >= self.max_queue:
            raise QueueFullError(f"{self.queue_depth} requests are already waiting "
                                 f"(--max-queue {self.max_queue}); retry later")
        queue = queue if queue is not None else asyncio.Queue()
        self._streams[request_id] = _Stream(queue, want_token_text)
        fut = asyncio.get_running_loop().create_future()
        self._pending_adds += 1
        try:
            self._submit("add", (request_id, prompt, params, fut))
        except BaseException:
            self._pending_adds -= 1
            self._streams.pop(request_id, None)
            raise
        try:
            await fut
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return queue

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op when it already finished); frees its KV blocks."""
        if self._streams.pop(request_id, None) is None:
            return
        if self.dead is None:
            self._submit("abort", request_id)

    # -- the engine thread ---------------------------------------------------------------------
    def _resolve(self, fut: asyncio.Future, result: Any = None,
                 exc: BaseException | None = None) -> None:
        def done() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._loop.call_soon_threadsafe(done)

    def _run_commands(self, commands: list[tuple[str, Any]]) -> None:
        for kind, payload in commands:
            if kind == "add":
                rid, prompt, params, fut = payload
                self._loop.call_soon_threadsafe(self._dec_pending)
                try:
                    self.engine.add_request(prompt, params, rid)
                except Exception as e:  # noqa: BLE001  (bad input fails this request alone)
                    self._resolve(fut, exc=e)
                else:
                    self._resolve(fut)
            elif kind == "abort":
                self.engine.abort(payload)
            elif kind == "call":
                fn, fut = payload
                try:
                    self._resolve(fut, fn(self.engine))
                except Exception as e:  # noqa: BLE001  (handed back to the caller)
                    self._resolve(fut, exc=e)

    def _dec_pending(self) -> None:
        self._pending_adds -= 1

    def _snapshot(self) -> None:
        sched = self.engine.scheduler
        self.num_waiting = len(sched.waiting)
        self.num_running = len(sched.running)
        self.num_free_blocks = self.engine.blocks.num_free_blocks
        if self.metrics is not None:
            self.metrics.set_engine_state(self.queue_depth, self.num_running,
                                          self.num_blocks - self.num_free_blocks,
                                          self.num_blocks)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while (not self._commands and not self._stopping
                           and not self.engine.has_unfinished_requests()):
                        self._cv.wait()
                    if self._stopping:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                self._run_commands(commands)
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    if outputs:
                        self._loop.call_soon_threadsafe(self._deliver, self._items(outputs))
                self._snapshot()
        except BaseException as e:  # noqa: BLE001  (any failure here kills the engine)
            traceback.print_exc()
            with self._cv:
                self.dead = e
                stranded = list(self._commands)
                self._commands.clear()
            err = EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}")
            for kind, payload in stranded:
                if kind in ("add", "call"):
                    self._resolve(payload[-1], exc=err)
            self._loop.call_soon_threadsafe(self._fail_all, e)

    def _items(self, outputs: list[RequestOutput]) -> list[StreamItem]:
        """Wrap outputs; decode logprob token ids here, where the tokenizer may be used."""
        items = []
        decode = self.engine.tokenizer.decode
        for out in outputs:
            item = StreamItem(out)
            if out.logprobs and out.new_token_ids:
                for lp in out.logprobs[-len(out.new_token_ids):]:
                    for t in (lp.token_id, *lp.top):
                        if t not in item.token_text:
                            item.token_text[t] = decode([t])
            items.append(item)
        return items

    # -- back on the event loop ------------------------------------------------------------------
    def _deliver(self, items: list[StreamItem]) -> None:
        now = time.perf_counter()
        for item in items:
            out = item.output
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            if self.metrics is not None and out.new_token_ids:
                m = out.metrics
                if stream is not None and stream.last_token_time is None:
                    self.metrics.observe_ttft(now - m.arrival_time)
                elif stream is not None:
                    self.metrics.observe_itl(now - stream.last_token_time)
            if stream is not None:
                stream.last_token_time = now
                stream.queue.put_nowait(item)

    def _fail_all(self, exc: BaseException) -> None:
        err = EngineDeadError(f"the engine stopped: {type(exc).__name__}: {exc}")
        for queue in {id(s.queue): s.queue for s in self._streams.values()}.values():
            queue.put_nowait(err)
        self._streams.clear()
        if self.on_dead is not None:
            self.on_dead(exc)
