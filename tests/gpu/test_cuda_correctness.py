"""The runtime on CUDA equals transformers on CUDA (float32, greedy). Skipped without CUDA.

Run on the lent GPU:  python -m pytest -q -s tests/gpu
The smollm2 check prints a table (prompt, tokens compared, equal) for the notes.
"""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, mixed_prompts, module_dir

from kiln.bench.prompts import CHAT_PROMPTS
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


# The reference (torch attention, plain torch ops), the Triton kernels run eagerly, and the
# fast path (Triton kernels + fused norm/rotary/activation + CUDA graphs).
BACKENDS = ["torch", "triton-eager", "triton"]


def runtime(backend: str, **kw) -> RuntimeConfig:
    name = "triton" if backend.startswith("triton") else backend
    return RuntimeConfig(device="cuda", attention_backend=name,
                         cuda_graphs=backend in ("triton", "flash-attn"), **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_transformers_on_cuda(arch, backend, tiny_reference):
    model, engine_dir = tiny_reference(arch)
    model = model.to("cuda")
    prompts = mixed_prompts()
    refs = [hf_greedy(model, p, 24) for p in prompts]
    eng = LLMEngine.from_engine_dir(engine_dir, runtime(
        backend, block_size=4, num_kv_blocks=32, max_num_tokens=16))
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == refs
    eng.blocks.check_all_free()
    model.to("cpu")


@pytest.fixture(scope="module")
def smol32(smollm2_gguf, tmp_path_factory):
    """A float32 smollm2 engine built with lookahead (7,7,7) (plain requests use (1,1,0))."""
    from kiln.artifact.speculative import SpeculativeConfig
    from kiln.builder import build_engine

    with module_dir(tmp_path_factory, "smol32") as root:
        out = root / "engine"
        build_engine("smollm2-135m", out, dtype="float32", max_seq_len=512, max_num_tokens=4096,
                     max_batch_size=32, progress=False,
                     speculative=SpeculativeConfig.from_cli("lookahead", "7,7,7", None, None))
        yield out


@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_first_32_greedy_tokens_match_transformers_on_cuda(smollm2_gguf, smol32,
                                                                   backend):
    from transformers import AutoModelForCausalLM

    eng = LLMEngine.from_engine_dir(smol32, runtime(backend))
    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).to("cuda").eval()
    prompts = [eng.apply_chat_template([{"role": "user", "content": p}])
               for p in CHAT_PROMPTS[:4]]
    outs = eng.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                                lookahead=(1, 1, 0)))
    rows = []
    for text, prompt, o in zip(CHAT_PROMPTS, prompts, outs):
        ref = hf_greedy(hf, prompt, 32)
        rows.append((text, len(ref), o.token_ids == ref, o.text[:60].replace("\n", " ")))
    print(f"\nsmollm2-135m float32 CUDA ({backend} attention), kiln vs transformers, "
          "first 32 greedy tokens")
    for r in rows:
        print(f"  {r[2]!s:5}  n={r[1]}  {r[0]!r:60} -> {r[3]!r}")
    assert all(r[2] for r in rows)
    eng.blocks.check_all_free()


def test_smollm2_long_prompt_prefilled_in_a_prefill_graph_matches_transformers(smollm2_gguf,
                                                                                smol32):
    """A ~160-token prompt is longer than the engine's largest decode bucket (32): its
    prefill replays a graph (a prefill bucket, cuda_graph.plan_buckets, or a masked bucket
    of this lookahead engine, whichever holds it in fewer tokens), and the first 32 greedy
    tokens equal transformers' in float32."""
    from transformers import AutoModelForCausalLM

    eng = LLMEngine.from_engine_dir(smol32, runtime("triton"))
    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).to("cuda").eval()
    text = " ".join(CHAT_PROMPTS * 2) + " Answer the first question only."
    prompt = eng.apply_chat_template([{"role": "user", "content": text}])
    assert 64 < len(prompt) <= 512, len(prompt)
    out = eng.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                                lookahead=(1, 1, 0)))[0]
    g = eng.runner.graphs
    assert any(b.num_tokens >= len(prompt) for b in g.replays), g.replays
    assert any(b.prefill for b in g.buckets)
    assert out.token_ids == hf_greedy(hf, prompt, 32)
    eng.blocks.check_all_free()


@pytest.mark.parametrize("backend", BACKENDS)
def test_smollm2_lookahead_equals_plain_greedy_on_cuda(smol32, backend):
    """4 prompts x 128 tokens, every window, one continuous batch, float32 (always
    speculating: pacing would keep some windows plain at this batch size)."""
    from kiln.bench.prompts import CODE_PROMPTS

    eng = LLMEngine.from_engine_dir(smol32, runtime(backend, adaptive_speculation=False))
    texts = [CODE_PROMPTS[0], CHAT_PROMPTS[0], CODE_PROMPTS[2], CHAT_PROMPTS[2]]
    prompts = [eng.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    plain = [o.token_ids for o in eng.generate(
        prompts, SamplingParams(max_tokens=128, temperature=0, lookahead=(1, 1, 0)))]
    windows = [(2, 2, 1), (4, 3, 4), (5, 5, 5), (7, 7, 7), (3, 2, 3)]
    jobs = [(w, i) for w in windows for i in range(4)]
    outs = eng.generate([prompts[i] for _, i in jobs],
                        [SamplingParams(max_tokens=128, temperature=0, lookahead=w)
                         for w, _ in jobs])
    rows = {}
    for (w, i), o in zip(jobs, outs):
        assert o.token_ids == plain[i], (w, i)
        steps, toks = rows.get(w, (0, 0))
        rows[w] = (steps + o.metrics.spec_steps, toks + o.metrics.spec_tokens)
    assert all(s > 0 for s, _ in rows.values()), rows
    print(f"\nsmollm2 fp32 CUDA ({backend}): lookahead == plain for 4 x 128; tokens/step",
          {w: round(t / s, 2) for w, (s, t) in rows.items()})
    eng.blocks.check_all_free()


def test_smollm2_device_lookahead_equals_host_and_plain_greedy_on_cuda(smol32):
    """Device lookahead (the window, verification, commit and KV move in the masked
    buckets' graphs, launched ahead of the host) on real weights, float32: real weights
    accept runs of drafts, so steps launched ahead move whole candidate trees to shifted
    positions (the 2026-12-04 slot bug put those rows' KV at the wrong cache slots and
    random weights, accepting little, never showed it). Grounded and code prompts, alone
    and four at a time; tokens equal plain greedy and the host worker's, token for token."""
    from kiln.bench.prompts import CODE_PROMPTS, GROUNDED_PROMPTS

    texts = GROUNDED_PROMPTS[:2] + CODE_PROMPTS[:2]
    results = {}
    for name, dev in (("host", False), ("device", True)):
        eng = LLMEngine.from_engine_dir(smol32, runtime(
            "triton", device_speculation=dev, adaptive_speculation=False))
        assert (eng.runner.spec_step is not None) == dev
        prompts = [eng.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        if "plain" not in results:
            results["plain"] = [o.token_ids for o in eng.generate(prompts, SamplingParams(
                max_tokens=96, temperature=0, lookahead=(1, 1, 0)))]
        params = SamplingParams(max_tokens=96, temperature=0)
        alone = [eng.generate([p], params)[0] for p in prompts]
        together = eng.generate(prompts, params)
        results[name] = [o.token_ids for o in alone]
        assert [o.token_ids for o in together] == results[name], name
        steps = sum(o.metrics.spec_steps for o in alone)
        toks = sum(o.metrics.spec_tokens for o in alone)
        print(f"\nsmollm2 fp32 CUDA lookahead {name}: {toks / steps:.2f} tokens/step")
        assert toks > 1.5 * steps  # runs of drafts were accepted: trees were shifted
        if dev:
            assert sum(n for b, n in eng.runner.graphs.replays.items() if b.masked) > 0
        eng.blocks.check_all_free()
    assert results["host"] == results["plain"]
    assert results["device"] == results["plain"]


@pytest.mark.parametrize("norm_form, backend", [
    ("default", "triton"), ("epilogue", "triton"), ("default", "flash-attn")])
def test_smollm2_bf16_fast_path_vs_reference_first_32_tokens(smollm2_gguf, tmp_path,
                                                             norm_form, backend, monkeypatch):
    """bf16: the fast path (kernels + graphs) vs the reference path, 32 greedy tokens.

    Where they differ, the first differing token must be a near tie in the reference's own
    distribution (top-2 log-prob gap <= 0.25 nats, one bf16 step of a logit between 32 and
    64; flash-attn-4 met exactly that once): bf16 rounding differences between kernels, not a
    bug (the float32 fast path is checked token-exact above).
    ``epilogue``: smollm2 forced onto the batch-1 norm fusion that llama-3-8b's hidden size
    takes (gemv_rms_scaled; smollm2's own is the prologue form), which no real model of
    that size can check here. ``flash-attn``: flash-attn-4 runs the prompts (prefill graphs
    off, so it takes every prompt step: it has no float32 kernels, so bf16 is where it is
    checked); the decode steps run the Triton graphs.
    """
    from kiln.builder import build_engine
    from kiln.runtime.kernels import gemv, gemv_configs

    flash_calls = []
    if backend == "flash-attn":
        pytest.importorskip("flash_attn.cute")
        from kiln.runtime.layers.flash_attention import FlashAttention

        monkeypatch.setattr(FlashAttention, "flash", lambda self, *a, _f=FlashAttention.flash:
                            (flash_calls.append(1), _f(self, *a))[1])
    calls = []
    if norm_form == "epilogue":
        monkeypatch.setattr(gemv_configs, "RESIDUAL_FUSION_MAX_HIDDEN", 0)
        monkeypatch.setattr(gemv, "gemv_rms_scaled", lambda *a, _f=gemv.gemv_rms_scaled,
                            **kw: (calls.append(1), _f(*a, **kw))[1])

    out = tmp_path / "smol-bf16"
    build_engine("smollm2-135m", out, dtype="bfloat16", max_seq_len=512, max_num_tokens=2048,
                 max_batch_size=8, progress=False)
    ref = LLMEngine.from_engine_dir(out, runtime("torch"))
    fast = LLMEngine.from_engine_dir(out, runtime(backend, prefill_graphs=backend == "triton"))
    prompts = [ref.apply_chat_template([{"role": "user", "content": p}])
               for p in CHAT_PROMPTS[:4]]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    # the four together (batch-4 graphs), then the first alone: batch 1 has its own graph
    # and kernels (the one-row GEMVs, the residual fusion); then a 7-token prompt alone,
    # which is prefilled in the 8-token decode graph (two query tiles of one sequence). A
    # decode-attention change once broke exactly these (every token 0; 2026-11-30) while
    # the batched run passed.
    short = prompts[0][:7]
    got = [o.token_ids for o in fast.generate(prompts, params)]
    got.append(fast.generate(prompts[:1], params)[0].token_ids)
    got.append(fast.generate([short], params)[0].token_ids)
    want += [want[0], ref.generate([short], params)[0].token_ids]
    prompts = prompts + [prompts[0], short]
    print(f"\nsmollm2-135m bf16 CUDA: fast path ({backend}) vs reference, first 32 greedy "
          "tokens")
    for prompt, w, g in zip(prompts, want, got):
        j = next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), None)
        if j is None:
            print("  equal (32/32)")
            continue
        lp = ref.generate([prompt + w[:j]], SamplingParams(max_tokens=1, temperature=0,
                                                           logprobs=2))[0].logprobs[0]
        top = sorted(lp.top.values(), reverse=True)
        gap = top[0] - top[1]
        print(f"  first difference at token {j}: reference {w[j]}, fast {g[j]}, "
              f"reference top-2 gap {gap:.3f} nats")
        assert gap <= 0.25, (j, gap)
    assert fast.runner.graphs is not None and fast.runner.graphs.num_replays > 0
    assert bool(calls) == (norm_form == "epilogue")
    assert bool(flash_calls) == (backend == "flash-attn")


def test_lookahead_engine_measures_its_break_even_on_cuda(tiny_reference):
    """With adaptive speculation on and no break-even given, a lookahead engine on CUDA times
    whole plain and speculative steps at start-up at batch 1 and 8 (break_even.spec_break_even),
    leaves nothing behind, and still generates plain greedy's tokens."""
    from kiln.artifact.speculative import SpeculativeConfig

    _, out = tiny_reference(
        "llama", max_seq_len=256, max_num_tokens=1024, max_batch_size=8,
        speculative=SpeculativeConfig.from_cli("lookahead", "4,3,4", None, None))
    eng = LLMEngine.from_engine_dir(out, runtime("triton", adaptive_speculation=True))
    be = eng.spec_break_even
    assert be is not None and [b for b, _ in be.points] == [1, 8]
    assert all(r > 0 for _, r in be.points)
    assert eng.startup_times["spec_break_even_s"] > 0
    assert eng.spec_stats == {"steps": 0, "accepted_tokens": 0, "engine_steps": 0,
                              "sync_engine_steps": 0}
    assert eng.num_steps == 0
    assert not eng.has_unfinished_requests()
    eng.blocks.check_all_free()
    prompts = mixed_prompts()
    spec = [o.token_ids for o in eng.generate(prompts, GREEDY)]
    plain = [o.token_ids for o in eng.generate(prompts, SamplingParams(
        max_tokens=24, temperature=0, ignore_eos=True, lookahead=(1, 1, 0)))]
    assert spec == plain
    print(f"\nbreak-even {be.to_json()} measured in "
          f"{eng.startup_times['spec_break_even_s']:.2f} s")


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logprobs_match_transformers_on_cuda(backend, tiny_reference):
    """Prompt logprobs on CUDA (scored rows staged after the sample rows; a short prompt's
    step replays a decode graph bucket, chunks of longer ones run eagerly), a batch mixing
    requests with and without them, async scheduling on: transformers' float32 log_softmax
    on CUDA within 1e-4, and the generated tokens unchanged."""
    model, engine_dir = tiny_reference("llama")
    model = model.to("cuda")
    prompts = mixed_prompts()
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                             prompt_logprobs=3 if i % 2 == 0 else None)
              for i in range(len(prompts))]
    eng = LLMEngine.from_engine_dir(engine_dir, runtime(
        backend, block_size=4, num_kv_blocks=64, max_num_tokens=16))
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [hf_greedy(model, p, 8) for p in prompts]
    for prompt, p, out in zip(prompts, params, outs):
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt], device="cuda")).logits[0]
                                    .float(), dim=-1)[:-1].cpu()
        got = out.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None
        for i, lp in enumerate(got[1:]):
            assert abs(lp.logprob - ref[i, prompt[i + 1]].item()) <= 1e-4
            assert list(lp.top) == ref[i].topk(3).indices.tolist()
    if backend == "triton":
        assert eng.runner.graphs.num_replays > 0
    eng.blocks.check_all_free()
    model.to("cpu")
