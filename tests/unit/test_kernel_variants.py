"""What a kernel launch may vary without compiling a new variant mid-serving.

Triton compiles one variant per set of compile-time constants and per specialisation of its
integer arguments (== 1, divisible by 16). A value that follows the traffic (a prompt's
length, the batch's sequence count, a fresh sampling seed) must not be either: each new
variant stalls the engine thread 0.5-1.9 s while every request waits (docs/decisions.md).
These tests record the launches instead of running them.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (kernels are built on import)

import pytest
import torch

pytest.importorskip("triton")

from kiln.runtime.kernels import paged_attention as pa
from kiln.runtime.kernels import sampling


class Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kwargs)`` records the
    compile-time keyword arguments (the constexprs and launch options)."""

    def __init__(self):
        self.constexprs: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.constexprs.append(tuple(sorted((k, v) for k, v in kwargs.items()
                                                if k != "launch_pdl")))
        return launch


def _unspecialised(kernel) -> set[str]:
    """The argument names ``@triton.jit(do_not_specialize=...)`` lists (compiled kernels keep
    them on their params; the CPU interpreter keeps the decorator's keywords)."""
    params = getattr(kernel, "params", None)
    if params is not None:
        return {p.name for p in params if p.do_not_specialize}
    names = (getattr(kernel, "kwargs", None) or {}).get("do_not_specialize") or ()
    return {n if isinstance(n, str) else kernel.arg_names[n] for n in names}


def _eager_prefill(monkeypatch, length: int, num_seqs: int = 1) -> tuple[tuple, tuple]:
    """The constexprs of one eager attention launch: num_seqs prompts of ``length`` tokens."""
    attn, red = Recorder(), Recorder()
    monkeypatch.setattr(pa, "_paged_attn_kernel", attn)
    monkeypatch.setattr(pa, "_reduce_kernel", red)
    heads, kv_heads, dim, block = 9, 3, 64, 16
    t = length * num_seqs
    blocks = -(-length // block)
    q = torch.zeros(t, heads, dim, dtype=torch.bfloat16)
    cache = torch.zeros(blocks * num_seqs + 1, block, kv_heads, dim, dtype=torch.bfloat16)
    tables = torch.arange(blocks * num_seqs, dtype=torch.int32).view(num_seqs, blocks)
    qsl = torch.arange(0, t + 1, length, dtype=torch.int32)
    ctx = torch.full((num_seqs,), length, dtype=torch.int32)
    pa.paged_attention(q, cache, cache, tables, qsl, ctx, dim ** -0.5,
                       max_query_len=length, max_context_len=length,
                       single_rows=0)  # an eager step of prompts only: one launch
    return attn.constexprs[0], (red.constexprs[0] if red.constexprs else ())


def test_eager_prefills_of_any_length_share_one_attention_variant(monkeypatch):
    # Before: NUM_SPLITS was a constexpr, so these lengths (2, 4, 7 and 8 splits) each
    # compiled their own attention and reduce variants.
    seen = {n: _eager_prefill(monkeypatch, n) for n in (255, 500, 777, 1000, 1500)}
    attn = {a for a, _ in seen.values()}
    reduce = {r for _, r in seen.values()}
    assert len(attn) == 1, f"attention variants by length: {seen}"
    assert len(reduce) == 1, f"reduce variants by length: {seen}"
    assert dict(next(iter(attn)))["MULTI"] is True


def test_sequence_and_split_counts_are_never_specialised():
    assert {"num_seqs", "num_splits"} <= _unspecialised(pa._paged_attn_kernel)
    assert "num_splits" in _unspecialised(pa._reduce_kernel)
    assert "seed" in _unspecialised(sampling._sample_partial_kernel)


def test_batches_of_prompts_differ_only_in_whether_keys_split(monkeypatch):
    # a big batch fills the GPU without key-splits (MULTI False), a small one splits: two
    # variants for any sequence count, never one per count
    seen = {n: dict(_eager_prefill(monkeypatch, 300, num_seqs=n)[0])
            for n in (1, 2, 3, 16, 17, 64)}
    by_multi = {}
    for c in seen.values():
        by_multi.setdefault(c["MULTI"], []).append(c)
    assert set(by_multi) == {True, False}, seen
    for group in by_multi.values():
        assert all(c == group[0] for c in group), seen


@pytest.mark.parametrize("splits,width", [(2, 16), (16, 16), (17, 32), (33, 64), (64, 64)])
def test_reduce_width_has_three_values(splits, width):
    assert pa.reduce_width(splits) == width
