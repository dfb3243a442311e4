"""The flash-attn backend against the torch reference on CUDA (bf16, kiln's paged cache).
Skipped without CUDA or without flash-attn-4 (``pip install 'kiln-llm[flash-attn]'``)."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.kv_cache import KVCache
from kiln.runtime.layers.attention import AttentionMetadata, SeqAttention, TorchAttention
from kiln.runtime.layers.flash_attention import FlashAttention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("flash_attn.cute")

H, KVH, D = 32, 8, 128


def _step(seqs: list[tuple[int, int]], block_size: int):
    """A step of sequences (query_len, context_len), blocks laid out in reverse order so the
    block tables are not the identity."""
    torch.manual_seed(0)
    blocks = sum(-(-c // block_size) for _, c in seqs)
    cache = KVCache(1, blocks, block_size, KVH, D, torch.bfloat16, "cuda")
    cache.k.normal_()
    cache.v.normal_()
    order = torch.arange(blocks - 1, -1, -1, device="cuda")
    metas, slots_new, start, used = [], [], 0, 0
    for qlen, ctx in seqs:
        nb = -(-ctx // block_size)
        table = order[used:used + nb]
        used += nb
        key_slots = (table[:, None] * block_size
                     + torch.arange(block_size, device="cuda")).reshape(-1)[:ctx]
        metas.append(SeqAttention(start, qlen, ctx, key_slots))
        slots_new.append(key_slots[ctx - qlen:])
        start += qlen
    q = torch.randn(start, H, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(start, KVH, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(start, KVH, D, dtype=torch.bfloat16, device="cuda")
    return q, k, v, cache, AttentionMetadata(torch.cat(slots_new), metas)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("seqs", [
    [(2000, 2000)],                          # a prompt
    [(512, 4096)],                           # a prompt chunk after cached tokens
    [(300, 300), (1, 900), (64, 1200)],      # prompts beside a decode
])
def test_matches_the_reference(seqs, block_size):
    q, k, v, cache, meta = _step(seqs, block_size)
    flash = FlashAttention()
    assert flash.varlen is not None
    ref = TorchAttention().forward(0, q, k, v, cache, meta, D ** -0.5).float()
    out = flash.forward(0, q, k, v, cache, meta, D ** -0.5).float()
    assert flash.varlen is not None, "flash-attn-4 refused the step (fell back to Triton)"
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("seqs", [[(1, 8000)], [(1, 1024)] * 16])
def test_decode_matches_the_reference(seqs):
    """Decode is timed at build for the record (it runs in the Triton graphs): its numbers
    must be right too."""
    q, k, v, cache, meta = _step(seqs, 16)
    flash = FlashAttention(classes=("decode",))
    ref = TorchAttention().forward(0, q, k, v, cache, meta, D ** -0.5).float()
    out = flash.forward(0, q, k, v, cache, meta, D ** -0.5).float()
    assert flash.varlen is not None, "flash-attn-4 refused the step (fell back to Triton)"
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


def test_build_measures_the_backends_and_the_engine_runs_the_choice(tmp_path):
    """`kiln build` on CUDA times triton and flash-attn per step class, records every
    problem's numbers and the winners, and the engine loads with the recorded backend."""
    from kiln.builder import build_engine
    from kiln.runtime.engine import LLMEngine, RuntimeConfig
    from kiln.runtime.layers.attention_select import STEP_CLASSES
    from kiln.runtime.sampling_params import SamplingParams

    out = tmp_path / "e"
    spec = build_engine("random:qwen2.5-0.5b", out, dtype="bfloat16", max_seq_len=4096,
                        max_num_tokens=4096, max_batch_size=8, progress=False, tune=True)
    att = spec.attention
    print("\nattention section:", att)
    assert att["source"] == "measured" and set(att["classes"]) == set(STEP_CLASSES)
    assert att["skipped"] == {}
    prompt = [s for s in att["stats"].values() if s["class"] == "prompt"]
    assert prompt and all(set(s["us"]) == {"triton", "flash-attn"} for s in prompt)
    assert all(t > 0 for s in att["stats"].values() for t in s["us"].values())
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig())
    assert eng.attention_backend == att["backend"]
    assert eng.attention_classes == (att["classes"] if att["backend"] == "flash-attn" else None)
    got = eng.generate([list(range(100, 1600))], SamplingParams(max_tokens=4, temperature=0,
                                                                ignore_eos=True))
    assert len(got[0].token_ids) == 4
