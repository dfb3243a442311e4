"""Liveness of a tensor-parallel engine's ranks, on a channel the model does not use.

A rank blocked in a collective answers nothing on the process groups until the collective
ends, and a stopped or wedged process never does; so liveness goes over the rendezvous
store (a TCPStore: rank 0 hosts it; gloo used it only to meet). Every rank runs a thread
that adds 1 to its key ``kiln/beat/{rank}`` every ``HEARTBEAT_INTERVAL_S`` on a store
connection of its own. A beat says the process is scheduled and its interpreter runs; a
rank waiting in a collective for a late peer, or a follower waiting for rank 0's next
command while the engine idles, beats on.

Rank 0, ``Supervisor``: a thread that every ``POLL_S`` notices a follower process that
exited (at once) and a rank whose count has not moved for the heartbeat timeout
(``KILN_TP_HEARTBEAT_TIMEOUT_S``, default 10 s, well inside the 30 s collective timeout).
A rank is held to it from its first beat; before that it is still starting (python and
torch imports) and the start-up checks bound it. A follower beats once before it reports
itself up, so every rank is held to it once the group has formed. On a failure it calls
``on_failure`` once with the reason (``Ranks`` ends every rank and tells the engine's
listeners).

Followers, ``Heartbeat``: the same thread ends its process when rank 0 is gone (the store
unreachable, or the parent process changed), when rank 0's own beat stops for the
timeout, or when rank 0 sets ``ABORT_KEY`` (ranks on other hosts, which rank 0 cannot
signal). So no follower outlives rank 0 by more than the timeout.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

HEARTBEAT_INTERVAL_S = 0.5
POLL_S = 0.1
ABORT_KEY = "kiln/abort"
TIMEOUT_KEY = "kiln/heartbeat_timeout_s"


def beat_key(rank: int) -> str:
    return f"kiln/beat/{rank}"


def connect(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client connection of this thread's own to the rendezvous store; an operation that
    gets no answer within ``timeout_s`` raises."""
    return dist.TCPStore(host, port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class Supervisor:
    """Rank 0's watch over the ranks of a ``world``-rank engine whose store is at
    ``host:port``. ``exited(store)``: why each follower process that exited did (empty when
    none did, or when rank 0 does not own them); ``on_failure(why)`` is called once, from
    this thread, when a rank exited or stopped beating for ``timeout_s``."""

    def __init__(self, host: str, port: int, world: int, timeout_s: float,
                 exited: Callable[[dist.Store], list[str]],
                 on_failure: Callable[[str], None]):
        self.world, self.timeout_s = world, timeout_s
        self._exited, self._on_failure = exited, on_failure
        self.failed: str | None = None
        self._lock = threading.Lock()
        self._store = connect(host, port, timeout_s)
        self._store.set(TIMEOUT_KEY, repr(timeout_s))  # the followers' bound on rank 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-tp-supervisor",
                                        daemon=True)
        self._thread.start()

    def hand_over(self, on_failure: Callable[[str], None]) -> None:
        """Call ``on_failure`` from now on (start-up is over); at once if a rank failed."""
        with self._lock:
            self._on_failure, failed = on_failure, self.failed
        if failed is not None:
            on_failure(failed)

    def stop(self, wait: bool = True) -> None:
        """Stop watching (before the followers are told to exit); ``wait``: until the thread
        ended (never from the thread itself). Idempotent."""
        self._stopped.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def abort(self, why: str) -> None:
        """Tell every follower's heartbeat thread to end its process (those on other hosts
        included); a store that is gone already ended them."""
        try:
            self._store.set(ABORT_KEY, why)
        except RuntimeError:
            pass

    def _run(self) -> None:
        seen: dict[int, tuple[int, float]] = {}  # rank -> (beats, when they last moved)
        last_beat = 0.0
        while not self._stopped.wait(POLL_S):
            now = time.monotonic()
            try:
                if now - last_beat >= HEARTBEAT_INTERVAL_S:
                    self._store.add(beat_key(0), 1)
                    last_beat = now
                why = self._check(seen, now)
            except RuntimeError as e:  # the store answers nothing: this host or rank 0's port
                why = f"the rendezvous store did not answer ({e})"
            if why and not self._stopped.is_set():
                with self._lock:
                    self.failed, on_failure = why, self._on_failure
                on_failure(why)
                return

    def _check(self, seen: dict[int, tuple[int, float]], now: float) -> str | None:
        reasons = self._exited(self._store)
        if reasons:
            return "; ".join(reasons)
        for rank in range(1, self.world):
            beats = self._store.add(beat_key(rank), 0)
            if beats == 0:  # not started beating yet: start-up bounds it
                continue
            if rank not in seen or seen[rank][0] != beats:
                seen[rank] = (beats, now)
            elif now - seen[rank][1] > self.timeout_s:
                return (f"rank {rank} sent no heartbeat for {now - seen[rank][1]:.1f} s (hung "
                        f"or stopped; KILN_TP_HEARTBEAT_TIMEOUT_S={self.timeout_s:g})")
        return None


class Heartbeat:
    """A follower's beat (rank ``rank``, store at ``host:port``), and its exit when rank 0
    is gone or ends the engine (see the module docstring). ``leader_pid``: rank 0's pid
    when it is this process's parent (a follower it started)."""

    def __init__(self, host: str, port: int, rank: int, leader_pid: int | None = None):
        self.rank, self._where, self.leader_pid = rank, (host, port), leader_pid
        self._stopped = threading.Event()
        self.started = threading.Event()  # the first beat is in the store
        threading.Thread(target=self._run, name="kiln-tp-heartbeat", daemon=True).start()

    def stop(self) -> None:
        """The engine closed normally: beat no more, and never end the process."""
        self._stopped.set()

    def _leave(self, why: str) -> None:
        if self._stopped.is_set():
            return
        print(f"kiln tensor-parallel rank {self.rank}: {why}; exiting", file=sys.stderr,
              flush=True)
        os._exit(1)  # no gloo teardown: the peers are gone or going

    def _run(self) -> None:
        from kiln.runtime.parallel.group import START_TIMEOUT_S

        try:
            store = connect(*self._where, START_TIMEOUT_S)
            store.wait([TIMEOUT_KEY])
            timeout_s = float(store.get(TIMEOUT_KEY).decode())
            store = connect(*self._where, timeout_s)
        except RuntimeError as e:
            self._leave(f"rank 0's rendezvous store is unreachable ({e})")
            return
        leader: tuple[int, float] = (-1, time.monotonic())  # rank 0's beats, when they moved
        while True:
            if self.leader_pid is not None and os.getppid() != self.leader_pid:
                self._leave(f"rank 0 (pid {self.leader_pid}) exited")
            try:
                store.add(beat_key(self.rank), 1)
                if store.check([ABORT_KEY]):
                    self._leave(f"rank 0 ended the engine: {store.get(ABORT_KEY).decode()}")
                beats = store.add(beat_key(0), 0)
            except RuntimeError as e:
                self._leave(f"rank 0's rendezvous store is gone ({e})")
                return
            self.started.set()
            now = time.monotonic()
            if beats != leader[0]:
                leader = (beats, now)
            elif now - leader[1] > timeout_s:
                self._leave(f"rank 0 sent no heartbeat for {now - leader[1]:.1f} s "
                            f"(KILN_TP_HEARTBEAT_TIMEOUT_S={timeout_s:g})")
            if self._stopped.wait(HEARTBEAT_INTERVAL_S):
                return
