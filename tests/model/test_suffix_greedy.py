"""Suffix decoding in the runtime (float32, CPU, tiny models).

Oracle: plain greedy decoding. Suffix greedy output must equal it token for token, alone
and in mixed batches (plain and sampled requests beside it, preemption, chunked prefill,
an abort in flight), and for requests whose continuation is in the shared cache, which
then commit more tokens per step. A failing verification fails its request alone, leaves
no state behind and keeps the failed request's text out of the cache.
"""

from __future__ import annotations

import pytest
from helpers import branches, drain_checking_spec_state, mixed_prompts, record_trees

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

PLAIN = (1, 1, 0)
SUFFIX = SpeculativeConfig.from_cli("suffix", max_draft_len=8,
                                    suffix={"suffix_tree_depth": 16, "suffix_min_match": 2,
                                            "suffix_cache_requests": 16})


def _greedy(n=32, window=None):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, lookahead=window)


def _per_step(outs):
    steps = sum(o.metrics.spec_steps for o in outs)
    return sum(o.metrics.spec_tokens for o in outs) / max(steps, 1), steps


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_suffix_greedy_equals_plain_greedy_and_the_cache_raises_acceptance(tiny_reference,
                                                                         arch):
    _, out = tiny_reference(arch, max_seq_len=256, max_num_tokens=512, max_batch_size=64,
                            speculative=SUFFIX)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    prompts = mixed_prompts()
    plain = [o.token_ids for o in eng.generate(prompts, _greedy(window=PLAIN))]
    assert len(eng.spec_worker.cache) == 0  # plain requests feed no cache
    first = eng.generate(prompts, _greedy())
    assert [o.token_ids for o in first] == plain
    assert len(eng.spec_worker.cache) == len(prompts)
    again = eng.generate(prompts, _greedy())  # every continuation is in the cache now
    assert [o.token_ids for o in again] == plain
    (tps1, _), (tps2, steps2) = _per_step(first), _per_step(again)
    assert steps2 > 0 and tps2 > max(tps1, 2.5), (tps1, tps2)
    # the committed drafts that came from the cache: most of them now, none with an empty one
    accepted = sum(o.metrics.spec_tokens - o.metrics.spec_steps for o in again)
    cached = sum(o.metrics.spec_cached_tokens for o in again)
    assert accepted / 2 < cached <= accepted + len(prompts), (cached, accepted)
    assert sum(o.metrics.spec_cached_tokens for o in eng.generate(
        [[7] + p for p in prompts], _greedy(n=1))) == 0
    eng.blocks.check_all_free()


def test_suffix_in_mixed_batches_with_preemption_chunked_prefill_and_an_abort(
        tiny_reference):
    """Suffix requests beside plain, sampled and max_draft_len-limited ones, with a KV cache
    small enough to preempt and a token budget that chunks the prompts; one request is
    aborted in flight. Greedy outputs equal plain greedy; a request's own max_draft_len
    bounds its drafts."""
    _, out = tiny_reference("llama", max_seq_len=256, max_num_tokens=512, max_batch_size=64,
                            speculative=SUFFIX)
    prompts = [p * 3 for p in mixed_prompts()]  # 9..120 tokens: repeats for the own tree
    plain = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu")).generate(
        prompts, _greedy(window=PLAIN))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
        device="cpu", block_size=4, num_kv_blocks=90, max_num_tokens=48, reserve_kv=False))
    eng.generate(prompts[:4], _greedy())  # some continuations cached
    params = [_greedy(window=PLAIN if i % 4 == 0 else None) for i in range(len(prompts))]
    params[1] = SamplingParams(max_tokens=32, temperature=0.8, top_k=20, seed=7,
                               ignore_eos=True)
    params[2] = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                               max_draft_len=2)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        steps += 1
        if steps == 6:
            eng.abort(ids[5])
    assert ids[5] not in done or done[ids[5]].finish_reason != "length"
    for i, (rid, want) in enumerate(zip(ids, plain)):
        if i not in (1, 5):
            assert done[rid].token_ids == want.token_ids, i
    assert len(done[ids[1]].token_ids) == 32
    assert done[ids[2]].metrics.spec_tokens <= 3 * done[ids[2]].metrics.spec_steps
    assert sum(o.metrics.num_preemptions for o in done.values()) > 0
    assert sum(o.metrics.spec_tokens for o in done.values()) > sum(
        o.metrics.spec_steps for o in done.values())
    eng.blocks.check_all_free()


def test_greedy_walks_down_a_later_sibling_and_moves_its_kv(tiny_reference, monkeypatch):
    """Trees with siblings, greedy: the cache holds each prompt's true continuation and,
    twice each, decoys that follow it up to a point and then end on another token, so
    the trees branch there with the decoy's token first (2 of 3 occurrences); the walk
    takes the later sibling, the one the model agrees with, whose rows' KV moves to the
    committed positions. Output equals plain greedy: the steps after attend over the
    moved KV."""
    _, out = tiny_reference("llama", max_seq_len=256, max_num_tokens=512, max_batch_size=64,
                            speculative=SUFFIX)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu", block_size=4))
    prompts = mixed_prompts()[:2]
    plain = [o.token_ids for o in eng.generate(prompts, _greedy(window=PLAIN))]
    vocab = eng.model_config.vocab_size
    for want in plain:
        eng.spec_worker.cache.add(want)
        for k in (7, 14, 22):
            for _ in range(2):
                eng.spec_worker.cache.add(want[:k] + [(want[k] + 1) % vocab])
    trees = record_trees(monkeypatch)
    assert [o.token_ids for o in eng.generate(prompts, _greedy())] == plain
    moved = [t for t, moves in trees if moves]
    assert moved and all(branches(t) for t in moved), len(moved)
    eng.blocks.check_all_free()


def test_a_failing_suffix_verification_fails_its_request_alone(tiny_reference, monkeypatch):
    _, out = tiny_reference("llama", max_seq_len=256, max_num_tokens=512, max_batch_size=64,
                            speculative=SUFFIX)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    prompts = [p * 2 for p in mixed_prompts()]
    plain = [o.token_ids for o in eng.generate(prompts, _greedy(window=PLAIN))]
    eng.generate(prompts[:4], _greedy())  # cached continuations: most steps speculate
    worker = eng.spec_worker
    real = type(worker).verify
    calls = {"n": 0, "victim": None}

    def flaky(self, req, logits, argmax):
        calls["n"] += 1
        if calls["n"] == 3:
            calls["victim"] = req.request_id
            raise RuntimeError("injected verification failure")
        return real(self, req, logits, argmax)

    monkeypatch.setattr(type(worker), "verify", flaky)
    ids = [eng.add_request(p, _greedy()) for p in prompts]
    done = drain_checking_spec_state(eng, worker)
    failed = [i for i in ids if done[i].finish_reason == "error"]
    assert failed == [calls["victim"]]
    assert "speculative verification failed: RuntimeError: injected" in done[failed[0]].error
    for i, want in zip(ids, plain):
        if i not in failed:
            assert done[i].token_ids == want
    assert len(worker.cache) == 4 + len(prompts) - 1  # the failed request's text is not kept
    eng.blocks.check_all_free()
    monkeypatch.undo()
    assert [o.token_ids for o in eng.generate(prompts, _greedy())] == plain


def test_a_tenant_never_drafts_from_another_tenants_responses(tiny_reference):
    """Requests that name a tenant draft from and feed that tenant's cache only: the same
    prompts under another tenant (or none) commit exactly as many tokens a step as the first
    pass did, with an empty cache; under the first tenant again, more. Output equals plain
    greedy throughout."""
    _, out = tiny_reference("llama", max_seq_len=256, max_num_tokens=512, max_batch_size=64,
                            speculative=SUFFIX)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    prompts = mixed_prompts()
    plain = [o.token_ids for o in eng.generate(prompts, _greedy(window=PLAIN))]

    def run(tenant):
        params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, tenant=tenant)
        outs = eng.generate(prompts, params)
        assert [o.token_ids for o in outs] == plain, tenant
        cached = sum(o.metrics.spec_cached_tokens for o in outs)
        assert (cached > 0) == (tenant == "alice" and len(seen) > 0), (tenant, cached)
        seen.append(tenant)
        return _per_step(outs)[0]

    seen: list = []

    first = run("alice")
    assert len(eng.spec_worker.cache) == len(prompts)
    assert run("bob") == first  # alice's answers are not bob's drafts
    assert run("alice") > max(first, 2.5)  # her own are
    assert run(None) == first  # nor are they the engine-wide cache's
    eng.blocks.check_all_free()


def test_break_even_measures_suffix_steps_as_masked_trees(tiny_reference):
    """The start-up measurement's speculative steps of a suffix engine are its worst case:
    max_draft_len nodes in a branching tree (the masked path trees take), not a chain; the
    engine is left as it was and still decodes what plain greedy does."""
    from kiln.runtime.speculative.break_even import measure_step_ms

    _, out = tiny_reference("llama", max_seq_len=256, max_num_tokens=1024, speculative=SUFFIX)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
        device="cpu", spec_break_even=1.5, adaptive_speculation=True))
    plans = []
    real_step = eng.runner.execute
    eng.runner.execute = lambda batch, *a: plans.extend(
        (r.draft.num_tokens, r.draft.step_mask is not None)
        for r, _ in batch.items if r.draft is not None) or real_step(batch, *a)
    ms = measure_step_ms(eng, steps=4, warmup=2, batch=2)
    eng.runner.execute = real_step
    assert set(ms) == {"plain", "spec"} and ms["plain"] > 0 and ms["spec"] > 0
    assert plans and set(plans) == {(9, True)}  # x + 8 drafts, masked
    assert not eng.spec_worker.full_steps and not eng.has_unfinished_requests()
    eng.blocks.check_all_free()
    prompts = mixed_prompts()[:2]
    plain_out = [o.token_ids for o in eng.generate(prompts, _greedy(16, PLAIN))]
    assert [o.token_ids for o in eng.generate(prompts, _greedy(16))] == plain_out
