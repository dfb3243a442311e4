"""EngineThread with a scripted fake engine: queue limit, failing adds, death, idle waiting."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")

from kiln.runtime.outputs import RequestMetrics, RequestOutput
from kiln.server.engine_thread import (
    EngineDeadError,
    EngineThread,
    QueueFullError,
    StreamItem,
)


class FakeEngine:
    """Requests finish after ``steps`` steps with one token each; ``fail`` makes step raise."""

    def __init__(self, steps: int = 3):
        self.steps = steps
        self.live: dict[str, int] = {}
        self.fail = False
        self.gate = threading.Event()
        self.gate.set()
        self.num_step_calls = 0
        self.tokenizer = SimpleNamespace(decode=lambda ids: "x" * len(ids))
        self.blocks = SimpleNamespace(num_free_blocks=8, num_blocks=8)
        self.scheduler = SimpleNamespace(waiting=[], running=[], max_num_seqs=1)

    def add_request(self, prompt, params, rid):
        if not prompt:
            raise ValueError("prompt is empty")
        self.live[rid] = 0

    def abort(self, rid):
        self.live.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        self.gate.wait(5)
        self.num_step_calls += 1
        if self.fail:
            raise RuntimeError("boom")
        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            done = self.live[rid] >= self.steps
            if done:
                del self.live[rid]
            outs.append(RequestOutput(rid, [1], [7], "x", [7], "x", done,
                                      "length" if done else None, RequestMetrics(0.0)))
        return outs


async def _drain(q: asyncio.Queue) -> list:
    items = []
    while True:
        item = await asyncio.wait_for(q.get(), 5)
        items.append(item)
        if isinstance(item, BaseException) or item.output.finished:
            return items


def test_runs_requests_and_idles_without_spinning():
    async def main():
        eng = FakeEngine()
        et = EngineThread(eng, max_queue=4)
        et.start(asyncio.get_running_loop())
        qs = [await et.add(f"r{i}", [1, 2], None) for i in range(3)]
        for q in qs:
            items = await _drain(q)
            assert all(isinstance(i, StreamItem) for i in items) and len(items) == 3
        with pytest.raises(ValueError, match="empty"):
            await et.add("bad", [], None)
        calls = eng.num_step_calls
        await asyncio.sleep(0.3)
        assert eng.num_step_calls == calls  # idle: no stepping, no spinning
        assert await et.call(lambda e: "on engine thread") == "on engine thread"
        et.stop()

    asyncio.run(main())


def test_queue_full_then_death():
    async def main():
        dead = []
        eng = FakeEngine(steps=1000)
        eng.gate.clear()  # the first step blocks: adds queue up behind it
        et = EngineThread(eng, max_queue=2, on_dead=dead.append)
        et.start(asyncio.get_running_loop())
        q = await et.add("a", [1], None)
        await asyncio.sleep(0.1)  # the engine thread is now inside step()
        with pytest.raises(QueueFullError):  # "a" holds the one batch slot: 3 more would wait
            await et.add_many([(r, [1], None) for r in "bcd"])
        eng.fail = True
        eng.gate.set()
        items = await _drain(q)
        assert isinstance(items[-1], EngineDeadError)
        assert dead and not et.alive
        with pytest.raises(EngineDeadError):
            await et.add("c", [1], None)

    asyncio.run(asyncio.wait_for(main(), 20))


class WatchedEngine(FakeEngine):
    """A FakeEngine that reports failures from another thread (``engine.on_failure``), as a
    tensor-parallel engine's supervisor does."""

    def __init__(self, steps: int = 3):
        super().__init__(steps)
        self.listeners = []

    def on_failure(self, callback):
        self.listeners.append(callback)

    def fail_from_outside(self, exc):
        for callback in self.listeners:
            threading.Thread(target=callback, args=(exc,)).start()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "blocked-in-step"])
def test_a_failure_reported_from_outside_kills_the_engine_at_once(busy):
    """Idle (sleeping on its condition) or blocked in a step that never returns, the engine
    thread is dead as soon as the engine reports a failure: streams get EngineDeadError,
    on_dead runs once, new requests are refused."""
    async def main():
        dead = []
        eng = WatchedEngine(steps=1000)
        et = EngineThread(eng, max_queue=2, on_dead=dead.append)
        et.start(asyncio.get_running_loop())
        q = None
        if busy:
            eng.gate.clear()  # the step never returns
            q = await et.add("a", [1], None)
            await asyncio.sleep(0.1)
        else:
            await asyncio.sleep(0.1)
        assert et.alive
        eng.fail_from_outside(RuntimeError("rank 1 sent no heartbeat"))
        for _ in range(100):
            if dead:
                break
            await asyncio.sleep(0.02)
        assert len(dead) == 1 and "heartbeat" in str(dead[0]) and not et.alive
        if q is not None:
            (err,) = await _drain(q)
            assert isinstance(err, EngineDeadError) and "rank 1 sent no heartbeat" in str(err)
        with pytest.raises(EngineDeadError, match="heartbeat"):
            await et.add("b", [1], None)
        if not busy:
            et._thread.join(2)
            assert not et._thread.is_alive()  # the idle thread left its loop
        eng.gate.set()
        et.stop()
        assert len(dead) == 1

    asyncio.run(asyncio.wait_for(main(), 20))
