"""Triton attention backend: paged-cache KV write + paged attention kernels (CUDA).

Named ``"triton"`` in attention_registry.py; the torch backend stays the default. Triton is
imported on first use, so kiln imports without it. Per step it turns the model runner's
``AttentionMetadata`` into device tensors once (``TritonAttentionMetadata``, reused by every
layer of that forward) and launches two kernels per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.runtime.kv_cache import KVCache
from kiln.runtime.layers.attention import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """Device-side view of one step's ``AttentionMetadata`` (shared by all layers)."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int
    max_context_len: int
    mask: torch.Tensor | None = None  # packed [sum query_len²] uint8 tree masks
    mask_offsets: torch.Tensor | None = None  # [num_seqs] int32, -1 = causal
    # Set by kiln/runtime/staging.py, which passes this metadata straight to the model:
    slot_mapping: torch.Tensor | None = None  # [num_tokens] cache slot per token, -1 = skip
    # None: paged_attention picks the key-split count from the bounds; the start-up warm-up
    # (kiln/runtime/warmup.py) forces counts to compile each variant
    num_splits: int | None = None
    # how many sequences have one query (a mixed step's decodes), when the host knows; None
    # (CUDA graphs: any batch of the bucket) lets paged_attention split a step with several
    # queries somewhere into a decode launch and a prompt launch whatever it holds
    single_rows: int | None = None

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int,
              device: torch.device) -> TritonAttentionMetadata:
        """Pack ``meta``; sequences must tile the token batch in order (as the runner does)."""
        qsl = [0]
        ctx: list[int] = []
        tables: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        offsets: list[int] = []
        packed = 0
        for i, s in enumerate(meta.seqs):
            if s.query_start != qsl[-1] or s.query_len < 1 or s.context_len < s.query_len:
                raise ValueError(
                    f"sequence {i}: query_start {s.query_start}, query_len {s.query_len}, "
                    f"context_len {s.context_len}; the triton backend needs sequences that "
                    f"tile the batch in order (query_start == {qsl[-1]}), query_len >= 1 "
                    "and context_len >= query_len"
                )
            qsl.append(s.query_start + s.query_len)
            ctx.append(s.context_len)
            table = getattr(s, "block_table", None)
            if table is None:  # key slot of token i*block_size is block i's first slot
                table = s.key_slots[::block_size] // block_size
            tables.append(table.to(device=device, dtype=torch.int32))
            if s.step_mask is not None:
                if tuple(s.step_mask.shape) != (s.query_len, s.query_len):
                    raise ValueError(
                        f"sequence {i}: step_mask shape {tuple(s.step_mask.shape)} must be "
                        f"[query_len, query_len] = [{s.query_len}, {s.query_len}]"
                    )
                masks.append(s.step_mask.to(device=device, dtype=torch.uint8).reshape(-1))
                offsets.append(packed)
                packed += s.query_len * s.query_len
            else:
                offsets.append(-1)
        if not meta.seqs:
            raise ValueError("AttentionMetadata has no sequences")

        def ints(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int32).to(device, non_blocking=True)

        return cls(
            block_tables=torch.nn.utils.rnn.pad_sequence(tables, batch_first=True),
            query_start_loc=ints(qsl), context_lens=ints(ctx),
            max_query_len=max(s.query_len for s in meta.seqs), max_context_len=max(ctx),
            mask=torch.cat(masks) if masks else None,
            mask_offsets=ints(offsets) if masks else None,
            single_rows=sum(1 for s in meta.seqs if s.query_len == 1),
        )


class TritonAttention(AttentionBackend):
    """CUDA backend: ``reshape_and_cache`` then ``paged_attention`` (kiln.runtime.kernels).

    Same contract as TorchAttention (q [T, H, D], k/v [T, KVH, D] → [T, H, D]; writes the
    cache at ``meta.slot_mapping``). The cache dtype must equal q's, or be float8_e4m3fn
    with per-layer ``cache.k_scale`` / ``cache.v_scale`` [num_layers] device tensors.
    """

    name = "triton"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._dev: TritonAttentionMetadata | None = None

    def device_metadata(self, meta: AttentionMetadata, cache: KVCache,
                        device: torch.device) -> TritonAttentionMetadata:
        """The packed metadata of ``meta``, built on its first layer and reused after."""
        if meta is not self._meta:
            self._dev = TritonAttentionMetadata.build(meta, cache.block_size, device)
            self._meta = meta
        assert self._dev is not None, "metadata cache out of sync"
        return self._dev

    def forward(self, layer, q, k, v, cache, meta, scale):
        from kiln.runtime.kernels.kv_write import reshape_and_cache

        dm, slots, kc, vc, k_scale, v_scale = self._layer(layer, q, cache, meta)
        reshape_and_cache(k, v, kc, vc, slots, k_scale, v_scale)
        return self._attend(q, kc, vc, dm, scale, k_scale, v_scale)

    def rope_forward(self, layer, q, k, v, positions, cos_sin_cache, cache, meta, scale):
        """``forward`` on q, k before the rotary embedding: rotary and the KV write are one
        kernel (``rotary_and_cache_``); q and k are rotated in place."""
        from kiln.runtime.kernels.rotary import rotary_and_cache_

        dm, slots, kc, vc, k_scale, v_scale = self._layer(layer, q, cache, meta)
        rotary_and_cache_(q, k, v, positions, cos_sin_cache, kc, vc, slots, k_scale, v_scale)
        return self._attend(q, kc, vc, dm, scale, k_scale, v_scale)

    def _layer(self, layer, q, cache, meta):
        """Device metadata, slot mapping, the layer's caches and their scales."""
        if isinstance(meta, TritonAttentionMetadata):  # staged on the device (staging.py)
            dm, slot_mapping = meta, meta.slot_mapping
        else:
            dm, slot_mapping = self.device_metadata(meta, cache, q.device), meta.slot_mapping
        fp8 = getattr(cache, "is_fp8", False)
        # [1] views of the per-layer device scales: read by the kernels, no host sync
        k_scale = cache.k_scale[layer : layer + 1] if fp8 else 1.0
        v_scale = cache.v_scale[layer : layer + 1] if fp8 else 1.0
        return dm, slot_mapping, cache.k[layer], cache.v[layer], k_scale, v_scale

    @staticmethod
    def _attend(q, kc, vc, dm, scale, k_scale, v_scale):
        from kiln.runtime.kernels.paged_attention import paged_attention

        return paged_attention(
            q, kc, vc, dm.block_tables, dm.query_start_loc, dm.context_lens, scale,
            max_query_len=dm.max_query_len, max_context_len=dm.max_context_len,
            mask=dm.mask, mask_offsets=dm.mask_offsets, k_scale=k_scale, v_scale=v_scale,
            num_splits=dm.num_splits, single_rows=dm.single_rows,
        )
