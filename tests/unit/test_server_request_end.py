"""How one HTTP request's engine requests are admitted and how its answer ends: the queue limit
(all or nothing), a request the engine failed alone, and the shutdown path freeing KV blocks."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from starlette.requests import Request

from kiln.runtime.outputs import RequestMetrics, RequestOutput
from kiln.server.engine_thread import EngineThread, QueueFullError, ShuttingDownError
from kiln.server.openai_api import Generation, respond
from kiln.server.protocol import BadRequest


class GatedEngine:
    """Requests never finish; ``step`` blocks on ``gate`` so commands pile up meanwhile."""

    def __init__(self, max_num_seqs: int):
        self.added: list[str] = []
        self.live: set[str] = set()
        self.gate = threading.Event()
        self.tokenizer = SimpleNamespace(decode=lambda ids: "x" * len(ids))
        self.blocks = SimpleNamespace(num_free_blocks=8, num_blocks=8)
        self.scheduler = SimpleNamespace(waiting=[], running=[], max_num_seqs=max_num_seqs)

    def add_request(self, prompt, params, rid):
        self.added.append(rid)
        self.live.add(rid)

    def abort(self, rid):
        self.live.discard(rid)

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        self.gate.wait(5)
        return []


def test_queue_limit_counts_only_requests_beyond_the_free_batch_slots():
    async def main():
        eng = GatedEngine(max_num_seqs=16)
        et = EngineThread(eng, max_queue=4)
        et.start(asyncio.get_running_loop())
        await et.add("first", [1], None)
        await asyncio.sleep(0.1)  # the engine thread is now blocked inside step()
        # 15 more fill the batch, 4 more wait: all within --max-queue 4.
        tasks = [asyncio.ensure_future(et.add(f"r{i}", [1], None)) for i in range(19)]
        await asyncio.sleep(0.1)
        failed = [t.exception() for t in tasks if t.done() and t.exception()]
        assert not failed, failed
        with pytest.raises(QueueFullError, match="--max-queue 4"):
            await et.add("one-too-many", [1], None)
        eng.gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        assert len(eng.added) == 20
        et.stop()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_a_fan_out_request_is_admitted_all_or_nothing():
    async def main():
        eng = GatedEngine(max_num_seqs=16)
        eng.gate.set()
        et = EngineThread(eng, max_queue=4)
        et.start(asyncio.get_running_loop())
        gen = Generation(et, "tiny", chat=False, include_usage=False)
        # 3 prompts x n=8 = 24 > 16 slots + 4: never admissible, a 400 naming n
        with pytest.raises(BadRequest) as e:
            await gen.start([[1], [2], [3]], lambda i: None, 8, False, "prompt", None)
        assert e.value.status == 400 and e.value.param == "n"
        assert "24" in str(e.value) and "--max-queue 4" in str(e.value)
        await et.call(lambda e: None)  # every command sent so far has run
        assert eng.added == [] and not gen.choices
        gen = Generation(et, "tiny", chat=False, include_usage=False)
        await gen.start([[1], [2]], lambda i: None, 10, False, "prompt", None)  # 20 fits
        assert len(eng.added) == 20 and len(gen.choices) == 20
        # busy now: 2 more would leave 6 waiting, more than 4; none of them is added
        gen = Generation(et, "tiny", chat=False, include_usage=False)
        with pytest.raises(QueueFullError, match="--max-queue 4"):
            await gen.start([[1], [2]], lambda i: None, 1, False, "prompt", None)
        await et.call(lambda e: None)
        assert len(eng.added) == 20 and not gen.choices
        et.stop()

    asyncio.run(asyncio.wait_for(main(), 20))


def _out(rid: str, text: str, finish: str | None, error: str | None = None) -> RequestOutput:
    out = RequestOutput(rid, [1], [7] * len(text), text, [7] * len(text), text,
                        finish is not None, finish, RequestMetrics(0.0))
    out.error = error  # RequestOutput.error: the message of a request the engine failed
    return out


def _generation(aborted: list[str]) -> Generation:
    """A Generation of two choices over a stand-in engine thread that records aborts."""
    et = SimpleNamespace(metrics=None, abort=aborted.append)
    gen = Generation(et, "tiny", chat=False, include_usage=False)
    from kiln.server.openai_api import Choice

    for i in range(2):
        gen.choices[f"{gen.id}-{i}"] = Choice(i, 1)
    gen.prompt_tokens = 2
    return gen


def _feed(gen: Generation) -> None:
    from kiln.server.engine_thread import StreamItem

    gen.queue.put_nowait(StreamItem(_out(f"{gen.id}-0", "ab", None)))
    gen.queue.put_nowait(StreamItem(_out(f"{gen.id}-1", "c", "error",
                                         "sampling produced NaN logits")))


FAILED = {"error": {"message": "sampling produced NaN logits", "type": "server_error",
                    "param": None, "code": "request_failed"}}


def test_a_failed_choice_fails_a_non_streamed_request_with_500():
    async def main():
        aborted: list[str] = []
        gen = _generation(aborted)
        _feed(gen)
        forever = asyncio.get_running_loop().create_future()

        async def receive():
            await forever
        request = Request({"type": "http", "method": "POST", "path": "/v1/completions",
                           "headers": []}, receive)
        r = await asyncio.wait_for(respond(request, gen, stream=False), 5)
        assert r.status_code == 500
        assert json.loads(r.body) == FAILED
        assert aborted == [f"{gen.id}-0"]  # the other choice is aborted, not left running

    asyncio.run(main())


def test_a_failed_choice_ends_a_stream_with_an_error_chunk_and_done():
    async def main():
        gen = _generation([])
        _feed(gen)
        lines = []

        async def read():
            async for line in gen.sse():
                lines.append(line)
        await asyncio.wait_for(read(), 5)
        assert lines[-1] == "data: [DONE]\n\n"
        assert json.loads(lines[-2].removeprefix("data: ")) == FAILED
        assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == "ab"

    asyncio.run(main())


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from kiln.builder import build_engine
    from kiln.runtime.engine import LLMEngine, RuntimeConfig

    out = tmp_path_factory.mktemp("tiny") / "tiny"
    build_engine("random:tiny-llama", out, dtype="float32", max_seq_len=256, max_batch_size=4,
                 progress=False)
    return LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))


def test_end_all_ends_every_stream_and_frees_its_kv_blocks(tiny_engine):
    from kiln.runtime.sampling_params import SamplingParams

    async def main():
        et = EngineThread(tiny_engine, max_queue=8)
        et.start(asyncio.get_running_loop())
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        q = await et.add("long-0", [1, 2, 3], params)
        await et.add("long-1", [1, 2], params, queue=q)
        while not isinstance(item := await q.get(), BaseException) and \
                not item.output.new_token_ids:
            pass
        et.end_all("the server is shutting down")
        seen = []
        while not q.empty():
            seen.append(q.get_nowait())
        errors = [x for x in seen if isinstance(x, ShuttingDownError)]
        assert len(errors) == 1, seen  # one per queue, not one per request
        assert "shutting down" in str(errors[0])
        with pytest.raises(ShuttingDownError):
            await et.add("late", [1], params)
        free = await et.call(lambda e: (e.blocks.check_all_free(),
                                        e.has_unfinished_requests()))
        assert free == (None, False)
        et.stop()

    asyncio.run(asyncio.wait_for(main(), 30))
