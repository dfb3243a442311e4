"""Attention backends over the paged KV cache.

A backend writes the step's new K/V into the cache (at ``slot_mapping``) and attends each
sequence's queries to its cached prefix plus its in-step tokens. The in-step part is causal
unless the sequence carries a ``step_mask`` (lookahead / verification tree masks).
This module holds the interface and the torch reference; backends are chosen by name in
kiln/runtime/layers/attention_registry.py (``get_backend``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kiln.runtime.kv_cache import KVCache

# What a step is to a backend (``step_class``): a backend may run some classes and not
# others, and the build measures each class (kiln/runtime/layers/attention_select.py).
STEP_CLASSES = ("decode", "prompt", "tree")


def step_class(dm: Any) -> str:
    """The class of a step from its (device) attention metadata: ``tree`` with a tree mask,
    else ``prompt`` when some sequence has more than one query token, else ``decode``."""
    if getattr(dm, "mask", None) is not None:
        return "tree"
    return "prompt" if dm.max_query_len > 1 else "decode"


@dataclass
class SeqAttention:
    """One sequence's slice of the step.

    Queries ``query_start : query_start + query_len`` of the flat token batch; keys are the
    sequence's first ``context_len`` cache slots (``key_slots``, [context_len]); the last
    ``query_len`` of them are this step's tokens. ``step_mask`` [query_len, query_len] bool
    (True = may attend) replaces the causal in-step mask when set.
    """

    query_start: int
    query_len: int
    context_len: int
    key_slots: torch.Tensor
    step_mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Per-forward attention inputs, built once by the model runner and shared by layers."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    seqs: list[SeqAttention]


class AttentionBackend(ABC):
    """Writes K/V and computes attention for one layer.

    Shapes: q [num_tokens, num_heads, head_dim]; k, v [num_tokens, num_kv_heads, head_dim];
    returns [num_tokens, num_heads, head_dim]. Mutates ``cache`` at ``meta.slot_mapping``.
    """

    name: str

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        cache: KVCache, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor: ...


def write_kv(layer: int, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V [T, kv_heads, head_dim] at their cache slots."""
    blk, off = cache.slot_index(slot_mapping)
    kc, vc = cache.k[layer], cache.v[layer]
    if cache.is_fp8:  # e4m3(k / k_scale), copied as bytes (no float8 index kernels on CPU)
        k8 = (k.float() / cache.k_scale[layer]).clamp(-448.0, 448.0).to(kc.dtype)
        v8 = (v.float() / cache.v_scale[layer]).clamp(-448.0, 448.0).to(vc.dtype)
        kc.view(torch.uint8)[blk, off] = k8.view(torch.uint8)
        vc.view(torch.uint8)[blk, off] = v8.view(torch.uint8)
        return
    kc[blk, off] = k.to(kc.dtype)
    vc[blk, off] = v.to(vc.dtype)


def read_kv(layer: int, cache: KVCache, slots: torch.Tensor, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V at ``slots`` as [len(slots), kv_heads, head_dim] in ``dtype`` (FP8 dequantized)."""
    blk, off = cache.slot_index(slots)
    if cache.is_fp8:
        ks = cache.k[layer].view(torch.uint8)[blk, off].view(cache.k.dtype)
        vs = cache.v[layer].view(torch.uint8)[blk, off].view(cache.v.dtype)
        return ((ks.float() * cache.k_scale[layer]).to(dtype),
                (vs.float() * cache.v_scale[layer]).to(dtype))
    return cache.k[layer][blk, off].to(dtype), cache.v[layer][blk, off].to(dtype)


class TorchAttention(AttentionBackend):
    """The reference: plain torch, one sequence at a time. The oracle for every kernel."""

    name = "torch"

    def forward(self, layer, q, k, v, cache, meta, scale):
        write_kv(layer, k, v, cache, meta.slot_mapping)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        for s in meta.seqs:
            qs = q[s.query_start : s.query_start + s.query_len]  # [q, H, D]
            ks, vs = read_kv(layer, cache, s.key_slots, q.dtype)  # [ctx, KVH, D] each
            mask = _seq_mask(s, q.device)
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                attn_mask=mask, scale=scale, enable_gqa=gqa,
            )  # [H, q, D]
            out[s.query_start : s.query_start + s.query_len] = o.transpose(0, 1)
        return out


def _seq_mask(s: SeqAttention, device: torch.device) -> torch.Tensor:
    """[query_len, context_len] bool: whole prefix visible, in-step part causal or custom."""
    prefix = s.context_len - s.query_len
    mask = torch.ones(s.query_len, s.context_len, dtype=torch.bool, device=device)
    if s.step_mask is not None:
        mask[:, prefix:] = s.step_mask.to(device)
    else:
        mask[:, prefix:] = torch.ones(
            s.query_len, s.query_len, dtype=torch.bool, device=device
        ).tril()
    return mask
