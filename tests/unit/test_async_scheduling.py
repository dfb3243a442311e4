"""Async scheduling: the next decode step is launched before this step's tokens are read.

The oracle is the same engine with async scheduling off: token-for-token equal outputs,
every KV block freed, through stop tokens (one discarded extra row), length limits,
admission of waiting requests, preemption, aborts in flight and sampled rows.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest
from helpers import count_launches, mixed_prompts

from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams


def _engine(engine_dir, async_on: bool, **kw) -> LLMEngine:
    opts = {"device": "cpu", "block_size": 4, "num_kv_blocks": 200, "max_num_tokens": 48,
            "attention_backend": "torch", **kw}
    return LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(async_scheduling=async_on,
                                                               **opts))


def _run(engine_dir, async_on, prompts, params, **kw):
    eng = _engine(engine_dir, async_on, **kw)
    ahead = count_launches(eng)
    outs = eng.generate(prompts, params)
    eng.blocks.check_all_free()
    eng.last_outputs = outs
    return [(o.token_ids, o.finish_reason) for o in outs], ahead[0], eng


@pytest.fixture(scope="module")
def engine_dir(tiny_reference):
    return tiny_reference("llama", max_seq_len=96, max_num_tokens=64, max_batch_size=8)[1]


def test_greedy_equals_sync_with_stops_lengths_and_admission(engine_dir):
    prompts = mixed_prompts()
    ref_eng = _engine(engine_dir, False)
    free_run = ref_eng.generate(prompts[:1], SamplingParams(max_tokens=12, temperature=0,
                                                            ignore_eos=True))[0].token_ids
    stop_tok = free_run[5]  # a token the first request really produces: it stops there
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    params[0] = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                               stop_token_ids=[stop_tok])
    # 3 sequences at a time: requests wait and are admitted as others finish
    ref, _, _ = _run(engine_dir, False, prompts, params, max_num_seqs=3)
    got, ahead, eng = _run(engine_dir, True, prompts, params, max_num_seqs=3)
    assert got == ref
    assert ref[0] == (free_run[:6], "stop")
    assert ahead > 10  # most decode steps were launched ahead
    assert eng.num_steps > 0


def test_preemption_and_prefix_cache_equal_sync(engine_dir):
    prompts = mixed_prompts()
    prompts[3] = prompts[1][:16] + prompts[3]  # a shared prefix of 4 full blocks
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    # 40 blocks of 4 tokens: 8 requests of up to 60 tokens cannot all stay resident
    ref, _, _ = _run(engine_dir, False, prompts, params, num_kv_blocks=40, reserve_kv=False)
    got, ahead, eng = _run(engine_dir, True, prompts, params, num_kv_blocks=40,
                           reserve_kv=False)
    assert got == ref
    assert ahead > 0
    outs = eng.last_outputs
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert outs[3].metrics.num_cached_prompt_tokens > 0


def test_abort_while_a_step_is_in_flight(engine_dir):
    prompts = mixed_prompts()[:3]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in _engine(engine_dir, False).generate(prompts, params)]
    eng = _engine(engine_dir, True)
    ids = [eng.add_request(p, params) for p in prompts]
    eng.step()
    eng.step()
    assert eng._inflight is not None  # the third step was launched ahead
    eng.abort(ids[1])
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id != ids[1], "an aborted request got output"
            if o.finished:
                done[o.request_id] = o.token_ids
    assert done == {ids[0]: ref[0], ids[2]: ref[2]}
    eng.blocks.check_all_free()
    # a later request runs normally after the stale in-flight step
    again = eng.generate([prompts[1]], params)[0]
    assert again.token_ids == ref[1]
    eng.blocks.check_all_free()


def test_sampled_rows_run_ahead_and_seeded_rows_stay_synchronous(engine_dir):
    prompts = mixed_prompts()[:4]
    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, ignore_eos=True)
    outs, ahead, _ = _run(engine_dir, True, prompts, sampled)
    assert [len(t) for t, _ in outs] == [8] * 4 and ahead > 0
    seeded = [SamplingParams(max_tokens=8, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(4)]
    ref, _, _ = _run(engine_dir, False, prompts, seeded)
    got, ahead, _ = _run(engine_dir, True, prompts, seeded)
    assert got == ref and ahead == 0


def test_staged_triton_path_equals_sync(tiny_reference):
    """The staged (graph-buffer) path patches the input ids on the device."""
    pytest.importorskip("triton")
    prompts = mixed_prompts()[:3]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine_dir = tiny_reference("llama", max_seq_len=96, max_num_tokens=64, max_batch_size=8)[1]
    ref, _, _ = _run(engine_dir, False, prompts, params)
    got, ahead, eng = _run(engine_dir, True, prompts, params, attention_backend="triton",
                           cuda_graphs=True)
    assert got == ref and ahead > 0
    assert eng.runner.graphs is not None and eng.runner.graphs.num_replays > 0


def test_a_failure_in_the_step_launched_ahead_leaves_no_state(engine_dir):
    """An error while launching ahead (an OOM, say) belongs to no one request: it fails the
    requests of that step with its message (step() does not raise), the tokens committed
    before it are right, no stand-in token stays behind, every block is freed, and the engine
    goes on to give the synchronous engine's tokens."""
    prompts = mixed_prompts()[:3]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in _engine(engine_dir, False).generate(prompts, params)]
    eng = _engine(engine_dir, True)
    real_exec = eng.runner.execute
    calls = {"ahead": 0}

    def failing(batch, input_patch=None):
        if input_patch is not None:
            calls["ahead"] += 1
            if calls["ahead"] == 3:
                raise RuntimeError("injected failure in a step launched ahead")
        return real_exec(batch, input_patch)

    eng.runner.execute = failing
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():  # the failure fails the step's requests; step() does not raise
            if o.finished:
                done[o.request_id] = o
        assert eng._inflight is None or not any(r.is_finished for r in eng._inflight.reqs)
        for r in eng._requests.values():
            assert r.all_token_ids == r.prompt_token_ids + r.output_token_ids
    assert calls["ahead"] >= 3
    for i, want in zip(ids, ref):
        o = done[i]
        assert o.finish_reason == "error" and "injected failure" in o.error
        assert o.token_ids == want[: len(o.token_ids)]  # what was committed before is right
    assert all(r.all_token_ids == r.prompt_token_ids + r.output_token_ids
               for r in eng.scheduler.running)
    eng.blocks.check_all_free()
    eng.runner.execute = real_exec
    assert [o.token_ids for o in eng.generate(prompts, params)] == ref  # the engine goes on
    eng.blocks.check_all_free()


@pytest.mark.parametrize("staged", [False, True])
def test_prompt_chunks_and_admissions_run_ahead_and_equal_sync(engine_dir, staged):
    """Steps with prompt chunks and admissions beside decodes are launched ahead too (a
    16-token budget chunks every prompt; 3 sequences at a time admit the rest as others
    finish); greedy output equals the synchronous engine's, every block freed, on the
    reference path and on the staged (graph-buffer) path."""
    if staged:
        pytest.importorskip("triton")
    prompts = mixed_prompts()
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    opts = {"max_num_seqs": 3, "max_num_tokens": 16}
    ref, _, _ = _run(engine_dir, False, prompts, params, **opts)
    if staged:
        opts.update(attention_backend="triton", cuda_graphs=True)
    eng = _engine(engine_dir, True, **opts)
    mixed = []
    inner = eng.scheduler.schedule_ahead

    def recording(*a, **k):
        batch = inner(*a, **k)
        if batch is not None and any(n > 1 for _, n in batch.items):
            mixed.append(batch)
        return batch

    eng.scheduler.schedule_ahead = recording
    outs = eng.generate(prompts, params)
    eng.blocks.check_all_free()
    assert [(o.token_ids, o.finish_reason) for o in outs] == ref
    assert len(mixed) >= 3  # prompt chunks launched ahead beside decodes
    assert any(b.in_flight and b.items[0][1] == 1 for b in mixed)
