
"""Speculative decoding in the runtime (float32, CPU, tiny models).

Oracle: plain greedy decoding. Lookahead and ngram greedy output must equal it token for
token, alone and in mixed batches; the KV kept after a step must equal a plain forward's;
sampled speculation must follow the plain sampling distribution; a failing step must leave
no state behind.
"""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import (
    BIGRAM_PROMPT,
    branches,
    build_bigram_engine,
    drain_checking_spec_state,
    exact_three_token_distribution,
    mixed_prompts,
    record_trees,
    sample_three_tokens,
    tv,
    use_wrong_acceptance_rule,
)

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative.break_even import measure_step_ms

WINDOWS = [(2, 2, 1), (4, 3, 4), (5, 5, 5), (7, 7, 7), (3, 2, 3)]
PLAIN = (1, 1, 0)


def _greedy(n=24, window=None):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, lookahead=window)


def _repetitive_prompts():
    """Prompts with repeats, so the n-gram pool and prompt lookup find candidates."""
    base = mixed_prompts()
    return [p + p[: max(3, len(p) // 2)] + p for p in base[:4]] + base[4:]


# device_speculation: the engine window's greedy requests keep their lookahead state on the
# device (here the CPU, the same tensor ops) and verify there; the host worker is the oracle
@pytest.fixture(scope="module", params=[("llama", False), ("qwen3", False), ("llama", True)],
                ids=["llama", "qwen3", "llama-device-state"])
def la_engine(request, tiny_reference):
    arch, on_device = request.param
    _, out = tiny_reference(
        arch, max_seq_len=256, max_num_tokens=1024, max_batch_size=64,
        speculative=SpeculativeConfig.from_cli("lookahead", "7,7,7", None, None))
    return LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu",
                                                        device_speculation=on_device))


def test_lookahead_greedy_equals_plain_greedy_for_every_window(la_engine):
    prompts = _repetitive_prompts()
    plain = [o.token_ids for o in la_engine.generate(prompts, _greedy(window=PLAIN))]
    for window in WINDOWS:
        outs = la_engine.generate(prompts, _greedy(window=window))
        assert [o.token_ids for o in outs] == plain, window
        assert all(o.metrics.spec_steps > 0 for o in outs)
        # drafts were accepted somewhere, so acceptance and KV moves were exercised
        assert sum(o.metrics.spec_tokens for o in outs) > sum(o.metrics.spec_steps for o in outs)
        # never more than N tokens per step
        assert all(o.metrics.spec_tokens <= o.metrics.spec_steps * window[1] for o in outs)
    la_engine.blocks.check_all_free()


@pytest.mark.parametrize("on_device", [False, True], ids=["host-state", "device-state"])
def test_mixed_windows_in_one_batch_with_preemption(tiny_reference, on_device):
    _, out = tiny_reference(
        "llama", max_seq_len=256, max_num_tokens=1024, max_batch_size=64,
        speculative=SpeculativeConfig.from_cli("lookahead", "7,7,7", None, None))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    prompts = _repetitive_prompts()
    plain = [o.token_ids for o in eng.generate(prompts, _greedy(window=PLAIN))]
    small = LLMEngine.from_engine_dir(
        out, RuntimeConfig(device="cpu", block_size=4, num_kv_blocks=80, max_num_tokens=200,
                           reserve_kv=False, device_speculation=on_device))
    windows = [PLAIN, *WINDOWS, None, (4, 3, 4)]  # None: the engine's own (7,7,7)
    params = [_greedy(window=w) for w in windows]
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert outs[0].metrics.spec_steps == 0
    small.blocks.check_all_free()


def _kv(eng, slots):
    """K and V [layers, len(slots), kv_heads, head_dim] at the given cache slots."""
    blk, off = eng.cache.slot_index(torch.as_tensor(slots))
    return eng.cache.k[:, blk, off].clone(), eng.cache.v[:, blk, off].clone()


@pytest.mark.parametrize("on_device", [False, True], ids=["host-state", "device-state"])
def test_kv_after_lookahead_steps_equals_plain_forward(tiny_reference, on_device):
    _, out = tiny_reference(
        "qwen3", max_seq_len=256, max_num_tokens=1024, max_batch_size=64,
        speculative=SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu", block_size=4,
                                                       enable_prefix_caching=False,
                                                       device_speculation=on_device))
    prompt = mixed_prompts()[0]
    rid = eng.add_request(prompt, _greedy(60))
    req = eng._requests[rid]
    while req.metrics.spec_tokens < req.metrics.spec_steps + 3 and req.metrics.num_steps < 50:
        eng.step()
    assert req.metrics.spec_tokens > req.metrics.spec_steps  # some drafts were accepted
    n = req.num_computed_tokens
    slots = eng.runner.slots_of(req.block_table, list(range(n)))
    got_k, got_v = _kv(eng, slots)
    # A plain engine prefilled with exactly the committed tokens computes the reference KV.
    ref = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu", block_size=4,
                                                       enable_prefix_caching=False))
    rid2 = ref.add_request(req.all_token_ids[:n] + [0], _greedy(2, PLAIN))
    ref_req = ref._requests[rid2]
    ref.step()
    ref_slots = ref.runner.slots_of(ref_req.block_table, list(range(n)))
    ref_k, ref_v = _kv(ref, ref_slots)
    torch.testing.assert_close(got_k, ref_k, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_v, ref_v, rtol=1e-4, atol=1e-5)
    eng.abort(rid)
    eng.blocks.check_all_free()


@pytest.mark.parametrize("on_device", [False, True], ids=["host-state", "device-state"])
def test_ngram_greedy_equals_plain_greedy(tiny_reference, on_device):
    _, out = tiny_reference(
        "llama", max_seq_len=256, max_num_tokens=512, max_batch_size=64,
        speculative=SpeculativeConfig.from_cli("ngram", None, 6, 3))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu",
                                                       device_speculation=on_device))
    prompts = _repetitive_prompts()
    plain = [o.token_ids for o in eng.generate(prompts, _greedy(window=PLAIN))]
    outs = eng.generate(prompts, _greedy())
    assert [o.token_ids for o in outs] == plain
    assert sum(o.metrics.spec_steps for o in outs) > 0
    assert sum(o.metrics.spec_tokens for o in outs) > sum(o.metrics.spec_steps for o in outs)
    eng.blocks.check_all_free()
    if on_device:
        assert sorted(eng.spec_worker._free_slots) == list(range(64))


def test_device_ngram_in_mixed_batches_with_preemption(tiny_reference):
    """Device prompt-lookup requests beside plain ones and sampled ones, with a KV cache
    small enough to preempt: greedy output equals plain greedy; sampled requests (one at
    a temperature alone, one with top-k) are verified on the device (seeded: two runs
    agree). The plain greedy
    requests ride in the device steps as plain rows, launched ahead: most speculative
    engine steps are not synchronous (on the host-state engine every one is)."""
    _, out = tiny_reference(
        "llama", max_seq_len=256, max_num_tokens=512, max_batch_size=64,
        speculative=SpeculativeConfig.from_cli("ngram", None, 6, 2))
    prompts = _repetitive_prompts()
    plain = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu")).generate(
        prompts, _greedy(window=PLAIN))
    params = [_greedy(window=PLAIN if i % 3 == 0 else None) for i in range(len(prompts))]
    params[1] = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, seed=7,
                               ignore_eos=True)
    params[2] = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)

    def run(on_device):
        eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
            device="cpu", block_size=4, num_kv_blocks=80, max_num_tokens=200, reserve_kv=False,
            device_speculation=on_device))
        outs = eng.generate(prompts, params)
        eng.blocks.check_all_free()
        return outs, eng

    host, _ = run(False)
    dev, eng = run(True)
    again, _ = run(True)
    assert [o.token_ids for o in dev] == [o.token_ids for o in again]
    assert len(dev[2].token_ids) == 24 and dev[2].metrics.spec_steps > 0
    assert len(dev[1].token_ids) == 24
    stats = eng.spec_stats  # admissions and preemptions' prefills still run synchronously
    assert stats["sync_engine_steps"] < stats["engine_steps"], stats
    for i, (o, p) in enumerate(zip(host, plain)):
        if i not in (1, 2):
            assert o.token_ids == p.token_ids, i
    for i, (o, p) in enumerate(zip(dev, plain)):
        if i not in (1, 2):
            assert o.token_ids == p.token_ids, i
    assert sum(o.metrics.num_preemptions for o in dev) > 0
    assert sum(o.metrics.spec_tokens for o in dev) > sum(o.metrics.spec_steps for o in dev)
    assert sorted(eng.spec_worker._free_slots) == list(range(64))


@pytest.mark.parametrize("mode", ["ngram", "lookahead"])
def test_plain_rows_beside_device_plans_are_launched_ahead(tiny_reference, mode):
    """Plain greedy requests (lookahead=PLAIN) and a sampled one beside device-state
    speculating requests: every output equals plain greedy (the sampled one: the same
    seeded run twice), and the engine's speculative steps run launched ahead with the
    plain rows in them, not synchronously (before, any plain row made the step
    synchronous for the whole batch: every speculative engine step)."""
    spec = (SpeculativeConfig.from_cli("ngram", None, 6, 2) if mode == "ngram"
            else SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None))
    _, out = tiny_reference("llama", max_seq_len=256, max_num_tokens=512, max_batch_size=8,
                            speculative=spec)
    prompts = _repetitive_prompts()[:4]
    plain = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu")).generate(
        prompts, _greedy(40, window=PLAIN))
    params = [_greedy(40), _greedy(40, window=PLAIN), _greedy(40),
              SamplingParams(max_tokens=40, temperature=0.8, ignore_eos=True, lookahead=PLAIN)]

    def run():
        eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
            device="cpu", device_speculation=True, adaptive_speculation=False))
        outs = eng.generate(prompts, params)
        eng.blocks.check_all_free()
        return outs, eng.spec_stats

    outs, stats = run()
    for i in (0, 1, 2):
        assert outs[i].token_ids == plain[i].token_ids, i
    assert len(outs[3].token_ids) == 40
    assert outs[0].metrics.spec_steps > 10
    # the first speculative step of the batch runs after a plain one; the rest are
    # launched ahead of the step in flight
    assert stats["sync_engine_steps"] <= 2, stats
    assert stats["engine_steps"] > 10, stats


def test_request_window_beyond_engine_is_rejected_naming_both(tiny_reference):
    _, out = tiny_reference(
        "llama", max_seq_len=256, max_num_tokens=1024, max_batch_size=64,
        speculative=SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    with pytest.raises(ValueError, match=r"\(5,3,4\).*\(4,3,4\)"):
        eng.add_request([1, 2, 3], _greedy(window=(5, 3, 4)))
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("mode", ["lookahead", "ngram", "suffix"])
def test_sampled_speculation_follows_the_target_distribution(bigram_source, tmp_path, mode,
                                                             monkeypatch):
    """Joint distribution of 3 sampled tokens vs the exact one, 1500 seeds each way.

    8 outcomes; sampling noise alone gives a total variation around 0.02 at this size, so
    the bound 0.06 is loose for a correct verifier and tight for a wrong one. The negative
    control runs the same test with a wrong acceptance rule (a draft is accepted whenever
    the target gives it any probability, no rejection step): it shifts mass to the drafts'
    (most recent prompt n-gram's) outcome and must fail the bound by a wide margin
    (measured: correct verifier 0.038 / 0.040, wrong rule 0.555 / 0.556, lookahead /
    ngram; suffix decoding, whose drafts also come from earlier requests' outputs in its
    shared cache, verifies its chains with prompt lookup's rule). Seeds are fixed, so the
    result is deterministic for a given implementation.
    """
    out = build_bigram_engine(bigram_source, tmp_path / "engine", mode, max_num_tokens=8192,
                              max_batch_size=1024)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu", num_kv_blocks=4096))
    prompt = BIGRAM_PROMPT
    exact = exact_three_token_distribution(11)
    trials = 1500

    def run(window):
        return sample_three_tokens(eng, prompt, window, trials)

    _, plain = run(PLAIN)
    outs, spec_counts = run(None)
    steps = sum(o.metrics.spec_steps for o in outs)
    committed = sum(o.metrics.spec_tokens for o in outs)
    assert steps > 0 and committed > 1.2 * steps  # drafts were accepted, often
    assert tv(plain, exact) < 0.06  # the oracle itself
    assert tv(spec_counts, exact) < 0.06

    use_wrong_acceptance_rule(monkeypatch)
    _, wrong = run(None)
    assert tv(wrong, exact) > 0.2, tv(wrong, exact)  # the test can tell
    eng.blocks.check_all_free()


def test_sampled_suffix_trees_follow_the_target_distribution(bigram_source, tmp_path,
                                                             monkeypatch):
    """Suffix decoding's trees with siblings, sampled: the joint distribution of 3 tokens vs
    the exact one, 1500 seeds each way, as the test above. The shared cache first takes 60
    sampled 100-token responses (walks of the bigram's own steps, +1 twice as often as
    +2), so after most contexts the cached text went on both ways and the trees hold both
    (asserted: most verified trees have a node with two children); the short prompt
    repeats nothing, so the request's own text drafts no chain instead. The verification
    walk's recursive rejection over siblings decides what is committed. Negative control:
    the wrong acceptance rule (a child is accepted whenever the target gives it any
    probability) accepts the first, more frequent sibling too often. Measured (TV): plain
    sampling 0.020, suffix trees 0.031, the wrong rule 0.333; all 1500 verified trees
    branched, and 612 steps accepted a path whose rows moved (a sibling's)."""
    prompt = BIGRAM_PROMPT[-8:]  # 0 2 3 5 6 8 9 11
    out = build_bigram_engine(bigram_source, tmp_path / "engine", "suffix",
                              max_num_tokens=8192, max_batch_size=1024)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu", num_kv_blocks=8192,
                                                       adaptive_speculation=False))
    eng.generate([prompt] * 60, [SamplingParams(max_tokens=100, temperature=1.0, top_k=2,
                                                seed=10_000 + s, ignore_eos=True)
                                 for s in range(60)])
    exact = exact_three_token_distribution(11)
    trials = 1500

    def run(window):
        return sample_three_tokens(eng, prompt, window, trials)

    _, plain = run(PLAIN)
    trees = record_trees(monkeypatch)
    outs, spec_counts = run(None)
    branched = [t for t, _ in trees if branches(t)]
    assert len(branched) > len(trees) / 2, (len(branched), len(trees))
    assert sum(o.metrics.spec_tokens for o in outs) > 1.2 * sum(
        o.metrics.spec_steps for o in outs)  # drafts were accepted, often
    assert any(moves for _, moves in trees)  # sibling paths accepted: their KV moved
    assert tv(plain, exact) < 0.06  # the oracle itself
    assert tv(spec_counts, exact) < 0.06, tv(spec_counts, exact)

    use_wrong_acceptance_rule(monkeypatch)
    _, wrong = run(None)
    assert tv(wrong, exact) > 0.2, tv(wrong, exact)  # the test can tell
    eng.blocks.check_all_free()


@pytest.mark.parametrize("warp", ["temperature", "top_p", "top_k", "min_p"])
@pytest.mark.parametrize("mode", ["lookahead", "ngram"])
def test_device_sampled_speculation_follows_the_target_distribution(bigram_source, tmp_path,
                                                                    mode, warp, monkeypatch):
    """Sampled requests verified on the device (``verify.row_targets``: every
    verifying row draws among the tokens its top-k / top-p / min-p keep, a draft is
    accepted where it equals its row's draw): the joint distribution of 3 tokens vs the
    exact one, as the host test above, 1500 seeds.

    ``temperature``: 0.5 alone; the bigram's logits 10 and 10 - ln 2 become 20 and
    20 - 2 ln 2, so p(t+1) = 4/5, p(t+2) = 1/5 (the other 298 tokens hold under 1e-6).
    ``top_p`` 0.6 at temperature 1: t+1 alone (its 2/3 reaches 0.6). ``top_k`` 2 or
    ``min_p`` 0.5 at temperature 3: the two tokens alone, p(t+1) = 1 / (1 + 2 ** (-1/3))
    = 0.557 (without the warp the other 298 tokens would hold 85 %). Two negative
    controls: the sampled requests verified greedily (their rows' argmax as targets, a
    wrong rule that accepts the most likely draft every time), and plans that drop their
    top-k / top-p / min-p; each must fail the bound by a wide margin. Seeded requests:
    keys come from their generators, so the run is deterministic.
    """
    from kiln.runtime.speculative import verify

    out = build_bigram_engine(bigram_source, tmp_path / "engine", mode, max_num_tokens=8192,
                              max_batch_size=256)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
        device="cpu", num_kv_blocks=2048, device_speculation=True,
        adaptive_speculation=False))
    prompt = BIGRAM_PROMPT
    sampling, p_one = {"temperature": ({"temperature": 0.5}, 0.8),
                       "top_p": ({"temperature": 1.0, "top_p": 0.6}, 1.0),
                       "top_k": ({"temperature": 3.0, "top_k": 2}, 1 / (1 + 2 ** (-1 / 3))),
                       "min_p": ({"temperature": 3.0, "min_p": 0.5}, 1 / (1 + 2 ** (-1 / 3))),
                       }[warp]
    exact = exact_three_token_distribution(11, p_one=p_one)
    trials, chunk = 1500, 250  # a chunk fits the engine's 256 device slots

    def run(window):
        counts, steps, committed = collections.Counter(), 0, 0
        for first in range(0, trials, chunk):
            ps = [SamplingParams(max_tokens=3, **sampling, seed=s, ignore_eos=True,
                                 lookahead=window)
                  for s in range(first, first + chunk)]
            if window is None:
                ids = [eng.add_request(prompt, p) for p in ps]
                assert all(eng._requests[i].spec_state.slot is not None for i in ids)
                done = {}
                while eng.has_unfinished_requests():
                    done.update((o.request_id, o) for o in eng.step() if o.finished)
                outs = [done[i] for i in ids]
            else:
                outs = eng.generate([prompt] * chunk, ps)
            counts.update(tuple(o.token_ids) for o in outs)
            steps += sum(o.metrics.spec_steps for o in outs)
            committed += sum(o.metrics.spec_tokens for o in outs)
        return counts, steps, committed

    plain, _, _ = run(PLAIN)
    spec_counts, steps, committed = run(None)
    assert steps > 0 and committed > 1.2 * steps  # drafts were accepted, often
    assert tv(plain, exact) < 0.06  # the oracle itself
    assert tv(spec_counts, exact) < 0.06, tv(spec_counts, exact)

    def greedy_targets(logits, rows, entries, active, offsets):  # the wrong rule
        return logits.argmax(-1)[rows]

    if warp != "temperature":
        from kiln.runtime.speculative import draft, worker

        with monkeypatch.context() as m:  # plans that forget their warp
            m.setattr(worker, "plan_warp", lambda params: draft.NO_WARP)
            unwarped, _, _ = run(None)
        assert tv(unwarped, exact) > 0.2, tv(unwarped, exact)
    if p_one < 1:  # (top_p's one token is the argmax: greedy is right there)
        monkeypatch.setattr(verify, "row_targets_torch", greedy_targets)
        wrong, _, _ = run(None)
        assert tv(wrong, exact) > 0.2, tv(wrong, exact)  # the test can tell
    eng.blocks.check_all_free()
    assert sorted(eng.spec_worker._free_slots) == list(range(256))


@pytest.mark.parametrize("fault", ["verify", "oom-in-forward", "device-update"])
def test_a_failing_step_leaves_no_state_and_the_engine_recovers(tiny_reference, monkeypatch,
                                                                fault):
    """The second field report: a failure inside a speculative step (an exception in one
    request's verification, an out-of-memory error in the batch's forward, or a failure
    after the device state was advanced) must leave nothing saved behind, and the engine
    goes on: a verification failure fails that request alone (the others equal plain
    greedy), a failed forward or device step (run around the forward) fails the requests of
    that step, and later
    requests run correctly. step() never raises for any."""
    _, out = tiny_reference(
        "qwen3", max_seq_len=256, max_num_tokens=1024, max_batch_size=64,
        speculative=SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
        device="cpu", device_speculation=fault == "device-update"))
    prompts = _repetitive_prompts()
    plain = [o.token_ids for o in eng.generate(prompts, _greedy(window=PLAIN))]
    worker = eng.spec_worker
    calls = {"n": 0, "victim": None}
    if fault == "device-update":
        real_update = type(worker.device).update

        def update_then_fail(self, slots, *args):
            real_update(self, slots, *args)  # the device state has advanced
            calls["n"] += 1
            if calls["n"] == 3:
                calls["victims"] = len(slots)
                raise RuntimeError("injected failure after the device update")

        monkeypatch.setattr(type(worker.device), "update", update_then_fail)
    elif fault == "verify":
        real = type(worker).verify

        def flaky(self, req, logits, argmax):
            calls["n"] += 1
            if calls["n"] == 3:  # after the forward wrote KV and the pool was updated
                calls["victim"] = req.request_id
                raise RuntimeError("injected verification failure")
            return real(self, req, logits, argmax)

        monkeypatch.setattr(type(worker), "verify", flaky)
    else:
        real_exec = eng.runner.execute

        def oom_once(batch, *args):
            if any(r.draft is not None for r, _ in batch.items) and calls["n"] == 0:
                calls["n"] += 1
                raise torch.OutOfMemoryError("CUDA out of memory (injected during warm-up)")
            return real_exec(batch, *args)

        monkeypatch.setattr(eng.runner, "execute", oom_once)
    ids = [eng.add_request(p, _greedy()) for p in prompts]
    done = drain_checking_spec_state(eng, worker)
    failed = [i for i in ids if done[i].finish_reason == "error"]
    if fault == "verify":
        assert failed == [calls["victim"]]
        assert "speculative verification failed: RuntimeError: injected" in done[failed[0]].error
    elif fault == "device-update":
        # the device step runs inside the forward: its failure fails the step's requests
        assert len(failed) >= calls["victims"] > 0
        assert all("the engine step failed: RuntimeError: injected failure after "
                   "the device update" in done[i].error for i in failed)
        assert sorted(worker._free_slots) == list(range(worker.device.num_slots))
    else:
        assert failed and all("OutOfMemoryError" in done[i].error for i in failed)
    for i, want in zip(ids, plain):
        if i not in failed:
            assert done[i].token_ids == want and done[i].error is None
    eng.blocks.check_all_free()
    again = eng.generate(prompts, _greedy())  # the engine goes on, correctly
    assert [o.token_ids for o in again] == plain
    eng.blocks.check_all_free()


@pytest.mark.parametrize("mode", ["lookahead", "ngram", "suffix"])
def test_structured_output_with_speculation_equals_plain_and_checks_drafts(tiny_reference,
                                                                           mode):
    """Greedy structured output on a speculative engine: drafts are verified under the
    grammar, so the output equals plain guided decoding and stays valid JSON."""
    import json

    from kiln.runtime.guided import GuidedSpec

    if mode == "lookahead":
        spec = SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None)
    elif mode == "suffix":
        spec = SpeculativeConfig.from_cli("suffix", max_draft_len=6)
    else:
        spec = SpeculativeConfig.from_cli("ngram", None, 6, 2)
    _, out = tiny_reference("llama", max_seq_len=256, max_num_tokens=1024,
                            max_batch_size=16, speculative=spec)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    schema = {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]}},
        "required": ["color", "ok", "size"], "additionalProperties": False}
    guided = GuidedSpec("json_schema", json.dumps(schema))
    example = '{"color":"green","ok":true,"size":"small"} {"color":"red","ok":false,"size":"large"}'
    prompts = [list(example.encode()) + list(f" item {i}: ".encode()) for i in range(4)]

    def run(window):
        params = SamplingParams(max_tokens=60, temperature=0, guided=guided, lookahead=window)
        return eng.generate(prompts, params)

    plain = run(PLAIN)
    spec_outs = run(None)
    assert [o.token_ids for o in spec_outs] == [o.token_ids for o in plain]
    for o in spec_outs:
        obj = json.loads(o.text)
        assert set(obj) == {"color", "ok", "size"}
    assert sum(o.metrics.spec_tokens for o in spec_outs) > sum(
        o.metrics.spec_steps for o in spec_outs)  # grammatical drafts were accepted
    if mode == "suffix":  # again, the answers now in the cache of earlier responses
        again = run(None)
        assert [o.token_ids for o in again] == [o.token_ids for o in plain]
        assert sum(o.metrics.spec_cached_tokens for o in again) > 0
    eng.blocks.check_all_free()


def test_a_draft_that_completes_the_grammar_ends_the_chain(tiny_reference):
    """The crash the issue found (greedy json_schema on a lookahead engine): a pool
    candidate holding the grammar's last token and then the stop token was accepted up to
    the stop token, and the bonus token was then asked of a terminated matcher
    ("GrammarMatcher has terminated after accepting the stop token"), which killed the
    engine. The chain now ends at the stop token; the output equals plain guided decoding."""
    import json

    from kiln.runtime.guided import GuidedSpec

    _, out = tiny_reference("llama", max_seq_len=256, max_num_tokens=1024, max_batch_size=16,
                            speculative=SpeculativeConfig.from_cli("lookahead", "4,3,4",
                                                                   None, None))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    eos = 257
    schema = {"type": "object", "properties": {"size": {"enum": ["small", "large"]}},
              "required": ["size"], "additionalProperties": False}
    guided = GuidedSpec("json_schema", json.dumps(schema))
    # each example ends with the stop token, so the pool offers '"' -> ('}', eos)
    example = []
    for size in ("large", "small") * 3:
        example += list(json.dumps({"size": size}, separators=(",", ":")).encode()) + [eos]
    prompts = [example + list(f"{i}".encode()) for i in range(3)]

    def run(window):
        return eng.generate(prompts, SamplingParams(max_tokens=40, temperature=0,
                                                    guided=guided, lookahead=window))

    plain = run(PLAIN)
    spec = run(None)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for o in spec:
        assert o.finish_reason == "stop" and o.error is None, o
        assert json.loads(o.text)["size"] in ("small", "large")
    assert sum(o.metrics.spec_tokens for o in spec) > sum(o.metrics.spec_steps for o in spec)
    eng.blocks.check_all_free()


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_paced_speculation_speculates_only_where_it_pays_and_keeps_plain_output(
        tiny_reference, async_on):
    """An unreachable break-even never lets a request speculate (every step is plain,
    launched ahead under async scheduling); a break-even every step reaches lets each
    request speculate once its shadow has MIN_SHADOW replayed steps, and it never stops.
    Greedy output equals plain greedy either way; seeded requests are never paced."""
    from kiln.runtime.speculative.pace import MIN_SHADOW, PRIOR_GAIN

    _, out = tiny_reference(
        "llama", max_seq_len=256, max_num_tokens=1024, max_batch_size=64,
        speculative=SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None))
    prompts = _repetitive_prompts()[:4]
    n = 40

    ahead = []

    def run(break_even):
        eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
            device="cpu", spec_break_even=break_even, async_scheduling=async_on,
            adaptive_speculation=True))
        real = eng._launch_next
        eng._launch_next = lambda cur: ahead.append(real(cur)) or ahead[-1]
        return eng, eng.generate(prompts, _greedy(n))

    plain_eng, plain = run(None)
    assert plain_eng.spec_break_even is None  # nothing measured on CPU: no pacing
    assert not any(ahead)  # always speculating: nothing runs ahead
    eng, paced = run(50.0)
    assert eng.spec_break_even.at(1) == 50.0 and eng.spec_break_even.at(64) == 50.0
    assert any(ahead) == async_on  # plain steps, launched ahead when async
    assert [o.token_ids for o in paced] == [o.token_ids for o in plain]
    assert all(o.metrics.spec_steps == 0 for o in paced)
    ahead.clear()
    _, paying = run(0.5)
    assert [o.token_ids for o in paying] == [o.token_ids for o in plain]
    for o in paying:
        # plain until the shadow's first decision (MIN_SHADOW replayed steps need at most
        # MIN_SHADOW + N - 1 tokens, + 1 in flight), then speculating to the end
        plain_steps = o.metrics.num_steps - o.metrics.spec_steps
        assert o.metrics.spec_steps > 0 and plain_steps <= MIN_SHADOW + 3 + 1, o.metrics
    eng.add_request(prompts[0], SamplingParams(max_tokens=4, seed=3))
    eng.add_request(prompts[0], SamplingParams(max_tokens=4))
    seeded, unseeded = list(eng.scheduler.waiting)[-2:]
    assert seeded.spec_pace is None and unseeded.spec_pace is not None
    assert unseeded.spec_pace.gain == PRIOR_GAIN  # lookahead: the branch the shadow misses
    with pytest.raises(ValueError, match="spec_break_even=0"):
        LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu", spec_break_even=0,
                                                     adaptive_speculation=True))


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_measure_step_ms_leaves_the_engine_as_it_was(tiny_reference, async_on):
    """The break-even measurement (wall ms per plain and per speculative step on dummy
    requests) returns both times and leaves no request, block, statistic or pacing change
    behind; the engine then generates exactly as before. Refused while requests are in
    flight and on engines that do not speculate."""
    _, out = tiny_reference(
        "llama", max_seq_len=256, max_num_tokens=1024, max_batch_size=8,
        speculative=SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
        device="cpu", spec_break_even=1.5, async_scheduling=async_on,
        adaptive_speculation=True))
    prompts = _repetitive_prompts()[:2]
    before = [o.token_ids for o in eng.generate(prompts, _greedy(32))]
    stats, steps = dict(eng.spec_stats), eng.num_steps
    ms = measure_step_ms(eng, steps=6, warmup=2)
    assert set(ms) == {"plain", "spec"} and ms["plain"] > 0 and ms["spec"] > 0
    assert eng.spec_break_even.at(1) == 1.5
    assert eng.spec_stats == stats and eng.num_steps == steps
    plans = []
    real_step = eng.runner.execute
    eng.runner.execute = lambda batch, *a: plans.extend(
        r.draft.num_tokens for r, _ in batch.items if r.draft is not None) or real_step(batch, *a)
    wide = measure_step_ms(eng, steps=4, warmup=2, batch=3)  # 3 dummy requests at once
    eng.runner.execute = real_step
    assert set(wide) == {"plain", "spec"} and not eng.spec_worker.full_steps
    assert plans and set(plans) == {eng.speculative.tokens_per_step}  # every step at full T
    assert measure_step_ms(eng, batch=9) is None  # more than max_num_seqs
    assert not eng.has_unfinished_requests()
    eng.blocks.check_all_free()
    assert [o.token_ids for o in eng.generate(prompts, _greedy(32))] == before
    eng.add_request(prompts[0], _greedy(4))
    assert measure_step_ms(eng) is None  # busy: never measured under load
    while eng.has_unfinished_requests():
        eng.step()
    _, plain_out = tiny_reference("llama", max_seq_len=256, max_num_tokens=1024)
    plain = LLMEngine.from_engine_dir(plain_out, RuntimeConfig(device="cpu"))
    assert measure_step_ms(plain) is None


def test_measure_step_ms_on_an_ngram_engine_drafts_max_draft_len_every_step(
        tiny_reference):
    """Prompt-lookup engines measure their break-even too: every speculative step of the
    dummy requests drafts max_draft_len tokens (padded where the text has no match), and
    the engine is left as it was."""
    _, out = tiny_reference(
        "llama", max_seq_len=256, max_num_tokens=1024, max_batch_size=8,
        speculative=SpeculativeConfig.from_cli("ngram", None, 6, 2))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
        device="cpu", spec_break_even=1.5, adaptive_speculation=True))
    prompts = _repetitive_prompts()[:2]
    before = [o.token_ids for o in eng.generate(prompts, _greedy(24))]
    plans = []
    real_step = eng.runner.execute
    eng.runner.execute = lambda batch, *a: plans.extend(
        r.draft.num_tokens for r, _ in batch.items if r.draft is not None) or real_step(batch, *a)
    ms = measure_step_ms(eng, steps=4, warmup=2, batch=2)
    eng.runner.execute = real_step
    assert set(ms) == {"plain", "spec"} and ms["plain"] > 0 and ms["spec"] > 0
    assert plans and set(plans) == {eng.speculative.tokens_per_step} == {7}
    assert not eng.spec_worker.full_steps and not eng.has_unfinished_requests()
    eng.blocks.check_all_free()
    assert [o.token_ids for o in eng.generate(prompts, _greedy(24))] == before
    eng.add_request(prompts[0], _greedy(4))
    # prompt lookup: the shadow proposes what the worker does, so no prior gain
    assert eng.scheduler.waiting[-1].spec_pace.gain == 1.0


@pytest.mark.parametrize("mode", ["lookahead", "ngram"])
def test_device_speculation_in_the_async_pipeline(tiny_reference, monkeypatch, mode):
    """Device speculative steps launched ahead (the next one queued before this one's
    commit is read; its positions and slots moved on by the device) commit what the
    synchronous device path and plain greedy commit: stops inside accepted runs (max_tokens
    and stop tokens), an abort with a step in flight, a request beside them that is not
    on the device (a smaller lookahead window: the batch then runs synchronously; or a
    plain one: a plain row in the steps launched ahead, aborted in flight too), and every
    block and slot freed at the end."""
    spec = (SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None) if mode == "lookahead"
            else SpeculativeConfig.from_cli("ngram", None, 5, 2))
    _, out = tiny_reference(
        "llama", max_seq_len=256, max_num_tokens=1024, max_batch_size=8, speculative=spec)
    prompts = _repetitive_prompts()[:4]
    plain_eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    lengths = [5, 13, 24, 40]
    plain = [o.token_ids for o in plain_eng.generate(
        prompts, [_greedy(n, PLAIN) for n in lengths])]
    stop_at = plain[2][9]  # a token the third request stops on (inside an accepted run)

    def params(windows=(None,) * 4):
        out = [_greedy(n, w) for n, w in zip(lengths, windows)]
        out[2] = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                stop_token_ids=(stop_at,))
        return out

    want = list(plain)
    want[2] = plain[2][: plain[2].index(stop_at) + 1]

    def run(async_on, windows=(None,) * 4, abort=None):
        eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
            device="cpu", device_speculation=True, async_scheduling=async_on,
            adaptive_speculation=False))
        ahead = {"n": 0}
        real = eng.proposer.schedule_chain

        def counted(cur, on_error):
            step = real(cur, on_error)
            ahead["n"] += step[0] is not None
            return step

        monkeypatch.setattr(eng.proposer, "schedule_chain", counted)
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params(windows))]
        done, steps = {}, 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
            steps += 1
            inflight = eng._inflight
            if (abort is not None and ids[abort] not in done and inflight is not None
                    and inflight.spec_entries and steps > 3):  # a spec step is in flight
                eng.abort(ids[abort])
                abort = None
        eng.blocks.check_all_free()
        assert sorted(eng.spec_worker._free_slots) == list(range(8))
        stats = (eng.spec_stats["steps"], eng.spec_stats["accepted_tokens"])
        return [done[i].token_ids if i in done else None for i in ids], stats, ahead["n"]

    sync, sync_stats, sync_ahead = run(False)
    assert sync == want and sync_ahead == 0
    got, stats, ahead = run(True)
    assert got == want and stats == sync_stats
    assert ahead > 0 and stats[1] > stats[0]  # launched ahead, drafts accepted
    aborted, _, _ = run(True, abort=3)
    assert aborted[:3] == want[:3] and aborted[3] is None
    mixed, _, _ = run(True, windows=(None, (2, 2, 1) if mode == "lookahead" else PLAIN,
                                     None, None))
    assert mixed == want
    # a plain request beside the device plans rides in the steps launched ahead
    mixed, _, ahead = run(True, windows=(None, None, None, PLAIN))
    assert mixed == want and ahead > 0
    aborted, _, _ = run(True, windows=(None, None, None, PLAIN), abort=3)
    assert aborted[:3] == want[:3] and aborted[3] is None


@pytest.mark.parametrize("on_device", [False, True], ids=["host-state", "device-state"])
def test_device_requests_ride_along_when_one_speculates(tiny_reference, on_device):
    """One paced request speculates: on the device path every request of a device slot
    gets a plan for the same step (the masked bucket pads each sequence to a full step
    anyway, and a batch of device plans only is launched ahead); on the host path only the
    speculating one does. Output stays plain greedy either way."""
    _, out = tiny_reference(
        "llama", max_seq_len=256, max_num_tokens=512, max_batch_size=8,
        speculative=SpeculativeConfig.from_cli("ngram", None, 4, 1))
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu", spec_break_even=1.5,
                                                       device_speculation=on_device))
    prompts = _repetitive_prompts()[:3]
    plain = [o.token_ids for o in eng.generate(prompts, _greedy(window=PLAIN))]
    ids = [eng.add_request(p, _greedy()) for p in prompts]
    reqs = [eng._requests[i] for i in ids]
    while any(r.num_computed_tokens < r.num_tokens - 1 or r.num_tokens <= len(r.prompt_token_ids)
              for r in reqs):
        eng.step()  # prefill and a first token each
    for i, r in enumerate(reqs):  # the first speculates (and pays), the others do not
        r.spec_pace.speculating = i == 0
        r.spec_pace.shadow.recent.clear()  # no evidence: they would not start on their own
    reqs[0].spec_pace.shadow.recent.extend([5] * 8)
    asked = []
    real = eng.spec_worker.propose_batch
    eng.spec_worker.propose_batch = lambda rs, on_error: (asked.extend(rs), real(rs, on_error))
    eng.proposer.gate(list(eng.scheduler.running))
    eng.spec_worker.propose_all(list(eng.scheduler.running), eng.fail_request)
    assert asked == (reqs if on_device else reqs[:1])
    if on_device:
        assert all(r.draft is not None and r.draft.device_slot is not None for r in reqs)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert [done[i] for i in ids] == plain
    eng.blocks.check_all_free()
