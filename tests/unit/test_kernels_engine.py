"""The engine on the "triton" attention backend (CPU, TRITON_INTERPRET=1) equals "torch".

Tiny float32 llama, greedy lookahead: chunked prefill, tree-masked speculative steps and
their KV moves, over blocks of 4, must give the torch backend's tokens.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest
from helpers import mixed_prompts

pytest.importorskip("triton")

from kiln.artifact.speculative import SpeculativeConfig
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams


def _tokens(engine_dir, backend, prompts, params, graphs=False, device_state=False):
    eng = LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        device="cpu", block_size=4, num_kv_blocks=96, max_num_tokens=40,
        attention_backend=backend, cuda_graphs=graphs, device_speculation=device_state))
    if device_state:  # the CUDA path of the device step (kernels, interpreted)
        eng.runner.spec_step.proposer.use_kernels(True)
    outs = eng.generate(prompts, params)
    eng.blocks.check_all_free()
    if device_state:  # a device slot committed past its prompt
        assert int(eng.spec_worker.device.total.max()) > max(len(p) for p in prompts)
    if graphs:  # the static-buffer (graph) path ran decode and speculative steps
        g = eng.runner.graphs
        assert g is not None and g.num_replays > 0
        assert any(b.masked for b in g.buckets) and any(not b.masked for b in g.buckets)
    return [o.token_ids for o in outs], sum(o.metrics.spec_steps for o in outs)


@pytest.mark.parametrize("graphs,device_state", [(False, False), (True, False), (False, True),
                                                 (True, True)],
                         ids=["eager", "graph-buffers", "eager-device-state",
                              "graph-buffers-device-state"])
def test_triton_backend_engine_greedy_and_lookahead(tiny_reference, graphs, device_state):
    """Also with the lookahead state on the device: its steps proposed, verified and their
    KV moved by the kernels around the forward (graph-buffers: inside the masked bucket's
    replay, from the stager's entries)."""
    _, out = tiny_reference(
        "llama", max_seq_len=128, max_num_tokens=256, max_batch_size=8,
        speculative=SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None))
    # one prompt long enough to be prefilled in chunks (max_num_tokens 40), with repeats so
    # the n-gram pool finds drafts; one short
    prompts = [p + p[:6] + p for p in mixed_prompts()[1:2]] + [mixed_prompts()[0]]
    # the second request decodes plainly and outlives the first: mixed steps, then decode
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, lookahead=(4, 3, 4)),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, lookahead=(1, 1, 0))]
    ref, ref_spec_steps = _tokens(out, "torch", prompts, params)
    got, spec_steps = _tokens(out, "triton", prompts, params, graphs, device_state)
    assert got == ref
    assert spec_steps > 0 and spec_steps == ref_spec_steps


def test_staged_graph_path_with_preemption_and_prefix_cache(tiny_reference):
    """8 mixed prompts (two sharing a 16-token prefix), a 16-token budget and a cache too
    small for all: the Triton staged path (graph buffers, decode buckets of 1..8) gives the
    torch backend's tokens, preempts, hits the prefix cache and frees every block."""
    _, out = tiny_reference("llama", max_seq_len=128, max_num_tokens=256, max_batch_size=8)
    prompts = mixed_prompts()
    prompts[3] = prompts[4][:16] + prompts[3]  # shares 4 full blocks with prompts[4]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def run(backend):
        eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
            device="cpu", block_size=4, num_kv_blocks=32, max_num_tokens=16, reserve_kv=False,
            attention_backend=backend, cuda_graphs=True))
        outs = eng.generate(prompts, params)
        eng.blocks.check_all_free()
        return eng, outs

    _, ref = run("torch")
    eng, got = run("triton")
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert sum(o.metrics.num_preemptions for o in got) > 0
    assert sum(o.metrics.num_cached_prompt_tokens for o in got) > 0
    assert eng.runner.graphs.num_replays > 0


def test_buckets_that_fail_to_capture_run_eagerly(tiny_reference, monkeypatch, capsys):
    """A capture failure (here: every bucket of 2+ sequences) must not stop the engine: one
    warning line, those batches run eagerly, results unchanged."""
    from kiln.runtime import cuda_graph

    orig = cuda_graph.CudaGraphRunner._capture_one

    def flaky(self, b, stream):
        if b.num_seqs > 1:
            raise RuntimeError("CUDA error: out of resources\nmore lines")
        return orig(self, b, stream)

    monkeypatch.setattr(cuda_graph.CudaGraphRunner, "_capture_one", flaky)
    _, out = tiny_reference("llama", max_seq_len=128, max_num_tokens=256, max_batch_size=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = mixed_prompts()[:3]
    cfg = {"device": "cpu", "block_size": 4, "num_kv_blocks": 64, "cuda_graphs": True}
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(attention_backend="triton", **cfg))
    err = capsys.readouterr().err
    n = len(eng.runner.graphs.buckets)  # decode 1, 2, 4 and the prefill buckets (4 seqs)
    assert n > 3 and f"warning: {n - 1} of {n} CUDA graph buckets could not be captured" in err
    assert "out of resources" in err and "more lines" not in err
    got = [o.token_ids for o in eng.generate(prompts, params)]
    ref = LLMEngine.from_engine_dir(out, RuntimeConfig(attention_backend="torch", **cfg))
    assert got == [o.token_ids for o in ref.generate(prompts, params)]
    assert {b.num_seqs for b in eng.runner.graphs.ready} == {1}


def test_short_prompt_prefilled_in_a_decode_graph_bucket(tiny_reference):
    """A prompt of 12 tokens alone fits the 16-sequence, 16-token decode bucket, captured with
    max_query_len 1 (cuda_graph.find_bucket): its prefill runs there, two query tiles of one
    sequence. The Triton staged path must give the torch backend's tokens (a launch that
    took max_query_len as a bound once computed only the first tile: every token wrong)."""
    _, out = tiny_reference("llama", max_seq_len=64, max_num_tokens=64, max_batch_size=16)
    prompt = mixed_prompts()[2][:12]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def run(backend):
        eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
            device="cpu", block_size=4, num_kv_blocks=32, attention_backend=backend,
            cuda_graphs=backend == "triton"))
        toks = eng.generate([prompt], params)[0].token_ids
        return eng, toks

    _, ref = run("torch")
    eng, got = run("triton")
    assert got == ref
    g = eng.runner.graphs
    assert g.find_bucket(1, 12, False) == next(b for b in g.buckets
                                                if b.num_seqs == 16 and not b.masked)
    assert g.num_replays > 0


def test_prompt_past_the_decode_buckets_prefilled_in_a_prefill_bucket(tiny_reference):
    """A 20-token prompt is longer than the largest decode bucket (4 sequences, 4 tokens): it
    runs in the prefill bucket (here the token budget, 24: under PREFILL_MIN_TOKENS there
    is one; one logit row per sequence), and so do a 24-token chunk of a longer prompt and a
    mixed step; the Triton staged path must give the torch backend's tokens. Before prefill
    buckets such prompts ran eagerly."""
    from kiln.runtime.cuda_graph import Bucket

    _, out = tiny_reference("llama", max_seq_len=64, max_num_tokens=64, max_batch_size=4)
    prompts = [mixed_prompts()[2][:20], mixed_prompts()[1][:3] * 9]  # 20 and 27 tokens
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)]

    def run(backend):
        eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
            device="cpu", block_size=4, num_kv_blocks=48, max_num_tokens=24,
            attention_backend=backend, cuda_graphs=backend == "triton"))
        outs = eng.generate(prompts, params)
        eng.blocks.check_all_free()
        return eng, [o.token_ids for o in outs]

    _, ref = run("torch")
    eng, got = run("triton")
    assert got == ref
    g = eng.runner.graphs
    prefill = [b for b in g.buckets if b.prefill]
    assert [(b.num_seqs, b.num_tokens, b.num_rows) for b in prefill] == [(4, 24, 4)]
    assert g.find_bucket(1, 20, False, num_rows=1) == Bucket(4, 24, False, 24, 4)
    assert g.find_bucket(1, 20, False) is None  # 20 logit rows: no prefill bucket has them
    assert sum(n for b, n in g.replays.items() if b in prefill) >= 2  # prompts, chunks


def test_prefill_bucket_ladder():
    """Powers of two past the largest decode bucket, at least PREFILL_MIN_TOKENS, then the
    limit; none where the decode buckets already reach the limit."""
    from kiln.runtime.cuda_graph import plan_buckets, prefill_tokens

    assert prefill_tokens(64, 1024) == [128, 256, 512, 1024]
    assert prefill_tokens(256, 1024) == [512, 1024]
    assert prefill_tokens(1, 1024) == [128, 256, 512, 1024]
    assert prefill_tokens(8, 40) == [40]
    assert prefill_tokens(64, 64) == [] and prefill_tokens(64, 32) == []
    assert prefill_tokens(64, 300) == [128, 256, 300]
    b = plan_buckets(64, 2048, 1, 1024)
    assert [x.num_tokens for x in b if x.prefill] == [128, 256, 512, 1024]
    assert all(x.num_seqs == x.num_rows == 64 for x in b if x.prefill)
    assert not any(x.prefill for x in plan_buckets(64, 2048, 1, 1024, prefill=False))


# prompt lookup through the graph buffers only (the masked bucket its plans must take; the
# interpreted draft search makes each run ~1 min on 2 cores)
@pytest.mark.parametrize("graphs,mode", [(False, "lookahead"), (True, "lookahead"),
                                         (True, "ngram")],
                         ids=["eager", "graph-buffers", "graph-buffers-ngram"])
def test_device_speculation_launched_ahead_on_the_staged_path(tiny_reference, graphs,
                                                              monkeypatch, mode):
    """Device speculative steps launched ahead on the staged path: the kernels move each
    plan's staged positions, cache slots and context length on by what the step in flight
    committed (inside the masked bucket's replay with graph buffers); the tokens equal the
    torch backend's plain greedy ones."""
    spec = (SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None) if mode == "lookahead"
            else SpeculativeConfig.from_cli("ngram", None, 5, 1))
    _, out = tiny_reference(
        "llama", max_seq_len=128, max_num_tokens=256, max_batch_size=8, speculative=spec)
    prompts = [p + p[:6] + p for p in mixed_prompts()[:2]]
    # a random model copies little: prompt lookup needs longer outputs to accept drafts
    lengths = (10, 14) if mode == "lookahead" else (30, 50)
    plain_p = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, lookahead=(1, 1, 0))
               for n in lengths]
    ref, _ = _tokens(out, "torch", prompts, plain_p)
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(
        device="cpu", block_size=4, num_kv_blocks=96, max_num_tokens=40,
        attention_backend="triton", cuda_graphs=graphs, device_speculation=True,
        adaptive_speculation=False))
    eng.runner.spec_step.proposer.use_kernels(True)  # the CUDA path, interpreted
    ahead = []
    real = eng.proposer.schedule_chain
    monkeypatch.setattr(eng.proposer, "schedule_chain", lambda cur, on_error: ahead.append(
        real(cur, on_error)) or ahead[-1])
    outs = eng.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                  for n in lengths])
    assert [o.token_ids for o in outs] == ref
    assert any(a[0] is not None for a in ahead)
    assert sum(o.metrics.spec_tokens for o in outs) > sum(o.metrics.spec_steps for o in outs)
    eng.blocks.check_all_free()


@pytest.mark.parametrize(("graphs", "device"), [(False, False), (True, False), (True, True)],
                         ids=["eager", "graph-buffers", "device-verified"])
def test_draft_model_on_the_staged_path(tiny_reference, graphs, device):
    """Draft-model speculation through the stager (int32 input buffers: the drafts are
    scattered into the verify step's rows on the device), on both models' staged paths:
    equals the torch backend's plain greedy tokens. Verified on the host, and on the device
    (steps launched ahead: the draft's staged rows moved on, ``execute(counts=)``)."""
    import types

    import torch

    from kiln.artifact.loader import load_engine
    from kiln.runtime.engine import EngineLimits
    from kiln.sources import make_byte_tokenizer

    target = load_engine(tiny_reference("llama", max_seq_len=128, max_num_tokens=256)[1])
    draft = load_engine(tiny_reference("qwen2", max_seq_len=128, max_num_tokens=256)[1])
    k = 3
    spec = types.SimpleNamespace(
        generation_defaults=types.SimpleNamespace(values={}),
        speculative=SpeculativeConfig(mode="draft", max_draft_len=k, draft_model="in-process"))
    prompts = [p + p[:6] + p for p in mixed_prompts()[1:2]] + [mixed_prompts()[0]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def run(backend, with_draft):
        eng = LLMEngine(target.spec.model, target.load_weights("cpu"), make_byte_tokenizer(),
                        EngineLimits(8, 128, 120, 40), torch.float32,
                        RuntimeConfig(device="cpu", block_size=4, num_kv_blocks=96,
                                      attention_backend=backend, cuda_graphs=graphs,
                                      device_speculation=device),
                        spec=spec if with_draft else None,
                        draft=(draft.spec.model, draft.load_weights("cpu")) if with_draft
                        else None)
        moved = []
        if with_draft:
            runner = eng.spec_worker.draft_model.runner
            real = runner.moved_entries
            runner.moved_entries = lambda b, n: moved.append(n) or real(b, n)
        outs = eng.generate(prompts, params)
        eng.blocks.check_all_free()
        if with_draft and graphs:
            assert eng.spec_worker.draft_model.runner.graphs.num_replays > 0
        if with_draft:
            assert bool(moved) == device and (not device or set(moved) == {1, 2})
        return [o.token_ids for o in outs], sum(o.metrics.spec_steps for o in outs)

    ref, _ = run("torch", False)
    got, spec_steps = run("triton", True)
    assert got == ref
    assert spec_steps > 0


def test_prompt_logprobs_on_the_staged_path(tiny_reference):
    """Prompt logprobs (their logits rows staged after the step's other rows): a 12-token
    prompt whose 11 scored rows fit the 16-sequence decode bucket (a graph replay), a
    40-token one chunked by the 24-token budget (too many rows for any bucket: eager), and
    a request without them beside; the torch backend's values within 1e-4, same ranks."""
    _, out = tiny_reference("llama", max_seq_len=64, max_num_tokens=64, max_batch_size=16)
    prompts = [mixed_prompts()[2][:12], mixed_prompts()[4], mixed_prompts()[1]]
    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)]

    def engine(backend):
        return LLMEngine.from_engine_dir(out, RuntimeConfig(
            device="cpu", block_size=4, num_kv_blocks=64, max_num_tokens=24,
            attention_backend=backend, cuda_graphs=backend == "triton"))

    ref = engine("torch").generate(prompts, params)
    eng = engine("triton")
    eng.add_request(prompts[0], params[0])  # alone: its prefill step is a graph bucket's
    outs = eng.step()
    assert eng.runner.graphs.num_replays == 1 and outs[0].prompt_logprobs is not None
    while eng.has_unfinished_requests():
        outs += eng.step()
    alone = [o for o in outs if o.finished]
    got = eng.generate(prompts, params)
    eng.blocks.check_all_free()
    for r, g in zip(ref + ref[:1], got + alone):
        assert g.token_ids == r.token_ids
        if r.prompt_logprobs is None:
            assert g.prompt_logprobs is None
            continue
        assert len(g.prompt_logprobs) == len(r.prompt_logprobs) and g.prompt_logprobs[0] is None
        for a, b in zip(g.prompt_logprobs[1:], r.prompt_logprobs[1:]):
            assert (a.token_id, a.rank, list(a.top)) == (b.token_id, b.rank, list(b.top))
            assert abs(a.logprob - b.logprob) <= 1e-4
    assert [len(o.prompt_logprobs) for o in got[:2]] == [12, 40]
