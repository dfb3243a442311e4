"""Llama-family decoder over prepared engine weights.

Covers Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (qkv bias) and Qwen3 (per-head q/k RMSNorm).
Weights use the engine's prepared names (fused ``qkv`` and ``gate_up``), see
kiln/artifact/weights.py. Tokens of all sequences are flattened into one batch.

Two formulations of the same layer: the reference (plain torch ops, the oracle) and the
fused one (Triton kernels: add+RMSNorm, which at batch 1 the next projection's GEMV may take
as its prologue, rotary fused into the KV write, SiLU-and-mul, which the down projection's
GEMV may take in its loads; the embedding with the first norm, and the last residual add
with the logit rows and the final norm, each one kernel), used with the Triton attention
backend. With FP8 linears the norms and SiLU-and-mul write the next GEMM's e4m3 input
themselves (kiln/runtime/layers/linear.py). The fused kernels keep the reference's rounding
points (the residual add is rounded to the compute dtype, RMSNorm statistics in float32)
except rotary, which computes in float32 and rounds once; float32 results are identical up
to FMA contraction.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import torch.nn.functional as F

from kiln.config import ModelConfig
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.layers.attention import AttentionBackend, AttentionMetadata
from kiln.runtime.layers.linear import (
    Linear,
    linear_add_rms_norm,
    linear_embed_rms_norm,
    linear_residual_norm_linear,
)
from kiln.runtime.layers.norm import rms_norm
from kiln.runtime.layers.rotary import Rotary

# (layer, q, k, v) -> attention output [num_tokens, num_heads, head_dim]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TensorParallel(Protocol):
    """This process's rank of a tensor-parallel engine, as the model sees it: the group its
    layers reduce over (``kiln.runtime.parallel.Ranks`` is one)."""

    def parallelize(self, linears: dict[str, Linear], embedding: torch.Tensor, head: str
                    ) -> tuple[Callable[[torch.Tensor], torch.Tensor], dict[str, Callable]]:
        """The rank's embedding ([num_tokens] ids -> [num_tokens, hidden], summed over the
        ranks) and its linears by prefix: ``head`` (lm_head or the tied embedding)
        vocab-parallel, o_proj and down row-parallel (ending in the all-reduce), the rest
        as given."""
        ...


def split_qkv(cfg: ModelConfig, w: Mapping[str, torch.Tensor], qkv: torch.Tensor, p: str,
              n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [n, heads, head_dim] of layer ``p``'s qkv projection (per-head q/k norms
    applied)."""
    q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
    q = q.view(n, cfg.num_heads, cfg.head_dim)
    k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
    v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps)
    return q, k, v


def reference_layer(
    cfg: ModelConfig, w: Mapping[str, torch.Tensor],
    lin: Mapping[str, Callable[[torch.Tensor], torch.Tensor]], i: int, h: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
) -> torch.Tensor:
    """Decoder layer ``i`` in the reference formulation: h [T, hidden] -> h [T, hidden].

    ``lin`` maps each projection's prefix (``layers.{i}.qkv`` ...) to the layer that runs
    it; ``attend`` is the attention over q, k, v (the backend over the paged cache in
    ``LlamaModel.forward``, plain causal attention in the random engines' activation
    calibration, kiln/runtime/models/calibration.py)."""
    p, n, eps = f"layers.{i}.", h.shape[0], cfg.rms_norm_eps
    x = rms_norm(h, w[p + "input_norm.weight"], eps)
    q, k, v = split_qkv(cfg, w, lin[p + "qkv"](x), p, n)
    o = attend(i, Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin), v)
    h = h + lin[p + "o_proj"](o.reshape(n, cfg.q_size))
    x = rms_norm(h, w[p + "post_norm.weight"], eps)
    gate, up = lin[p + "gate_up"](x).chunk(2, dim=-1)
    return h + lin[p + "down"](F.silu(gate) * up)


class LlamaModel:
    """Holds weights as plain tensors; ``forward`` returns hidden states of selected rows."""

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, torch.Tensor], attention: AttentionBackend,
        device: torch.device, fused: bool = False, max_positions: int = 8192,
        tp: TensorParallel | None = None,
    ):
        """``tp``: this process's rank of a tensor-parallel engine
        (kiln.runtime.parallel.Ranks); ``cfg`` and ``weights`` are then the rank's shard."""
        self.cfg = cfg
        self.attention = attention
        self.rotary = Rotary(cfg, device)
        self.fused = fused
        if fused:
            from kiln.runtime.kernels.rotary import build_cos_sin_cache

            # [max_positions, head_dim] float32 cos | sin, read by the rotary kernel
            self.cos_sin_cache = build_cos_sin_cache(self.rotary.inv_freq, max_positions)
        self.scale = cfg.head_dim ** -0.5
        missing = [n for n in self.expected_names() if n not in weights]
        if missing:
            raise ValueError(f"engine weights are missing {missing[:5]} ({len(missing)} in all)")
        self.w = weights
        # the output projection as a linear layer prefix: lm_head wherever the engine has one
        # (an FP8 lm_head is one even when tied), else the tied embedding matrix
        tied = cfg.tie_word_embeddings and "lm_head.weight" not in weights
        self.lm_head = "embed_tokens" if tied else "lm_head"
        # each projection's kernel path, chosen once for its weight
        self.linears = {p: Linear.from_weights(weights, p) for p in self.linear_prefixes()}
        self.embed = functools.partial(F.embedding, weight=weights["embed_tokens.weight"])
        self.parallel = tp is not None
        if tp is not None:  # o_proj, down all-reduced; embedding and head vocab-parallel
            self.embed, self.linears = tp.parallelize(
                self.linears, weights["embed_tokens.weight"], self.lm_head)

    def linear_prefixes(self) -> list[str]:
        """The linear layers' prefixes: per layer qkv, o_proj, gate_up, down; the head."""
        return [f"layers.{i}.{n}" for i in range(self.cfg.num_layers)
                for n in ("qkv", "o_proj", "gate_up", "down")] + [self.lm_head]

    def expected_names(self) -> list[str]:
        cfg = self.cfg
        names = ["embed_tokens.weight", "norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            names += [p + n for n in ("input_norm.weight", "qkv.weight", "o_proj.weight",
                                      "post_norm.weight", "gate_up.weight", "down.weight")]
            if cfg.qkv_bias:
                names.append(p + "qkv.bias")
            if cfg.qk_norm:
                names += [p + "q_norm.weight", p + "k_norm.weight"]
        return names

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
        meta: AttentionMetadata, logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; logit_rows: [num_rows] indices into the batch.

        Returns float32 logits [num_rows, vocab]. Writes this step's K/V into ``cache``.
        """
        if self.fused:
            return self._forward_fused(input_ids, positions, cache, meta, logit_rows)
        cfg, w = self.cfg, self.w
        h = self.embed(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.attention.forward(i, q, k, v, cache, meta, self.scale)

        for i in range(cfg.num_layers):
            h = reference_layer(cfg, w, self.linears, i, h, cos, sin, attend)
        h = rms_norm(h.index_select(0, logit_rows), w["norm.weight"], cfg.rms_norm_eps)
        return self.linears[self.lm_head](h).float()

    def _split_qkv(self, qkv: torch.Tensor, p: str, n: int):
        return split_qkv(self.cfg, self.w, qkv, p, n)

    def _forward_fused(self, input_ids, positions, cache, meta, logit_rows) -> torch.Tensor:
        """``forward`` through the Triton kernels (same contract). Graph-safe: no host syncs."""
        from kiln.runtime.kernels.rms_norm import gather_add_rms_norm

        cfg, w, lin, eps = self.cfg, self.w, self.linears, self.cfg.rms_norm_eps
        n = input_ids.shape[0]
        if self.parallel:  # the embedding is a sum over the ranks, then the norm
            h = self.embed(input_ids)
            qkv = lin["layers.0.qkv"](rms_norm(h, w["layers.0.input_norm.weight"], eps))
        else:  # the embedding rows (h, the residual) and layer 0's norm: one kernel
            qkv, h = linear_embed_rms_norm(input_ids, w["embed_tokens.weight"],
                                           w["layers.0.input_norm.weight"], eps,
                                           lin["layers.0.qkv"])
        project = self._project_parallel if self.parallel else linear_residual_norm_linear
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            q, k, v = self._split_qkv(qkv, p, n)
            # the Triton backend: rotary fused into the KV write, then paged attention
            o = self.attention.rope_forward(i, q, k, v, positions, self.cos_sin_cache, cache,
                                            meta, self.scale)
            # each projection, its residual add, the RMSNorm and the next projection: two
            # GEMVs at batch 1 (the add and the statistics in the first one's epilogue)
            gate_up, h = project(
                o.reshape(n, cfg.q_size), h, lin[p + "o_proj"], w[p + "post_norm.weight"], eps,
                lin[p + "gate_up"])
            if i + 1 < cfg.num_layers:
                nxt = f"layers.{i + 1}."
                qkv, h = project(
                    gate_up, h, lin[p + "down"], w[nxt + "input_norm.weight"], eps,
                    lin[nxt + "qkv"], silu_and_mul=True)
            else:
                y = lin[p + "down"](gate_up, silu_and_mul=True)
                # the last add, the logit rows and the final norm: one kernel
                h = gather_add_rms_norm(y, h, logit_rows, w["norm.weight"], eps)
        # float_out: the GEMV stores the float32 logits; .float() is then a no-op
        return lin[self.lm_head](h, float_out=True).float()

    @staticmethod
    def _project_parallel(x, residual, a, norm_weight, eps, b, silu_and_mul=False):
        """``linear_residual_norm_linear`` of a tensor-parallel rank: ``a`` (row-parallel)
        ends in an all-reduce, so the residual add and the norm follow it (no GEMV fusion
        across the collective)."""
        return linear_add_rms_norm(a(x, silu_and_mul=silu_and_mul), residual, norm_weight,
                                   eps, b)
