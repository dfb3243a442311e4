"""Triton kernels vs their torch references on CUDA at real shapes. Skipped without CUDA.

Run in its own process (not after tests/unit/test_kernels_*, which switch triton to its
CPU interpreter):  python -m pytest -q tests/gpu/test_kernels_gpu.py
Shapes: llama-3-8b (32 heads, 8 kv heads, head_dim 128, hidden 4096, I 14336) and
smollm2-135m (9 heads, 3 kv heads, head_dim 64, hidden 576, I 1536).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="TRITON_INTERPRET is set in this process; run tests/gpu alone"),
]

SHAPES = {  # heads, kv_heads, head_dim, hidden, intermediate
    "llama-3-8b": (32, 8, 128, 4096, 14336),
    "smollm2": (9, 3, 64, 576, 1536),
}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DEV = "cuda"


def _rel(out, ref):
    from kiln.runtime.kernels.testing import rel_err

    return rel_err(out, ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_elementwise_kernels(shape, dtype):
    from kiln.runtime.kernels import activation, rms_norm, rotary

    heads, kv_heads, dim, hidden, inter = SHAPES[shape]
    t = 333
    x = torch.randn(t, 2 * inter, device=DEV).to(dtype)
    out = torch.full((t, inter), float("nan"), device=DEV, dtype=dtype)
    activation.silu_and_mul(x, out=out)
    assert torch.equal(out, activation.silu_and_mul_ref(x)) or _rel(
        out, activation.silu_and_mul_ref(x)) < TOL[dtype]

    a, r = torch.randn(t, hidden, device=DEV).to(dtype), torch.randn(t, hidden, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    o, res = rms_norm.fused_add_rms_norm(a, r, w, 1e-5)
    ro, rres = rms_norm.fused_add_rms_norm_ref(a, r, w, 1e-5)
    assert torch.equal(res, rres)  # the add rounds exactly like eager
    assert _rel(o, ro) < TOL[dtype]

    inv = 1.0 / (500000 ** (torch.arange(0, dim, 2, device=DEV).float() / dim))
    cache = rotary.build_cos_sin_cache(inv, 8192)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device=DEV).to(dtype)
    q = qkv[:, : heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    rq, rk = rotary.rotary_embedding_ref(q, k, pos, cache)
    rotary.rotary_embedding_(q, k, pos, cache)
    assert _rel(q, rq) < TOL[dtype] and _rel(k, rk) < TOL[dtype]
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_graph_end_norms_equal_the_torch_composition(shape, dtype):
    """embed_rms_norm == F.embedding then rms_norm; gather_add_rms_norm == (x + r)[rows]
    then rms_norm: bit for bit (the same kernel's arithmetic per row), vocab-sized tables."""
    from kiln.runtime.kernels import rms_norm

    hidden = SHAPES[shape][3]
    vocab = 128256 if shape == "llama-3-8b" else 49152
    table = torch.randn(vocab, hidden, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEV)).to(dtype)
    ids = torch.randint(0, vocab, (257,), device=DEV)
    ids[:2] = torch.tensor([0, vocab - 1])
    out, h = rms_norm.embed_rms_norm(ids, table, w, 1e-5)
    rows = torch.nn.functional.embedding(ids, table)
    assert torch.equal(h, rows)
    assert torch.equal(out, rms_norm.rms_norm(rows, w, 1e-5))
    x, r = (torch.randn(300, hidden, device=DEV).to(dtype) for _ in range(2))
    sel = torch.tensor([299, 0, 17, 17], device=DEV)
    full, _ = rms_norm.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(rms_norm.gather_add_rms_norm(x, r, sel, w, 1e-5), full[sel])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_reshape_and_cache(shape, cache_dtype):
    from kiln.runtime.kernels.kv_write import reshape_and_cache, reshape_and_cache_ref

    _, kv_heads, dim, _, _ = SHAPES[shape]
    t, blocks, bs = 300, 64, 16
    k = torch.randn(t, kv_heads, dim, device=DEV, dtype=torch.bfloat16) * 4
    v = torch.randn(t, kv_heads, dim, device=DEV, dtype=torch.bfloat16) * 4
    k[0, 0, :4] = 1e4  # saturates in fp8
    slots = torch.randperm(blocks * bs, device=DEV)[:t]
    slots[5] = -1
    init = torch.randn(blocks, bs, kv_heads, dim, device=DEV).to(cache_dtype)
    kc, vc, rk, rv = init.clone(), init.clone(), init.clone(), init.clone()
    ks = torch.tensor([0.37], device=DEV)
    reshape_and_cache_ref(k, v, rk, rv, slots, ks, 1.9)
    reshape_and_cache(k, v, kc, vc, slots, ks, 1.9)
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rotary_and_cache_equals_rotary_then_kv_write(shape, cache_dtype):
    """The fused rotary + KV write is bit-equal to the two kernels it replaces (whose
    references are checked above): q and k rotated in place, rotated k and v cached."""
    from kiln.runtime.kernels import rotary
    from kiln.runtime.kernels.kv_write import reshape_and_cache

    heads, kv_heads, dim, _, _ = SHAPES[shape]
    t, blocks, bs = 300, 64, 16
    inv = 1.0 / (500000 ** (torch.arange(0, dim, 2, device=DEV).float() / dim))
    cs = rotary.build_cos_sin_cache(inv, 8192)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device=DEV, dtype=torch.bfloat16) * 4
    q = qkv[:, : heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
    slots = torch.randperm(blocks * bs, device=DEV)[:t]
    slots[5] = -1
    init = torch.randn(blocks, bs, kv_heads, dim, device=DEV).to(cache_dtype)
    kc, vc, rkc, rvc = init.clone(), init.clone(), init.clone(), init.clone()
    rq, rk = q.clone(), k.clone()
    ks = torch.tensor([0.37], device=DEV)
    rotary.rotary_embedding_(rq, rk, pos, cs)
    reshape_and_cache(rk, v, rkc, rvc, slots, ks, 1.9)
    rotary.rotary_and_cache_(q, k, v, pos, cs, kc, vc, slots, ks, 1.9)
    assert torch.equal(q, rq) and torch.equal(k, rk)
    assert torch.equal(kc.view(torch.uint8), rkc.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rvc.view(torch.uint8))


def _mixed_specs(q_len_prefill: int, ctx: int) -> list[tuple[int, int, bool]]:
    return [(ctx - 1, 1, False), (ctx // 2 + 7, 1, False), (0, q_len_prefill, False),
            (ctx // 3, q_len_prefill // 2 + 3, False), (ctx - 40, 40, True), (513, 16, True),
            (5, 1, False)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_paged_attention_mixed_batch(shape, dtype, num_splits):
    from kiln.runtime.kernels.paged_attention import paged_attention, paged_attention_ref
    from kiln.runtime.kernels.testing import random_paged_batch

    heads, kv_heads, dim, _, _ = SHAPES[shape]
    b = random_paged_batch(_mixed_specs(300, 1000), heads, kv_heads, dim, 16, dtype, DEV)
    out = torch.full_like(b.q, float("nan"))
    paged_attention(*b.args(), dim**-0.5, max_query_len=b.max_query_len,
                    max_context_len=b.max_context_len, num_splits=num_splits, out=out,
                    **b.kwargs())
    ref = paged_attention_ref(*b.args(), dim**-0.5, **b.kwargs())
    assert _rel(out, ref) < TOL[dtype] * (3 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("shape", SHAPES)
def test_paged_attention_fp8_cache_and_gqa_1(shape):
    from kiln.runtime.kernels.paged_attention import paged_attention, paged_attention_ref
    from kiln.runtime.kernels.testing import random_paged_batch

    heads, kv_heads, dim, _, _ = SHAPES[shape]
    for kvh, cache_dtype in ((kv_heads, torch.float8_e4m3fn), (heads, torch.bfloat16)):
        b = random_paged_batch(_mixed_specs(70, 600), heads, kvh, dim, 16, torch.bfloat16,
                               DEV, cache_dtype=cache_dtype)
        ks, vs = torch.tensor([0.8], device=DEV), torch.tensor([1.3], device=DEV)
        out = paged_attention(*b.args(), dim**-0.5, max_query_len=b.max_query_len,
                              max_context_len=b.max_context_len, k_scale=ks, v_scale=vs,
                              **b.kwargs())
        ref = paged_attention_ref(*b.args(), dim**-0.5, k_scale=ks, v_scale=vs, **b.kwargs())
        assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("batch", [1, 64, 256])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("single_rows", ["known", None])
def test_paged_attention_decodes_beside_prompt_chunks(batch, cache_dtype, single_rows):
    """A serving step: ``batch`` decodes at contexts 100-8000 beside two prompt chunks, at the
    llama-3-8b shape, block size 16 (the engine's); the decode launch and the prompt launch
    together equal the reference (float32 where the kernel takes it, bf16 and FP8 KV within
    the tolerance above)."""
    from kiln.runtime.kernels.paged_attention import paged_attention, paged_attention_ref
    from kiln.runtime.kernels.testing import random_paged_batch

    heads, kv_heads, dim, _, _ = SHAPES["llama-3-8b"]
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    g = torch.Generator().manual_seed(batch)
    ctxs = torch.randint(100, 8001, (batch,), generator=g).tolist()
    specs = [(c - 1, 1, False) for c in ctxs]
    specs[batch // 2 : batch // 2] = [(0, 300, False), (2000, 129, False)]
    b = random_paged_batch(specs, heads, kv_heads, dim, 16, dtype, DEV, cache_dtype=cache_dtype)
    ks, vs = torch.tensor([0.8], device=DEV), torch.tensor([1.3], device=DEV)
    scales = {"k_scale": ks, "v_scale": vs} if cache_dtype == torch.float8_e4m3fn else {}
    out = torch.full_like(b.q, float("nan"))
    paged_attention(*b.args(), dim**-0.5, max_query_len=b.max_query_len,
                    max_context_len=b.max_context_len, out=out, **scales,
                    single_rows=batch if single_rows else None)
    ref = paged_attention_ref(*b.args(), dim**-0.5, **scales)
    assert _rel(out, ref) < TOL[dtype] * (3 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("batch", [1, 64, 256])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("config", [None, {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3,
                                           "tiles_per_split": 2, "bt_ahead": True,
                                           "maxnreg": 128},
                                    {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2,
                                     "tiles_per_split": 2, "maxnreg": 128, "v_asm": False},
                                    {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2,
                                     "tiles_per_split": 2, "v_asm": 2}])
def test_paged_attention_decode_step(batch, cache_dtype, layout, config):
    """A pure decode step (every sequence one query, one launch): ``batch`` sequences at
    contexts 100-8000, llama-3-8b shape, block size 16, either cache layout, the default
    config, a tuner candidate with block ids a tile ahead, the cap without the asm, and FP8 V
    read as 32-bit words (``v_asm`` 2). At
    batch 64 and 256 the launch has one split a program, which runs FP8 caches under the
    register cap; at batch 1 the keys are split."""
    from kiln.runtime.kernels.paged_attention import paged_attention, paged_attention_ref
    from kiln.runtime.kernels.testing import random_paged_batch, with_layout

    heads, kv_heads, dim, _, _ = SHAPES["llama-3-8b"]
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    g = torch.Generator().manual_seed(batch + 1)
    ctxs = torch.randint(100, 8001, (batch,), generator=g).tolist()
    b = random_paged_batch([(c - 1, 1, False) for c in ctxs], heads, kv_heads, dim, 16, dtype,
                           DEV, cache_dtype=cache_dtype)
    kc, vc = with_layout(b.k_cache, layout), with_layout(b.v_cache, layout)
    ks, vs = torch.tensor([0.8], device=DEV), torch.tensor([1.3], device=DEV)
    scales = {"k_scale": ks, "v_scale": vs} if cache_dtype == torch.float8_e4m3fn else {}
    out = torch.full_like(b.q, float("nan"))
    paged_attention(b.q, kc, vc, *b.args()[3:], dim**-0.5, max_query_len=1,
                    max_context_len=b.max_context_len, out=out, config=config, **scales)
    ref = paged_attention_ref(*b.args(), dim**-0.5, **scales)
    assert _rel(out, ref) < TOL[dtype] * (3 if dtype == torch.float32 else 1)


def test_paged_attention_cuda_graph():
    """Capturable (no host syncs): replay after changing the inputs in place."""
    from kiln.runtime.kernels.paged_attention import paged_attention, paged_attention_ref
    from kiln.runtime.kernels.testing import random_paged_batch

    b = random_paged_batch([(900, 1, False)] * 4 + [(300, 8, True)], 32, 8, 128, 16,
                           torch.bfloat16, DEV)

    def run():
        return paged_attention(*b.args(), 128**-0.5, max_query_len=8, max_context_len=901,
                               num_splits=4, **b.kwargs())

    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    b.q.copy_(torch.randn_like(b.q))
    b.context_lens[:4] -= torch.tensor([0, 100, 200, 300], device=DEV, dtype=torch.int32)
    g.replay()
    ref = paged_attention_ref(*b.args(), 128**-0.5, **b.kwargs())
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_triton_backend_matches_torch_backend(dtype, layout):
    """KV write + attention through the Triton backend over a cache of either layout, against
    the torch backend over an NHD cache (FP8: bf16 q and new K/V into an e4m3 cache)."""
    from kiln.runtime.kernels.testing import tree_mask
    from kiln.runtime.kv_cache import KVCache
    from kiln.runtime.layers.attention import AttentionMetadata, SeqAttention
    from kiln.runtime.layers.attention_registry import get_backend

    heads, kv_heads, dim, bs, nb = 32, 8, 128, 16, 256
    specs = [(700, 1, False), (0, 200, False), (300, 30, True), (33, 1, False)]
    cache_dtype, dtype = dtype, (torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype)
    caches = [KVCache(2, nb, bs, kv_heads, dim, cache_dtype, DEV, layout=lay)
              for lay in ("NHD", layout)]
    init = torch.randn(caches[0].k.shape, device=DEV).to(cache_dtype)
    for c in caches:
        c.k.copy_(init)
        c.v.copy_(init.flip(0))
    perm = torch.randperm(nb).tolist()
    seqs, slots, t0 = [], [], 0
    for p, n, masked in specs:
        need = -(-(p + n) // bs)
        table, perm = torch.tensor(perm[:need]), perm[need:]
        idx = torch.arange(p + n)
        key_slots = (table[idx // bs] * bs + idx % bs).to(DEV)
        slots.append(key_slots[p:])
        seqs.append(SeqAttention(t0, n, p + n, key_slots,
                                 tree_mask(n).to(DEV) if masked else None))
        t0 += n
    meta = AttentionMetadata(torch.cat(slots), seqs)
    q = torch.randn(t0, heads, dim, device=DEV).to(dtype)
    k = torch.randn(t0, kv_heads, dim, device=DEV).to(dtype)
    v = torch.randn(t0, kv_heads, dim, device=DEV).to(dtype)
    ref = get_backend("torch").forward(1, q, k, v, caches[0], meta, dim**-0.5)
    out = get_backend("triton").forward(1, q, k, v, caches[1], meta, dim**-0.5)
    raw = torch.uint8 if cache_dtype == torch.float8_e4m3fn else cache_dtype
    assert torch.equal(caches[1].k.view(raw), caches[0].k.view(raw))
    assert torch.equal(caches[1].v.view(raw), caches[0].v.view(raw))
    assert _rel(out, ref) < TOL[dtype] * (3 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("vocab", [128256, 49152])
@pytest.mark.parametrize("rows", [1, 256])
def test_sampling_greedy_equals_argmax_at_real_vocabularies(vocab, rows):
    from kiln.runtime.kernels import sampling

    x = torch.randn(rows, vocab, device=DEV) * 4
    x[0, vocab - 1] = x[0, 17] = x[0].max() + 1  # a tie far apart: the first wins
    assert torch.equal(sampling.sample_tokens(x, 0.0, seed=1), x.argmax(-1))
    assert int(sampling.sample_tokens(x, 0.0, seed=1)[0]) == 17
    inv = torch.zeros(rows, device=DEV)
    assert torch.equal(sampling.sample_tokens(x, inv, seed=5), x.argmax(-1))


@pytest.mark.parametrize("vocab", [128256, 49152])
def test_sampling_rows_that_are_not_finite_give_invalid_token(vocab):
    """NaN or +inf logits, or a row with every token masked: -1 (the sampler's
    INVALID_TOKEN, the engine fails that request), greedy and sampled alike; a finite row
    beside them is sampled as usual."""
    from kiln.runtime.kernels import sampling

    x = torch.randn(6, vocab, device=DEV)
    x[0] = float("nan")
    x[1, vocab - 5:] = float("nan")
    x[2] = float("-inf")
    x[2, vocab - 1] = float("nan")
    x[3, 4097] = float("inf")
    x[4] = float("-inf")
    x[5, :100] = float("-inf")
    greedy = sampling.sample_tokens(x, 0.0, seed=2).tolist()
    assert greedy == [-1] * 5 + [int(x[5].argmax())]
    tok = sampling.sample_tokens(x, 1.0, seed=2).tolist()
    assert tok[:5] == [-1] * 5 and 100 <= tok[5] < vocab


def test_sampling_frequencies_match_softmax_on_cuda():
    """200000 draws (one row each) of a 6-token distribution padded with -inf to 4096
    tokens (two programs per row): frequencies within 4.5 standard errors of softmax, masked
    tokens never drawn; the Sampler's exponential race (torch) on the same rows agrees."""
    from kiln.runtime.kernels import sampling
    from kiln.runtime.layers.sampler import race

    rows, inv_t = 200_000, 0.7
    logits = torch.full((4096,), float("-inf"), device=DEV)
    logits[[3, 700, 2047, 2048, 4095, 9]] = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, 1.5],
                                                          device=DEV)
    x = logits.expand(rows, -1).contiguous()
    p = torch.softmax(logits.double() * inv_t, -1)
    se = (p * (1 - p) / rows).sqrt()
    for out in (sampling.sample_tokens(x, inv_t, seed=11),
                race(torch.softmax(x * inv_t, -1))):
        freq = torch.bincount(out, minlength=4096).double() / rows
        assert ((freq - p).abs() <= 4.5 * se + 1e-12).all()


def test_sampling_rows_past_int32_offsets():
    """17000 rows of a 128256 vocabulary: 2.2e9 logits, past int32 element offsets."""
    from kiln.runtime.kernels import sampling

    x = torch.randn(17000, 128256, device=DEV)
    assert torch.equal(sampling.sample_tokens(x, 0.0, seed=3), x.argmax(-1))
    tok = sampling.sample_tokens(x, 1.0, seed=3)
    assert ((0 <= tok) & (tok < 128256)).all()
    del x
    torch.cuda.empty_cache()


def test_sampler_choose_on_cuda_uses_the_kernels_only_where_they_apply(monkeypatch):
    """Sampler.choose on CUDA: greedy and temperature rows go through the sampling kernels
    (greedy rows == argmax, temperature rows follow softmax(logits / T)); a batch with a
    top-k row takes the torch path, and its top-k row stays inside its top k."""
    from kiln.runtime.kernels import sampling
    from kiln.runtime.layers.sampler import Sampler
    from kiln.runtime.sampling_params import SamplingParams

    calls = []
    real = sampling.sample_tokens
    monkeypatch.setattr(sampling, "sample_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    rows, t = 60_000, 0.5
    base = torch.full((49152,), float("-inf"), device=DEV)
    base[[5, 6, 7, 40000]] = torch.tensor([1.0, 0.5, 0.0, 0.8], device=DEV)
    x = base.expand(rows, -1).contiguous()
    params = [SamplingParams(temperature=0)] + [SamplingParams(temperature=t)] * (rows - 1)
    tok = Sampler().choose(x, params, [None] * rows)
    assert calls and int(tok[0]) == 5
    freq = torch.bincount(tok[1:], minlength=49152).double() / (rows - 1)
    p = torch.softmax(base.double() / t, -1)
    assert ((freq - p).abs() <= 4.5 * (p * (1 - p) / (rows - 1)).sqrt() + 1e-12).all()
    calls.clear()
    tok = Sampler().choose(x[:2], [SamplingParams(temperature=0),
                                   SamplingParams(temperature=1.0, top_k=2)], [None, None])
    assert not calls and int(tok[0]) == 5 and int(tok[1]) in (5, 40000)
