"""Paged attention kernel and TritonAttention backend vs the torch reference (CPU interpreter)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.kernels.paged_attention import (
    choose_num_splits,
    paged_attention,
    paged_attention_ref,
)
from kiln.runtime.kernels.testing import random_paged_batch, rel_err, tree_mask
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.layers.attention import AttentionMetadata, SeqAttention, TorchAttention
from kiln.runtime.layers.attention_registry import get_backend

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def make_batch(specs, heads, kv_heads, dim, block_size, dtype, cache_dtype=None):
    b = random_paged_batch(specs, heads, kv_heads, dim, block_size, dtype,
                           cache_dtype=cache_dtype)
    return (*b.args(), b.mask, b.mask_offsets)


MIXED = [(13, 1, False), (0, 7, False), (5, 6, True), (9, 1, False), (3, 4, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2), (4, 1)])  # GQA ratios 1, 3, 4
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_mixed_batch(dtype, heads, kv_heads, num_splits):
    q, kc, vc, bt, qsl, ctx, mask, offs = make_batch(MIXED, heads, kv_heads, 16, 4, dtype)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, bt, qsl, ctx, 0.25, max_query_len=7, max_context_len=13,
                    mask=mask, mask_offsets=offs, num_splits=num_splits, out=out)
    ref = paged_attention_ref(q, kc, vc, bt, qsl, ctx, 0.25, mask=mask, mask_offsets=offs)
    assert rel_err(out, ref) < TOL[dtype]


def test_paged_attention_long_prefill_and_block_size_6():
    # 70 queries spans several BLOCK_M=64-row tiles; lengths are not multiples of 6
    specs = [(11, 70, False), (40, 1, False), (0, 3, True)]
    q, kc, vc, bt, qsl, ctx, mask, offs = make_batch(specs, 3, 3, 32, 6, torch.float32)
    out = paged_attention(q, kc, vc, bt, qsl, ctx, 0.2, max_query_len=70, max_context_len=81,
                          mask=mask, mask_offsets=offs)
    ref = paged_attention_ref(q, kc, vc, bt, qsl, ctx, 0.2, mask=mask, mask_offsets=offs)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("num_splits", [None, 3])
def test_paged_attention_splits_over_long_context(num_splits):
    # contexts of several 64-key tiles, so several splits hold keys and one holds the
    # prefix/in-step boundary; the tree-masked sequence starts its step mid-tile
    specs = [(150, 1, False), (130, 5, True), (70, 2, False)]
    q, kc, vc, bt, qsl, ctx, mask, offs = make_batch(specs, 4, 2, 16, 16, torch.float32)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, bt, qsl, ctx, 0.25, max_query_len=5, max_context_len=151,
                    mask=mask, mask_offsets=offs, num_splits=num_splits, out=out)
    ref = paged_attention_ref(q, kc, vc, bt, qsl, ctx, 0.25, mask=mask, mask_offsets=offs)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_paged_attention_empty_splits_read_no_stale_partials(monkeypatch):
    """A graph's split count is fixed for the longest context: shorter ones leave splits
    without keys (8 splits, contexts of 1-2 key tiles). Those programs only mark their
    partial empty and the reduce reads no accumulator for them: with the split workspace
    poisoned with NaN the result still equals the reference."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan"))
                        if k.get("dtype") == torch.float32 else empty(*a, **k))
    specs = [(70, 1, False), (3, 1, False), (40, 4, True)]
    q, kc, vc, bt, qsl, ctx, mask, offs = make_batch(specs, 4, 2, 16, 16, torch.float32)
    out = torch.zeros_like(q)
    paged_attention(q, kc, vc, bt, qsl, ctx, 0.25, max_query_len=4, max_context_len=71,
                    mask=mask, mask_offsets=offs, num_splits=8, out=out)  # 8 x 64 keys
    ref = paged_attention_ref(q, kc, vc, bt, qsl, ctx, 0.25, mask=mask, mask_offsets=offs)
    assert rel_err(out, ref) < TOL[torch.float32]


# decode launches (max_query_len 1) as CUDA graphs stage them; max_query_len is a launch hint,
# not a bound (cuda_graph.find_bucket replays short prefills in decode buckets)
DECODE_LAYOUTS = {
    # empty sequences, and the last (padding) one taking the leftover tokens: two tiles
    "padding": ([(70, 1, False), (5, 0, False), (3, 1, False), (9, 0, False),
                 (0, 11, False)], 4, 2, 71),
    # a prefill before the last sequence with more queries than one tile (BLOCK_Q 5 at GQA
    # 3); a launch that trusted the hint made the real smollm2 emit only token 0 (2026-11-30)
    "short-prefill": ([(0, 11, False), (20, 1, False), (9, 7, False), (0, 0, False)], 9, 3, 21),
}


@pytest.mark.parametrize("layout", DECODE_LAYOUTS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_attention_decode_launch_writes_every_row(layout, num_splits):
    """With max_query_len 1 every row of every sequence is written and equals the reference."""
    specs, heads, kv_heads, max_ctx = DECODE_LAYOUTS[layout]
    q, kc, vc, bt, qsl, ctx, _, _ = make_batch(specs, heads, kv_heads, 16, 16, torch.float32)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, bt, qsl, ctx, 0.25, max_query_len=1, max_context_len=max_ctx,
                    num_splits=num_splits, out=out)
    ref = paged_attention_ref(q, kc, vc, bt, qsl, ctx, 0.25)
    assert rel_err(out, ref) < TOL[torch.float32]


# Unmasked steps of prompt chunks beside decodes run two launches (decodes in decode tiles,
# one program per sequence; the rest in prompt tiles), as a busy server's steps do.
PROMPT_AND_DECODES = {
    # decodes before, between and after prompt chunks; an empty sequence; a chunk of more
    # queries than one 64-row tile holds
    "interleaved": [(40, 1, False), (0, 9, False), (70, 1, False), (0, 0, False),
                    (20, 70, False), (3, 1, False)],
    # a prefill graph bucket's layout: empty sequences, then the padding sequence
    "padding": [(33, 1, False), (0, 5, False), (9, 1, False), (0, 0, False), (0, 0, False),
                (0, 12, False)],
}


@pytest.mark.parametrize("layout", PROMPT_AND_DECODES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("single_rows", [None, "exact"])
def test_paged_attention_prompt_chunks_beside_decodes(layout, num_splits, single_rows,
                                                      monkeypatch):
    """Every row of both launches is written (output and split workspace poisoned with NaN)
    and equals the reference, with the decode count known (eager steps) or not (graphs)."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan"))
                        if k.get("dtype") == torch.float32 else empty(*a, **k))
    specs = PROMPT_AND_DECODES[layout]
    q, kc, vc, bt, qsl, ctx, _, _ = make_batch(specs, 8, 2, 16, 16, torch.float32)
    out = torch.full_like(q, float("nan"))
    singles = sum(1 for _, n, _ in specs if n == 1) if single_rows else None
    paged_attention(q, kc, vc, bt, qsl, ctx, 0.25, max_query_len=max(n for _, n, _ in specs),
                    max_context_len=max(p + n for p, n, _ in specs), num_splits=num_splits,
                    out=out, single_rows=singles)
    ref = paged_attention_ref(q, kc, vc, bt, qsl, ctx, 0.25)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_paged_attention_mixed_step_launches_decodes_in_decode_tiles(monkeypatch):
    """Two launches for prompt chunks beside decodes, one when the host knows there is no
    decode (single_rows 0), one for a masked step (tree steps keep their own class)."""
    from kiln.runtime.kernels import paged_attention as pa

    calls = []
    real = pa._launch
    monkeypatch.setattr(pa, "_launch", lambda *a: calls.append((a[12], a[-1])) or real(*a))
    specs = [(40, 1, False), (0, 9, False), (7, 1, False)]
    q, kc, vc, bt, qsl, ctx, _, _ = make_batch(specs, 4, 2, 16, 16, torch.float32)
    paged_attention(q, kc, vc, bt, qsl, ctx, 0.25, max_query_len=9, max_context_len=41)
    assert calls == [(1, pa.ROWS_SINGLE), (9, pa.ROWS_MULTI)]
    calls.clear()
    specs = [(0, 9, False), (5, 3, False)]
    q, kc, vc, bt, qsl, ctx, _, _ = make_batch(specs, 4, 2, 16, 16, torch.float32)
    paged_attention(q, kc, vc, bt, qsl, ctx, 0.25, max_query_len=9, max_context_len=9,
                    single_rows=0)
    assert calls == [(9, pa.ROWS_ALL)]
    calls.clear()
    q, kc, vc, bt, qsl, ctx, mask, offs = make_batch(MIXED, 4, 2, 16, 4, torch.float32)
    paged_attention(q, kc, vc, bt, qsl, ctx, 0.25, max_query_len=7, max_context_len=13,
                    mask=mask, mask_offsets=offs)
    assert calls == [(7, pa.ROWS_ALL)]


def test_choose_num_splits():
    assert choose_num_splits(8, 2048, 132, 64) == 16  # batch-1 decode: split the keys
    assert choose_num_splits(8, 100, 132, 64) == 1  # short context: nothing to split
    assert choose_num_splits(512, 2048, 132, 64) == 1  # enough programs already


def test_fp8_v_conversion_form():
    """How FP8 V reaches the PV dot (V_ASM): as 32-bit words where a config asks (v_asm 2), the
    head is not padded and the query is not float32 (3: the interpreter's form, without PTX);
    inline PTX under a register cap on the GPU; else ``.to``."""
    from kiln.runtime.kernels.paged_attention import _v_form

    # (asked, kv_fp8, on_gpu, f16_q, capped, words_ok)
    assert _v_form(2, True, True, True, False, True) == 2
    assert _v_form(2, True, True, True, True, True) == 2
    assert _v_form(2, True, False, True, False, True) == 3  # the interpreter
    assert _v_form(2, True, True, True, True, False) == 1  # a padded head: no word loads
    assert _v_form(2, True, True, True, False, False) == 0
    assert _v_form(True, True, True, True, True, True) == 1
    assert _v_form(False, True, True, True, True, True) == 0
    assert _v_form(True, True, True, True, False, True) == 0  # split launches are not capped
    assert _v_form(True, True, False, True, True, True) == 0  # no PTX in the interpreter
    assert _v_form(2, True, True, False, True, True) == 0  # float32 q
    assert _v_form(2, False, True, True, True, True) == 0  # a bf16 cache


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_fp8_v_as_words_equals_the_byte_loads(layout, num_splits):
    """FP8 V read as 32-bit words (config ``v_asm`` 2; the interpreter converts them without
    PTX) gives the same output, bit for bit, as V loaded by bytes: decodes and a prompt chunk,
    bf16 queries, either layout, with and without splits."""
    from kiln.runtime.kernels.testing import with_layout

    torch.manual_seed(3)
    b = random_paged_batch([(150, 1, False), (37, 1, False), (0, 9, False), (99, 1, False)],
                           4, 2, 16, 4, torch.bfloat16, cache_dtype=torch.float8_e4m3fn)
    kc, vc = with_layout(b.k_cache, layout), with_layout(b.v_cache, layout)
    scales = {"k_scale": torch.tensor([0.7]), "v_scale": torch.tensor([1.3])}
    cfg = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "tiles_per_split": 1}
    outs = [paged_attention(b.q, kc, vc, *b.args()[3:], 16**-0.5, max_query_len=9,
                            max_context_len=b.max_context_len, num_splits=num_splits,
                            config=dict(cfg, **extra), **scales)
            for extra in ({}, {"v_asm": 2})]
    assert torch.equal(outs[0], outs[1])
    ref = paged_attention_ref(*b.args(), 16**-0.5, **scales)
    assert (outs[1].float() - ref.float()).abs().max() < 3e-2


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("specs", [
    [(150, 1, False), (130, 5, True), (70, 2, False), (0, 9, False), (33, 1, False)],
    [(150, 1, False), (37, 1, False), (99, 1, False)],  # a decode step: one launch
])
def test_block_ids_a_tile_ahead_change_no_value(cache_dtype, num_splits, specs):
    """``bt_ahead`` (each tile's block ids loaded one iteration ahead) over contexts of many
    16-key tiles, across splits and the prefix / in-step boundary, causal and tree-masked:
    the same values as the plain loop, bit for bit, and as the reference. (In a mixed step
    the config is the prompt launch's.)"""
    q, kc, vc, bt, qsl, ctx, mask, offs = make_batch(specs, 4, 2, 16, 4, torch.float32,
                                                     cache_dtype)
    scales = {"k_scale": 0.5, "v_scale": 2.0} if cache_dtype != torch.float32 else {}
    plain = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 3, "tiles_per_split": 1}
    max_q, max_ctx = max(n for _, n, _ in specs), max(p + n for p, n, _ in specs)
    outs = [paged_attention(q, kc, vc, bt, qsl, ctx, 0.25, max_query_len=max_q,
                            max_context_len=max_ctx, mask=mask, mask_offsets=offs,
                            num_splits=num_splits, config=cfg, **scales)
            for cfg in (plain, dict(plain, bt_ahead=True))]
    ref = paged_attention_ref(q, kc, vc, bt, qsl, ctx, 0.25, mask=mask, mask_offsets=offs,
                              **scales)
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("specs", [[(7, 2, False), (0, 3, False)], [(7, 1, False), (30, 1, False)]])
def test_paged_attention_fp8_cache(dtype, specs):
    """bf16 q dots FP8 K/V in float16 with the scales folded into q and the output; float32
    q stays float32. Prompt rows and decode rows, against the float32 reference."""
    q, kc, vc, bt, qsl, ctx, _, _ = make_batch(specs, 4, 2, 16, 4, dtype, torch.float8_e4m3fn)
    max_q, max_ctx = max(n for _, n, _ in specs), max(p + n for p, n, _ in specs)
    out = paged_attention(q, kc, vc, bt, qsl, ctx, 0.25, max_query_len=max_q,
                          max_context_len=max_ctx, k_scale=0.5, v_scale=2.0)
    ref = paged_attention_ref(q, kc, vc, bt, qsl, ctx, 0.25, k_scale=0.5, v_scale=2.0)
    assert rel_err(out, ref) < TOL[dtype]


def test_paged_attention_validates():
    q, kc, vc, bt, qsl, ctx, _, _ = make_batch([(3, 2, False)], 4, 3, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_attention(q, kc, vc, bt, qsl, ctx, 1.0, max_query_len=2, max_context_len=5)
    q, kc, vc, bt, qsl, ctx, _, _ = make_batch([(3, 2, False)], 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="block_tables has dtype"):
        paged_attention(q, kc, vc, bt.long(), qsl, ctx, 1.0, max_query_len=2,
                        max_context_len=5)
    with pytest.raises(ValueError, match="mask and mask_offsets"):
        paged_attention(q, kc, vc, bt, qsl, ctx, 1.0, max_query_len=2, max_context_len=5,
                        mask=torch.ones(4, dtype=torch.bool))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn),
])
def test_triton_backend_matches_torch_backend(dtype, cache_dtype, layout):
    """Whole backend (KV write + attention) on AttentionMetadata, as the model runner builds it,
    over a cache of either layout against the torch backend over an NHD cache."""
    heads, kv_heads, dim, bs, layers = 6, 2, 16, 4, 2
    specs = [(9, 1, False), (0, 6, False), (5, 5, True), (2, 3, False)]
    scales = {}
    if cache_dtype == torch.float8_e4m3fn:
        # powers of two, and new K/V below that are e4m3 values times the scale: x / scale is
        # exact, so the interpreter's e4m3 rounding bug (see the kv_write test) cannot show
        scales = {"k_scale": torch.tensor([1.0, 0.5]), "v_scale": torch.tensor([1.0, 2.0])}
    caches = [KVCache(layers, 24, bs, kv_heads, dim, cache_dtype, "cpu", **scales, layout=lay)
              for lay in ("NHD", layout)]
    init_k = torch.randn(caches[0].k.shape).to(cache_dtype)
    init_v = torch.randn(caches[0].v.shape).to(cache_dtype)
    for c in caches:
        c.k.copy_(init_k)
        c.v.copy_(init_v)
    perm = torch.randperm(24).tolist()
    seqs, slots, t0 = [], [], 0
    for p, n, masked in specs:
        nb = -(-(p + n) // bs)
        table, perm = perm[:nb], perm[nb:]
        key_slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(p + n)])
        slots.append(key_slots[p:])
        seqs.append(SeqAttention(t0, n, p + n, key_slots, tree_mask(n) if masked else None))
        t0 += n
    meta = AttentionMetadata(torch.cat(slots), seqs)
    q = torch.randn(t0, heads, dim).to(dtype)
    k, v = torch.randn(t0, kv_heads, dim).to(dtype), torch.randn(t0, kv_heads, dim).to(dtype)
    if scales:
        k = k.to(cache_dtype).to(dtype) * scales["k_scale"][1]
        v = v.to(cache_dtype).to(dtype) * scales["v_scale"][1]
    ref = TorchAttention().forward(1, q, k, v, caches[0], meta, 0.3)
    backend = get_backend("triton")
    out = backend.forward(1, q, k, v, caches[1], meta, 0.3)
    assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(caches[1].k.view(torch.uint8), caches[0].k.view(torch.uint8))
    assert torch.equal(caches[1].v.view(torch.uint8), caches[0].v.view(torch.uint8))
    assert backend.device_metadata(meta, caches[1], q.device) is backend._dev  # reused


def test_backends_are_chosen_by_name_and_an_unknown_one_lists_the_valid_ones():
    assert isinstance(get_backend("torch"), TorchAttention)
    assert get_backend("triton").name == "triton"
    with pytest.raises(ValueError, match=r"'flash' is unknown; choose one of "
                                         r"\['flash-attn', 'torch', 'triton'\]"):
        get_backend("flash")
