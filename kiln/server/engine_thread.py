"""The engine on its own thread, fed by a command queue, answering into asyncio queues.

``LLMEngine`` is not thread-safe, so exactly one thread (this one) calls it. The HTTP event
loop never waits on a step: it enqueues commands (add, abort, call) and awaits futures or
per-request ``asyncio.Queue``s that the engine thread fills via ``call_soon_threadsafe``.

The loop: drain commands; ``step()`` while there is work; otherwise sleep on a condition
variable until a command arrives (no busy spinning). An exception from ``step()`` kills the
engine: every in-flight request receives an ``EngineDeadError`` and ``on_dead`` is called
(the server then stops and exits non-zero). So does a failure the engine reports from
another thread (``engine.on_failure``: a tensor-parallel rank that died or hung), even
while this thread idles or is blocked inside a step.

Admission counts engine requests, not HTTP requests: one HTTP request's ``prompts x n`` engine
requests are admitted together or not at all, and ``max_queue`` bounds only those that find no
free batch slot (a burst the batch can hold is never refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.runtime.outputs import RequestOutput
from kiln.server.metrics import ServerMetrics


class RequestEndedError(RuntimeError):
    """A request ended before it finished, for a reason its client is told: the OpenAI error
    ``status``, ``type`` and ``code`` of its JSON answer or of its stream's last chunk."""

    status = 500
    type = "server_error"
    code: str | None = None
    retry_after_s: int | None = None

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": None,
                          "code": self.code}}

    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


class EngineDeadError(RequestEndedError):
    """The engine thread stopped after an exception (a CUDA fault, a lost tensor-parallel
    rank); nothing more will be served: 503, for the requests in flight as for new ones."""

    status = 503
    code = "engine_dead"


class RequestFailedError(RequestEndedError):
    """The engine failed this one request (its grammar, its sampling, a NaN row) and goes on
    serving the others; the message is the engine's."""

    code = "request_failed"


class ShuttingDownError(RequestEndedError):
    """The server is shutting down: the request came too late, or was still running when the
    drain ran out (``--shutdown-timeout``)."""

    status = 503
    code = "shutting_down"
    retry_after_s = 1  # another replica (or this one, restarted) can take it at once


class QueueFullError(RuntimeError):
    """More requests would wait for a batch slot than ``max_queue`` allows now (429: a later
    try can succeed)."""


class OverCapacityError(ValueError):
    """One request needs more engine requests than the server ever holds at once (batch
    slots + ``max_queue``): no retry can succeed, so it is the client's error (400)."""


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

    ``max_queue``: most engine requests waiting beyond the batch's ``max_num_seqs`` slots;
    ``add_many`` raises ``QueueFullError`` rather than go past it.
    """

    def __init__(self, engine: Any, *, max_queue: int, metrics: ServerMetrics | None = None,
                 on_dead: Callable[[BaseException], None] | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} must be >= 1")
        self.engine = engine
        self.max_queue = max_queue
        self.max_num_seqs: int = engine.scheduler.max_num_seqs
        self.metrics = metrics
        self.on_dead = on_dead
        self.dead: BaseException | None = None
        self._cv = threading.Condition()
        self._commands: deque[tuple[str, Any]] = deque()
        # Every request added and not yet finished or aborted; touched only on the event loop
        # thread, so its size is the exact number in the engine (running, waiting, or still a
        # command), with no lag behind the engine thread's snapshots.
        self._streams: dict[str, _Stream] = {}
        self._ended: str | None = None  # set by end_all: later adds raise ShuttingDownError
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Snapshots the engine thread writes after every step (plain reads elsewhere).
        self.num_waiting = 0
        self.num_running = 0
        self.num_free_blocks = engine.blocks.num_free_blocks
        self.num_blocks = engine.blocks.num_blocks
        watch = getattr(engine, "on_failure", None)
        if watch is not None:
            watch(self._die)

    # -- lifecycle (event loop side) ---------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._cv:
            self._loop = loop
            dead = self.dead
        if dead is not None:  # it failed between loading and serving
            loop.call_soon(self._fail_all, dead)
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
        """Engine requests that cannot get a batch slot now: beyond ``max_num_seqs``."""
        return max(0, len(self._streams) - self.max_num_seqs)

    def admit(self, k: int) -> None:
        """Raise ``QueueFullError`` unless ``k`` more engine requests leave at most
        ``max_queue`` waiting for a batch slot; ``OverCapacityError`` when ``k`` alone is
        more than the server ever holds."""
        live = len(self._streams)
        waiting = live + k - self.max_num_seqs
        most = self.max_num_seqs + self.max_queue
        if k > most:
            raise OverCapacityError(
                f"this request needs {k} engine requests (prompts x n), more than this server "
                f"ever holds at once ({self.max_num_seqs} batch slots + --max-queue "
                f"{self.max_queue} = {most}); send fewer prompts or a smaller n")
        if waiting > self.max_queue:
            raise QueueFullError(
                f"this request needs {k} engine request{'s' if k != 1 else ''} (prompts x n); "
                f"with {live} already in the engine and {self.max_num_seqs} batch slots, "
                f"{waiting} would wait, more than --max-queue {self.max_queue}; retry later, "
                f"or send fewer prompts or a smaller n")

    # -- commands (event loop side) ------------------------------------------------------------
    def _submit(self, kind: str, payload: Any) -> None:
        self._submit_all([(kind, payload)])

    def _submit_all(self, commands: list[tuple[str, Any]]) -> None:
        with self._cv:  # the engine thread sets ``dead`` under this lock, then drains
            if self.dead is not None:
                raise EngineDeadError(f"the engine stopped: {self.dead!r}")
            self._commands.extend(commands)
            self._cv.notify()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; its result or exception."""
        fut = asyncio.get_running_loop().create_future()
        self._submit("call", (fn, fut))
        return await fut

    async def add(self, request_id: str, prompt: list[int], params: Any,
                  want_token_text: bool = False,
                  queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """``add_many`` of one request."""
        return await self.add_many([(request_id, prompt, params)], want_token_text, queue)

    async def add_many(self, requests: list[tuple[str, list[int], Any]],
                       want_token_text: bool = False,
                       queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue ``(request_id, prompt, params)`` requests, all or none; returns the queue
        their ``StreamItem``s (or an exception) arrive on (``queue`` when given: the n choices
        of one HTTP request share one).

        Raises ``QueueFullError`` or ``OverCapacityError`` (nothing added),
        ``ShuttingDownError``, ``EngineDeadError``, or the engine's ``ValueError`` for one of
        them (then the others are aborted).
        """
        if self._ended is not None:
            raise ShuttingDownError(self._ended)
        self.admit(len(requests))
        queue = queue if queue is not None else asyncio.Queue()
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in requests]
        # Registered before any await, so the next admit() already counts them.
        for rid, _, _ in requests:
            self._streams[rid] = _Stream(queue, want_token_text)
        try:
            self._submit_all([("add", (rid, prompt, params, fut))
                              for (rid, prompt, params), fut in zip(requests, futs)])
        except BaseException:
            for rid, _, _ in requests:
                self._streams.pop(rid, None)
            raise
        try:
            results = await asyncio.gather(*futs, return_exceptions=True)
        except BaseException:  # cancelled (the client left): the adds still run, so abort
            self._forget([rid for rid, _, _ in requests])
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._forget([rid for rid, _, _ in requests])
            raise errors[0]
        return queue

    def _forget(self, request_ids: list[str]) -> None:
        """Drop these requests' streams and abort them in the engine, where still possible."""
        live = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        if live and self.dead is None:
            with contextlib.suppress(EngineDeadError):
                self._submit_all([("abort", rid) for rid in live])

    def end_all(self, reason: str) -> None:
        """End every request in the engine: each queue gets one ``ShuttingDownError(reason)``
        and the engine aborts the requests (freeing their KV blocks); later adds raise it too.
        """
        self._ended = reason
        queues = {id(s.queue): s.queue for s in self._streams.values()}
        for queue in queues.values():
            queue.put_nowait(ShuttingDownError(reason))
        self._forget(list(self._streams))

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
                try:
                    self.engine.add_request(prompt, params, rid)
                except Exception as e:
                    self._resolve(fut, exc=e)
                else:
                    self._resolve(fut)
            elif kind == "abort":
                self.engine.abort(payload)
            elif kind == "call":
                fn, fut = payload
                try:
                    self._resolve(fut, fn(self.engine))
                except Exception as e:
                    self._resolve(fut, exc=e)

    def _snapshot(self) -> None:
        sched = self.engine.scheduler
        self.num_waiting = len(sched.waiting)
        self.num_running = len(sched.running)
        self.num_free_blocks = self.engine.blocks.num_free_blocks
        if self.metrics is not None:
            self.metrics.set_engine_state(self.num_waiting, self.num_running,
                                          self.num_blocks - self.num_free_blocks,
                                          self.num_blocks)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while (not self._commands and not self._stopping and self.dead is None
                           and not self.engine.has_unfinished_requests()):
                        self._cv.wait()
                    if self._stopping or self.dead is not None:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                self._run_commands(commands)
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    if outputs:
                        self._loop.call_soon_threadsafe(self._deliver, self._items(outputs))
                self._snapshot()
        except BaseException as e:
            if self.dead is None:
                traceback.print_exc()
            self._die(e)

    def _die(self, e: BaseException) -> None:
        """The engine failed (``e``), on this thread or another: fail what waits on it and
        call ``on_dead``, once; later calls do nothing."""
        with self._cv:
            if self.dead is not None:
                return
            self.dead = e
            stranded = list(self._commands)
            self._commands.clear()
            self._cv.notify()  # an idle engine thread leaves its loop
            loop = self._loop
        if loop is None:  # not started: start() reports it
            return
        err = EngineDeadError(f"the engine stopped: {type(e).__name__}: {e}")
        with contextlib.suppress(RuntimeError):  # the event loop closed: nothing waits
            for kind, payload in stranded:
                if kind in ("add", "call"):
                    self._resolve(payload[-1], exc=err)
            loop.call_soon_threadsafe(self._fail_all, e)

    def _items(self, outputs: list[RequestOutput]) -> list[StreamItem]:
        """Wrap outputs; decode logprob token ids here, where the tokenizer may be used (the
        prompt's tokens and their alternatives with a request's first tokens, when its
        prompt was scored)."""
        items = []
        decode = self.engine.tokenizer.decode
        for out in outputs:
            item = StreamItem(out)
            if out.logprobs and out.new_token_ids:
                for lp in out.logprobs[-len(out.new_token_ids):]:
                    for t in (lp.token_id, *lp.top):
                        if t not in item.token_text:
                            item.token_text[t] = decode([t])
            if out.prompt_logprobs is not None and len(out.new_token_ids) == len(out.token_ids):
                ids = {t: None for t in out.prompt_token_ids}
                for lp in out.prompt_logprobs[1:]:
                    ids.update(dict.fromkeys(lp.top))
                ids = [t for t in ids if t not in item.token_text]
                item.token_text.update(zip(ids, self.engine.tokenizer.batch_decode(
                    [[t] for t in ids])))
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
