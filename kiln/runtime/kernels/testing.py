"""Random inputs for kernel tests and benchmarks (shared by CPU, GPU tests and the bench)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    """Inputs of one ``paged_attention`` call over a random paged cache."""

    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    mask: torch.Tensor | None  # packed uint8 tree masks
    mask_offsets: torch.Tensor | None  # [num_seqs] int32, -1 = causal
    max_query_len: int
    max_context_len: int

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.context_lens)

    def kwargs(self) -> dict:
        return {"mask": self.mask, "mask_offsets": self.mask_offsets}


def with_layout(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """A paged cache [num_blocks, block_size, KVH, D] with the same values, stored in
    ``layout`` (``KVCache``'s "NHD", or "HND": [num_blocks, KVH, block_size, D] in memory,
    seen through the same shape)."""
    if layout == "NHD":
        return cache.contiguous()
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def tree_mask(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random [n, n] bool tree mask: each query sees itself and random earlier queries."""
    m = torch.rand(n, n, generator=generator) < 0.5
    return m.tril() | torch.eye(n, dtype=torch.bool)


def random_paged_batch(
    specs: list[tuple[int, int, bool]], heads: int, kv_heads: int, dim: int, block_size: int,
    dtype: torch.dtype, device: torch.device | str = "cpu",
    cache_dtype: torch.dtype | None = None, spare_blocks: int = 3, layout: str = "NHD",
) -> PagedBatch:
    """specs: one (cached prefix length, query_len, tree-masked?) per sequence.

    The whole cache is random (never zeros) and each sequence gets shuffled block ids; it is
    stored in ``layout`` (``with_layout``).
    """
    cache_dtype = cache_dtype or dtype
    nbs = [-(-(p + n) // block_size) for p, n, _ in specs]
    num_blocks = sum(nbs) + spare_blocks
    perm = torch.randperm(num_blocks)
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, device=device).to(cache_dtype)
    v_cache = torch.randn(shape, device=device).to(cache_dtype)
    tables = torch.randint(0, num_blocks, (len(specs), max(nbs) + 1), dtype=torch.int32)
    qsl, ctx, masks, offs, used, packed = [0], [], [], [], 0, 0
    for s, ((p, n, masked), nb) in enumerate(zip(specs, nbs)):
        tables[s, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
        qsl.append(qsl[-1] + n)
        ctx.append(p + n)
        if masked:
            offs.append(packed)
            masks.append(tree_mask(n).reshape(-1))
            packed += n * n
        else:
            offs.append(-1)

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=device)

    return PagedBatch(
        q=torch.randn(qsl[-1], heads, dim, device=device).to(dtype),
        k_cache=with_layout(k_cache, layout), v_cache=with_layout(v_cache, layout),
        block_tables=tables.to(device),
        query_start_loc=i32(qsl), context_lens=i32(ctx),
        mask=torch.cat(masks).to(device=device, dtype=torch.uint8) if masks else None,
        mask_offsets=i32(offs) if masks else None,
        max_query_len=max(n for _, n, _ in specs), max_context_len=max(ctx),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; fails on non-finite output (unwritten poison)."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        raise AssertionError("non-finite output (unwritten poison or overflow)")
    return ((out - ref).norm() / ref.norm()).item()
