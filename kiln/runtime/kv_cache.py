"""Paged KV cache: fixed-size blocks, ref counts, prefix caching of full blocks by hash.

``BlockManager`` is pure bookkeeping (block ids, ref counts, hashes); ``KVCache`` owns the
tensors. A request's block table maps its token index ``i`` to slot
``block_table[i // block_size] * block_size + i % block_size``.

Prefix caching (vLLM v1 style): a full block is identified by the hash chain of its tokens
and its parent's hash. Freed blocks keep their hash and stay findable until reused
(least recently freed first), so a repeated prompt skips its cached full blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch


def slot_of(block_table: Sequence[int], index: int, block_size: int) -> int:
    """Cache slot of a request's token ``index`` (the block-table rule above)."""
    return block_table[index // block_size] * block_size + index % block_size


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Hash of one full block given its parent block's hash (None for the first block)."""
    return hash((parent, tuple(tokens)))


class BlockManager:
    """Allocates blocks to requests; owns ref counts and the prefix-cache index.

    Invariants: a block is either referenced (ref > 0) or in ``_free`` (ref == 0), never
    both; ``_hash_to_block`` and ``_block_hash`` mirror each other.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        # Free blocks in eviction order (oldest freed first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._block_hash: dict[int, int] = {}

    # -- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Whether ``block_table`` can grow to hold ``num_tokens`` tokens."""
        return self.blocks_needed(num_tokens) - len(block_table) <= self.num_free_blocks

    # -- prefix cache --------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Longest run of cached full blocks for ``token_ids``; takes a reference on each.

        Returns (block ids, their hashes). At least one token is always left uncomputed so
        the request still produces logits.
        """
        blocks: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return blocks, hashes
        parent = None
        max_blocks = (len(token_ids) - 1) // self.block_size
        for i in range(max_blocks):
            h = block_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self._hash_to_block.get(h)
            if block is None:
                break
            self._take(block)
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def cache_full_blocks(
        self, block_table: list[int], hashes: list[int], token_ids: Sequence[int],
        num_computed: int,
    ) -> None:
        """Register hashes for blocks that became full with computed tokens.

        ``hashes`` is the request's list of hashes of its leading full blocks; it is
        extended in place.
        """
        if not self.enable_prefix_caching:
            return
        num_full = num_computed // self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            h = block_hash(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(h)
            block = block_table[i]
            if h not in self._hash_to_block and block not in self._block_hash:
                self._hash_to_block[h] = block
                self._block_hash[block] = h

    # -- allocation ----------------------------------------------------------------------
    def allocate(self, block_table: list[int], num_tokens: int) -> None:
        """Grow ``block_table`` in place to hold ``num_tokens``; caller checked can_allocate."""
        need = self.blocks_needed(num_tokens) - len(block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(
                f"KV cache out of blocks: need {need}, {self.num_free_blocks} free "
                "(the scheduler should have preempted)"
            )
        for _ in range(need):
            block, _ = self._free.popitem(last=False)  # oldest freed: evict its hash
            h = self._block_hash.pop(block, None)
            if h is not None:
                del self._hash_to_block[h]
            self._ref[block] = 1
            block_table.append(block)

    def free(self, block_table: list[int]) -> None:
        """Drop one reference on every block of the table and clear it.

        Blocks are released tail first, so a request's later blocks are evicted before its
        earlier (more shareable) ones.
        """
        for block in reversed(block_table):
            if self._ref[block] <= 0:
                raise RuntimeError(f"block {block} freed twice (ref count {self._ref[block]})")
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
        block_table.clear()

    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def check_all_free(self) -> None:
        """Raise unless every block is unreferenced (used by tests and on shutdown)."""
        held = [b for b, r in enumerate(self._ref) if r]
        if held or len(self._free) != self.num_blocks:
            raise RuntimeError(
                f"{len(held)} KV blocks still referenced ({held[:8]}...), "
                f"{len(self._free)}/{self.num_blocks} free"
            )


KV_LAYOUTS = ("NHD", "HND")


class KVCache:
    """K and V tensors of every layer: [num_layers, num_blocks, block_size, kv_heads, head_dim].

    ``layout`` is how a block sits in memory: "NHD" (the shape above, contiguous: one token's
    heads side by side) or "HND" (stored [num_layers, num_blocks, kv_heads, block_size,
    head_dim]: one head's tokens of a block side by side, so a decode reads a head's block in
    one run of bytes). ``k`` / ``v`` have the shape above either way (HND as a strided view):
    readers index them, or take their strides, never flatten them.

    With ``dtype=torch.float8_e4m3fn`` the cache stores e4m3(k / k_scale[layer]) and readers
    dequantize with ``.to(dtype) * k_scale[layer]`` (same for v); ``k_scale``/``v_scale`` are
    float32 [num_layers] (calibrated per-tensor scales; 1.0 when there were none).
    """

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
        head_dim: int, dtype: torch.dtype, device: torch.device | str,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
        layout: str = "NHD",
    ):
        if layout not in KV_LAYOUTS:
            raise ValueError(f"KV cache layout {layout!r} must be one of {', '.join(KV_LAYOUTS)}")
        if layout == "NHD":
            shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        else:
            shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device).transpose(2, 3)
            self.v = torch.zeros(shape, dtype=dtype, device=device).transpose(2, 3)
        self.layout = layout
        self.block_size = block_size
        self.is_fp8 = dtype == torch.float8_e4m3fn
        ones = torch.ones(num_layers, dtype=torch.float32)
        self.k_scale = (ones if k_scale is None else k_scale.float().reshape(-1)).to(device)
        self.v_scale = (ones if v_scale is None else v_scale.float().reshape(-1)).to(device)
        if self.k_scale.numel() != num_layers or self.v_scale.numel() != num_layers:
            raise ValueError(
                f"KV scales have {self.k_scale.numel()}/{self.v_scale.numel()} entries; "
                f"need one per layer ({num_layers})"
            )

    def slot_index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each cache slot, for indexing ``k[layer]`` / ``v[layer]``."""
        slots = slots.long()
        return slots // self.block_size, slots % self.block_size

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V of every layer from slots ``src`` to ``dst`` ([n] each, on the device).

        Used to keep accepted speculative tokens: their KV was written at in-step rows and
        belongs at their final token index. Sources are read before any write.
        """
        (sb, so), (db, do) = self.slot_index(src), self.slot_index(dst)
        for cache in (self.k, self.v):
            raw = cache.view(torch.uint8)  # as bytes: torch has no float8 index kernels on CPU
            raw[:, db, do] = raw[:, sb, so]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def fp8_kv_scales(
    weights: dict[str, torch.Tensor], num_layers: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(k_scale, v_scale) [num_layers] float32 when the engine has an FP8 KV cache (its
    weights carry ``layers.{i}.k_scale`` / ``v_scale``), else None."""
    if "layers.0.k_scale" not in weights:
        return None
    k = torch.stack([weights[f"layers.{i}.k_scale"].float().reshape(()) for i in range(num_layers)])
    v = torch.stack([weights[f"layers.{i}.v_scale"].float().reshape(()) for i in range(num_layers)])
    return k, v
