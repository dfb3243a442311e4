"""Draft-model speculative decoding in the runtime (float32, CPU, tiny models).

Oracle: plain decoding on the same target. Greedy output with a draft model must equal
plain greedy output token for token (alone, in batches with plain requests, with chunked
prefill and preemption); sampled output must follow the plain sampling distribution; a
draft forward that raises must not cost any request its output or its blocks.
"""

from __future__ import annotations

import collections
import types

import pytest
import torch
from helpers import (
    BIGRAM_PROMPT,
    exact_three_token_distribution,
    mixed_prompts,
    sample_three_tokens,
    tv,
)

from kiln.artifact.loader import load_engine
from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.engine import EngineLimits, LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.speculative import draft_model, verify
from kiln.sources import make_byte_tokenizer

PLAIN = (1, 1, 0)


def _greedy(n=24, window=None, **kw):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, lookahead=window, **kw)


def _engine(target: str, draft: str | None, k: int = 4, max_seq_len: int = 128,
            max_num_tokens: int = 256, max_batch_size: int = 8, **runtime) -> LLMEngine:
    """An engine of the float32 engine dir ``target`` drafted for by ``draft``'s weights
    (None: plain), built in-process (the artifact path is tested in test_draft_build)."""
    t = load_engine(target)
    spec = types.SimpleNamespace(generation_defaults=types.SimpleNamespace(values={}),
                                 speculative=_draft_config(k) if draft else t.spec.speculative)
    d = load_engine(draft) if draft else None
    return LLMEngine(t.spec.model, t.load_weights("cpu"), make_byte_tokenizer(),
                     EngineLimits(max_batch_size, max_seq_len, max_seq_len - 1 - k,
                                  max_num_tokens), torch.float32,
                     RuntimeConfig(device="cpu", **runtime), spec=spec,
                     draft=(d.spec.model, d.load_weights("cpu")) if d else None)


def _draft_config(k: int) -> SpeculativeConfig:
    return SpeculativeConfig(mode="draft", max_draft_len=k, draft_model="in-process")


@pytest.fixture(scope="module")
def engines(tiny_reference):
    """Engine dirs of two different tiny random models of one tokenizer (plain)."""
    return {arch: tiny_reference(arch, max_seq_len=256, max_num_tokens=256)[1]
            for arch in ("llama", "qwen2")}


def _count_ahead(eng: LLMEngine) -> collections.Counter:
    """Counts the draft model's steps launched ahead of the step in flight."""
    calls = collections.Counter()
    draft = eng.spec_worker.draft_model
    real = draft.draft_ahead

    def ahead(reqs, state):
        calls["steps"] += 1
        return real(reqs, state)

    draft.draft_ahead = ahead
    return calls


DEVICE = pytest.mark.parametrize("device", [False, True], ids=["host", "device"])


@DEVICE
@pytest.mark.parametrize("draft", ["qwen2", "llama"], ids=["other-model", "same-model"])
def test_draft_greedy_equals_plain_greedy(engines, draft, device):
    """A different draft (drafts mostly rejected) and the target itself as its draft (every
    draft accepted: K + 1 tokens a step); plain requests ride in the same batches. Verified
    on the host, and on the device (``DeviceDraft``: the steps after the first launched
    ahead of the step in flight, their drafts' positions moved on by the device)."""
    prompts = mixed_prompts()
    plain = _engine(engines["llama"], None, max_seq_len=256)
    want = [o.token_ids for o in plain.generate(prompts, _greedy(40))]
    eng = _engine(engines["llama"], engines[draft], max_seq_len=256,
                  device_speculation=device)
    ahead = _count_ahead(eng)
    got = eng.generate(prompts, _greedy(40))
    assert [o.token_ids for o in got] == want
    assert all(o.error is None for o in got)
    if device:  # every step launched, most of them ahead; none verified on the host
        assert eng.spec_stats["sync_engine_steps"] == 0
        assert ahead["steps"] > eng.spec_stats["engine_steps"] / 2, (ahead, eng.spec_stats)
    steps = sum(o.metrics.spec_steps for o in got)
    committed = sum(o.metrics.spec_tokens for o in got)
    assert steps > 0
    if draft == "llama":  # the target drafting for itself: all 4 drafts + the bonus
        assert committed > 4.5 * steps, (committed, steps)
    # mixed: every other request decodes plainly beside the drafting ones
    params = [_greedy(40, window=PLAIN if i % 2 else None) for i in range(len(prompts))]
    mixed = eng.generate(prompts, params)
    assert [o.token_ids for o in mixed] == want
    assert all(o.metrics.spec_steps == 0 for o in mixed[1::2])
    assert all(o.metrics.spec_steps > 0 for o in mixed[::2])
    eng.blocks.check_all_free()


@DEVICE
@pytest.mark.parametrize("k", [1, 3, 8])
def test_draft_lengths_and_chunked_prefill(engines, k, device):
    """K from 1 up, a token budget of 16 (prompts and the draft's catch-up both chunked)."""
    prompts = [p * 3 for p in mixed_prompts()[:5]]  # 30-60 tokens: several chunks
    plain = _engine(engines["llama"], None, max_seq_len=256, max_num_tokens=16)
    want = [o.token_ids for o in plain.generate(prompts, _greedy(30))]
    eng = _engine(engines["llama"], engines["llama"], k=k, max_seq_len=256, max_num_tokens=16,
                  device_speculation=device)
    got = eng.generate(prompts, _greedy(30))
    assert [o.token_ids for o in got] == want
    assert sum(o.metrics.spec_tokens for o in got) > sum(o.metrics.spec_steps for o in got)


@DEVICE
def test_draft_with_preemption_recomputes_the_draft_kv(engines, device):
    """KV for 2-3 sequences: requests are preempted (their blocks, target and draft KV
    alike, freed) and recomputed; output is unchanged."""
    prompts = mixed_prompts()
    plain = _engine(engines["llama"], None, max_seq_len=256)
    want = [o.token_ids for o in plain.generate(prompts, _greedy(48))]
    eng = _engine(engines["llama"], engines["qwen2"], max_seq_len=256, num_kv_blocks=24,
                  reserve_kv=False, device_speculation=device)
    got = eng.generate(prompts, _greedy(48))
    assert sum(o.metrics.num_preemptions for o in got) > 0
    assert [o.token_ids for o in got] == want
    eng.blocks.check_all_free()


@DEVICE
def test_a_failing_draft_forward_costs_no_request_its_output(engines, monkeypatch, device):
    """Fault injection: the draft's forward raises whenever request "bad" is in its batch.
    The batch is retried request by request: the others draft and speculate as before,
    "bad" decodes its steps without drafts (the target's own token), stops drafting after
    MAX_FAILURES, and every output equals plain greedy; every block is free at the end."""
    prompts = mixed_prompts()[:4]
    plain = _engine(engines["llama"], None, max_seq_len=256)
    want = [o.token_ids for o in plain.generate(prompts, _greedy(32))]
    eng = _engine(engines["llama"], engines["llama"], max_seq_len=256,
                  device_speculation=device)
    runner = eng.spec_worker.draft_model.runner
    real = runner.execute
    calls = collections.Counter()

    def execute(batch, *args, **kwargs):
        if any(s.req.request_id == "bad" for s, _ in batch.items):
            calls["bad"] += 1
            raise torch.OutOfMemoryError("injected: draft forward out of memory")
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)
    ids = [eng.add_request(p, _greedy(32), request_id="bad" if i == 1 else None)
           for i, p in enumerate(prompts)]
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    got = [outs[i] for i in ids]
    assert [o.token_ids for o in got] == want
    assert all(o.error is None for o in got)
    # "bad" tried MAX_FAILURES times (a batch try and its own each time), then no more
    assert calls["bad"] == 2 * draft_model.MAX_FAILURES
    others = [o for i, o in zip(ids, got) if i != "bad"]
    assert all(o.metrics.spec_tokens > 3 * o.metrics.spec_steps for o in others)
    eng.blocks.check_all_free()


def test_a_failing_draft_launched_ahead_loses_nothing(engines, capsys):
    """Fault injection in a draft step launched ahead of the step in flight (device
    verification): every third one raises. That step is not launched; the plain scheduler
    runs the next one (drafting request by request), and every output equals plain greedy
    with no request failed and every block free."""
    prompts = mixed_prompts()[:4]
    plain = _engine(engines["llama"], None, max_seq_len=256)
    want = [o.token_ids for o in plain.generate(prompts, _greedy(40))]
    eng = _engine(engines["llama"], engines["llama"], max_seq_len=256, device_speculation=True)
    draft = eng.spec_worker.draft_model
    real = draft.draft_ahead
    calls = collections.Counter()

    def ahead(reqs, state):
        calls["all"] += 1
        if calls["all"] % 3 == 0:
            calls["raised"] += 1
            raise RuntimeError("injected: draft forward launched ahead")
        return real(reqs, state)

    draft.draft_ahead = ahead
    got = eng.generate(prompts, _greedy(40))
    assert [o.token_ids for o in got] == want
    assert all(o.error is None for o in got)
    assert calls["raised"] >= 2 and calls["all"] > calls["raised"]
    assert "could not draft" in capsys.readouterr().err
    assert sum(o.metrics.spec_tokens for o in got) > 3 * sum(o.metrics.spec_steps for o in got)
    eng.blocks.check_all_free()


@pytest.fixture(scope="module")
def bigram_pair(bigram_source, tmp_path_factory):
    """The bigram target (p(t+1) = 2/3 at top_k 2) and a draft with the two swapped
    (q(t+1) = 1/3): its drafts need the rejection rule's correction."""
    from helpers import write_bigram

    from kiln.builder import build_engine

    root = tmp_path_factory.mktemp("bigram-pair")
    swapped = write_bigram(root / "swapped-src", swap=True)
    out = {}
    for name, src in (("target", bigram_source), ("draft", swapped)):
        out[name] = root / name
        build_engine(str(src), out[name], dtype="float32", max_seq_len=128, progress=False)
    return out


@DEVICE
def test_sampled_draft_speculation_follows_the_target_distribution(bigram_pair, monkeypatch,
                                                                   device):
    """Joint distribution of 3 sampled tokens vs the exact one, 1500 seeds each way (as
    test_speculative's: sampling noise alone gives a total variation around 0.02, so 0.06
    is loose for a correct rule and tight for a wrong one). The draft proposes t+1 with
    probability 1/3 where the target has 2/3; the negative control accepts every draft
    (no rejection step) and must land near the draft's distribution instead. Verified on
    the host (``_rejection``) and on the device (``verify_sampled``)."""
    eng = _engine(bigram_pair["target"], bigram_pair["draft"], k=3, max_num_tokens=8192,
                  max_batch_size=512, num_kv_blocks=4096, device_speculation=device)
    exact = exact_three_token_distribution(11)
    trials = 1500

    def run(window):
        return sample_three_tokens(eng, BIGRAM_PROMPT, window, trials)

    _, plain = run(PLAIN)
    outs, spec_counts = run(None)
    steps = sum(o.metrics.spec_steps for o in outs)
    committed = sum(o.metrics.spec_tokens for o in outs)
    assert steps > 0 and committed > 1.2 * steps  # drafts were accepted, often
    assert tv(plain, exact) < 0.06  # the oracle itself
    assert tv(spec_counts, exact) < 0.06, tv(spec_counts, exact)
    # the draft alone: 1/3 for +1 (what accepting every draft would give)
    draft_only = exact_three_token_distribution(11, p_one=1 / 3)
    assert tv(draft_only, exact) > 0.3

    if device:  # the control breaks verify_sampled's rule: the device verified these
        monkeypatch.setattr(verify, "accept_drafts",  # the wrong rule
                            lambda u, p_d, q_d: torch.ones_like(u, dtype=torch.bool))
    else:
        def accept_all(req, logits, drafts, q):  # the wrong rule
            return list(drafts) + [drafts[-1]]

        monkeypatch.setattr(draft_model.DraftModelWorker, "_rejection",
                            staticmethod(accept_all))
    _, wrong = run(None)
    assert tv(wrong, exact) > 0.2, tv(wrong, exact)  # the test can tell
    eng.blocks.check_all_free()


@DEVICE
def test_seeded_sampled_drafts_are_reproducible(engines, device):
    """A seeded request's drafts come from its own generator: the same output alone and in
    a batch."""
    prompts = mixed_prompts()[:4]
    eng = _engine(engines["llama"], engines["llama"], max_seq_len=256,
                  device_speculation=device)
    p = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    alone = eng.generate([prompts[0]], p)[0]
    batch = eng.generate(prompts, [p] + [SamplingParams(max_tokens=24, temperature=1.0,
                                                         ignore_eos=True)] * 3)
    assert batch[0].token_ids == alone.token_ids
    assert alone.metrics.spec_tokens > alone.metrics.spec_steps


def test_per_request_draft_lengths_in_one_batch(engines):
    """Requests of one batch draft 0 (plain), 1, 2 and the engine's 4 tokens per step:
    each equals plain greedy, and commits at most its own length + 1 per step."""
    prompts = mixed_prompts()[:4]
    plain = _engine(engines["llama"], None, max_seq_len=256)
    want = [o.token_ids for o in plain.generate(prompts, _greedy(30))]
    eng = _engine(engines["llama"], engines["llama"], max_seq_len=256)
    ks = [0, 1, 2, 4]
    recorded: list[list[int]] = []
    real = eng.spec_worker.fill

    def fill(batch, on_error):  # every plan's length
        recorded.append([r.draft.num_tokens - 1 for r, _ in batch.items if r.draft is not None])
        return real(batch, on_error)

    eng.spec_worker.fill = fill
    outs = eng.generate(prompts, [_greedy(30, max_draft_len=k) for k in ks])
    assert [o.token_ids for o in outs] == want
    assert outs[0].metrics.spec_steps == 0
    for o, k in zip(outs[1:], ks[1:]):
        assert o.metrics.spec_steps > 0
        assert o.metrics.spec_tokens >= 1.5 * o.metrics.spec_steps  # self-draft: accepted
    assert max(o.metrics.spec_tokens / o.metrics.spec_steps for o in outs[1:2]) <= 2
    assert {k for step in recorded for k in step} == {1, 2, 4}
    eng.blocks.check_all_free()


def test_request_draft_length_beyond_the_engine_is_one_clear_error(engines):
    from kiln.errors import RequestError

    eng = _engine(engines["llama"], engines["qwen2"], k=3)
    with pytest.raises(RequestError, match=r"max_draft_len 5 exceeds the engine's 3"):
        eng.add_request([1, 2, 3], _greedy(max_draft_len=5))
    with pytest.raises(RequestError, match=r"must be an integer >= 0"):
        _greedy(max_draft_len=-1)
    plain = _engine(engines["llama"], None)
    with pytest.raises(RequestError, match=r"applies to draft-model engines"):
        plain.add_request([1, 2, 3], _greedy(max_draft_len=2))
    assert not eng.has_unfinished_requests() and not plain.has_unfinished_requests()


def test_structured_output_checks_drafts_against_the_grammar(engines):
    """Greedy json_schema requests with a draft model (the target drafting for itself, so
    drafts reach the grammar's end): the same tokens as plain guided decoding, valid
    JSON, drafts accepted."""
    import json

    from kiln.runtime.guided import GuidedSpec

    schema = {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]}},
        "required": ["color", "ok", "size"], "additionalProperties": False}
    guided = GuidedSpec("json_schema", json.dumps(schema))
    example = '{"color":"green","ok":true,"size":"small"} {"color":"red","ok":false,"size":"large"}'
    prompts = [list(example.encode()) + list(f" item {i}: ".encode()) for i in range(4)]
    eng = _engine(engines["llama"], engines["llama"], max_seq_len=256)

    def run(window):
        return eng.generate(prompts, SamplingParams(max_tokens=60, temperature=0,
                                                    guided=guided, lookahead=window))

    plain = run(PLAIN)
    outs = run(None)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    for o in outs:
        assert set(json.loads(o.text)) == {"color", "ok", "size"}
    assert sum(o.metrics.spec_tokens for o in outs) > sum(o.metrics.spec_steps for o in outs)
    eng.blocks.check_all_free()


@DEVICE
def test_adaptive_pacing_stops_a_losing_draft_and_tries_again(engines, device):
    """Break-even 2 tokens per step (RuntimeConfig.spec_break_even; measured on CUDA): a
    draft that agrees with the target (itself) keeps speculating; one that does not (another
    model, ~1 token per step) stops after MIN_REAL steps, decodes plainly for FIRST_PAUSE
    steps, tries again, and pauses twice as long after the next stop. Output is plain
    greedy's either way."""
    from kiln.runtime.speculative.pace import MIN_REAL, DraftPace

    prompts = mixed_prompts()[:3]
    plain = _engine(engines["llama"], None, max_seq_len=256)
    want = [o.token_ids for o in plain.generate(prompts, _greedy(100))]
    for draft, keeps in (("llama", True), ("qwen2", False)):
        eng = _engine(engines["llama"], engines[draft], max_seq_len=256, spec_break_even=2.0,
                      device_speculation=device)
        ids = [eng.add_request(p, _greedy(100)) for p in prompts]
        paces = [eng._requests[i].spec_pace for i in ids]
        assert all(isinstance(p, DraftPace) for p in paces)
        outs = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                outs[o.request_id] = o
        assert [outs[i].token_ids for i in ids] == want
        for p in paces:
            if keeps:
                assert p.starts == 1 and p.plain_steps <= 1, p  # the prefill's token
            else:
                assert p.starts >= 2 and p.plain_steps >= DraftPace.FIRST_PAUSE, p
                assert p.spec_steps <= p.starts * (MIN_REAL + 1), p
                assert p.next_pause >= 2 * DraftPace.FIRST_PAUSE
        eng.blocks.check_all_free()


def test_built_draft_engine_serves_from_its_directory(tiny_reference_source, tmp_path):
    """`kiln build --speculative-decoding-mode draft`'s artifact: the engine directory
    holds the draft (ENGINE/draft), ``from_engine_dir`` reads everything from it, and its
    greedy output equals the plain engine's."""
    from kiln.builder import build_engine

    _, target = tiny_reference_source("llama")
    draft = "random:tiny-qwen2:5"  # the byte tokenizer too; a larger embedding table
    out = tmp_path / "engine"
    build_engine(str(target), out, dtype="float32", max_seq_len=256, max_num_tokens=256,
                 max_batch_size=8, progress=False,
                 speculative=SpeculativeConfig.from_cli("draft", max_draft_len=3,
                                                        draft_model=str(draft)))
    assert (out / "draft" / "engine.json").is_file()
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    assert eng.spec_worker.k == 3
    assert eng.spec_worker.draft_model.runner.model.cfg.architecture == "qwen2"
    assert eng.spec_worker.draft_model.vocab == eng.model_config.vocab_size  # 300 of 512
    prompts = mixed_prompts()
    plain = eng.generate(prompts, _greedy(32, window=PLAIN))
    outs = eng.generate(prompts, _greedy(32))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.metrics.spec_steps for o in outs) > 0
    eng.blocks.check_all_free()
