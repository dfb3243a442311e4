"""How `kiln serve` stops and how long it waits on a slow client.

Shutdown (SIGTERM from a container runtime, or Ctrl-C): the listener stays open but admits
nothing new (503 with Retry-After and an OpenAI error body; /health answers 503 "shutting
down" so a load balancer stops routing here; /metrics still answers), requests in flight get
``shutdown_s`` to finish, then the rest are ended (a stream gets an error chunk and
``data: [DONE]``, a plain request a 503 JSON body) and their KV blocks freed, and the process
exits 0. A second signal ends the rest at once.

Slow clients: a request head (request line and headers) must arrive within ``header_s`` and its
body within ``body_s`` of the head, or the client gets 408 and the connection is closed. Both
are totals: nginx's ``client_body_timeout`` (60 s) bounds only the gap between two reads, so a
body trickled a byte a second is held there for ever (its ``client_header_timeout``, 60 s, is a
total already). The head limit lives in the HTTP protocol (ASGI middleware only runs once the
head is parsed), the body limit in the ASGI receive path, where a 408 with an OpenAI error body
can still be sent.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import uvicorn

# h11 as uvicorn's protocol drives it (``self.conn`` is one of its Connections); h11 comes with
# uvicorn and is not a dependency of kiln's own.
from uvicorn.protocols.http.h11_impl import H11Protocol, h11

from kiln.server.engine_thread import EngineThread, ShuttingDownError

# After the drain ends the rest, how long their answers (error chunk, [DONE]) get to go out
# before uvicorn's own shutdown closes what is left (a client that stopped reading).
END_GRACE_S = 2.0


@dataclass(frozen=True)
class Timeouts:
    """Seconds `kiln serve` waits. Totals, not gaps between reads (see the module docstring).

    ``header_s`` 10: a real client sends its head (a few hundred bytes) in one packet, well
    under a second even on a lossy mobile link; 10 s cuts a head trickled over 20 s.
    ``body_s`` 20: the largest body allowed (``--max-body-bytes``, 1 MiB) needs 50 KB/s to make
    it; 20 s cuts a body trickled over 30 s and one that never completes.
    ``shutdown_s`` 30: the drain on SIGTERM; Kubernetes' default grace period is also 30 s, so
    set ``terminationGracePeriodSeconds`` a few seconds above this.
    """

    header_s: float = 10.0
    body_s: float = 20.0
    shutdown_s: float = 30.0

    def __post_init__(self) -> None:
        for flag, value in (("--header-timeout", self.header_s),
                            ("--body-timeout", self.body_s)):
            if not value > 0:
                raise ValueError(f"{flag} {value} must be > 0 seconds")
        if not self.shutdown_s >= 0:
            raise ValueError(f"--shutdown-timeout {self.shutdown_s} must be >= 0 seconds "
                             "(0 ends every running request at once)")


def _error(message: str, type_: str, code: str) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


async def _send_json(send: Any, status: int, body: dict,
                     headers: dict[str, str] | None = None) -> None:
    """A complete JSON response that also closes the connection."""
    raw = json.dumps(body).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
            (b"connection", b"close")]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": raw})


class Lifecycle:
    """Whether the server still admits requests, how many are in flight, and the drain.

    ``begin_drain`` runs in a signal handler, so it only writes attributes; ``drained`` runs
    on the event loop every 0.1 s (uvicorn's tick) and does the rest.
    """

    def __init__(self, et: EngineThread, timeouts: Timeouts):
        self.et = et
        self.timeouts = timeouts
        self.in_flight = 0  # admitted HTTP requests not yet answered
        self.reason: str | None = None  # "SIGTERM" ... once draining
        self._deadline: float | None = None
        self._ended_at: float | None = None
        self._announced = False
        self._forced = False  # a second signal came

    @property
    def draining(self) -> bool:
        return self._deadline is not None

    def begin_drain(self, reason: str) -> None:
        """Stop admitting; a second call ends the requests still running at once."""
        now = time.monotonic()
        if self._deadline is None:
            self.reason = reason
            self._deadline = now + self.timeouts.shutdown_s
        else:
            self._deadline = min(self._deadline, now)
            self._forced = True

    def drained(self) -> bool:
        """One tick of the drain: True once the server may stop."""
        if self._deadline is None:
            return False
        s = self.timeouts.shutdown_s
        if not self._announced:
            self._announced = True
            print(f"kiln serve: {self.reason}: admitting no new requests; {self.in_flight} in "
                  f"flight get up to {s:g} s (--shutdown-timeout)", file=sys.stderr, flush=True)
        if self.in_flight == 0:
            return True
        now = time.monotonic()
        if self._ended_at is None:
            if now < self._deadline:
                return False
            when = ("at a second signal" if self._forced
                    else f"after --shutdown-timeout {s:g} s")
            print(f"kiln serve: ending {self.in_flight} request(s) still running {when}",
                  file=sys.stderr, flush=True)
            self.et.end_all(f"the server is shutting down ({self.reason}) and this request was "
                            f"still running {when}; retry it")
            self._ended_at = now
            return False
        return now >= self._ended_at + END_GRACE_S

    def refusal(self, path: str) -> tuple[dict, dict[str, str]]:
        """The 503 body and headers of a request that came in while draining."""
        err = _error(f"the server is shutting down ({self.reason}) and admits no new "
                     "requests; retry it, here once restarted or on another replica",
                     "server_error", ShuttingDownError.code)
        if path == "/health":
            err = {"status": "shutting down", **err}
        return err, {"Retry-After": str(ShuttingDownError.retry_after_s)}


class LifecycleMiddleware:
    """ASGI middleware: refuses requests while draining, counts those in flight, and answers
    408 to a request whose body does not arrive within ``Timeouts.body_s`` of its head."""

    def __init__(self, app: Any, lifecycle: Lifecycle):
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lc = self.lifecycle
        if lc.draining and scope["path"] != "/metrics":
            body, headers = lc.refusal(scope["path"])
            await _send_json(send, 503, body, headers)
            return
        lc.in_flight += 1
        try:
            await self._with_body_timeout(scope, receive, send)
        finally:
            lc.in_flight -= 1

    async def _with_body_timeout(self, scope, receive, send) -> None:
        limit = self.lifecycle.timeouts.body_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        state = {"body_done": False, "timed_out": False, "started": False}

        async def timed_receive() -> dict:
            if state["body_done"] or state["timed_out"]:  # e.g. watching for a disconnect
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                state["timed_out"] = True
                if not state["started"]:
                    await _send_json(send, 408, _error(
                        f"the request body did not arrive within {limit:g} s of its headers "
                        "(--body-timeout); send it faster, or raise --body-timeout",
                        "invalid_request_error", "request_timeout"))
                return {"type": "http.disconnect"}  # the app stops reading; its answer is dropped
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                state["body_done"] = True
            return msg

        async def guarded_send(msg: dict) -> None:
            if state["timed_out"]:
                return
            if msg["type"] == "http.response.start":
                state["started"] = True
            await send(msg)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except Exception:
            if not state["timed_out"]:  # after a 408, the app's ClientDisconnect is expected
                raise


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete
    ``header_timeout_s`` after its first byte (after connecting, for the first request):
    with a 408 when some of it came, silently when nothing did. Between requests on a
    keep-alive connection, uvicorn's keep-alive timeout applies instead."""

    header_timeout_s = Timeouts.header_s
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()
        super().data_received(data)
        if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
            self._head_timer.cancel()  # the head is complete (or broken: uvicorn sent 400)
            self._head_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why (h11 cannot, pre-request)
            raw = json.dumps(_error(
                f"the request headers did not arrive within {self.header_timeout_s:g} s "
                "(--header-timeout); send them at once", "invalid_request_error",
                "request_timeout")).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json"
                                 b"\r\nconnection: close\r\ncontent-length: "
                                 + str(len(raw)).encode() + b"\r\n\r\n" + raw)
        self.transport.close()


def http_protocol(header_timeout_s: float) -> type[HeadTimeoutProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with this head timeout."""
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,),
                {"header_timeout_s": header_timeout_s})


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, draining on SIGTERM/SIGINT (see the module docstring) and then
    returning normally. uvicorn's own handling closes the listener at once, cuts what still
    runs after ``timeout_graceful_shutdown`` and re-raises the signal (exit 143/130)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.lifecycle.begin_drain(signal.Signals(sig).name)

    async def on_tick(self, counter: int) -> bool:
        # should_exit (the engine died) still stops at once.
        return await super().on_tick(counter) or self.lifecycle.drained()
