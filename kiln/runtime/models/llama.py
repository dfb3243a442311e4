"""Llama-family decoder over prepared engine weights.

Covers Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (qkv bias) and Qwen3 (per-head q/k RMSNorm).
Weights use the engine's prepared names (fused ``qkv`` and ``gate_up``), see
kiln/builder/weights.py. Tokens of all sequences are flattened into one batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.config import ModelConfig
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.layers.attention import AttentionBackend, AttentionMetadata
from kiln.runtime.layers.linear import linear
from kiln.runtime.layers.norm import rms_norm
from kiln.runtime.layers.rotary import Rotary


class LlamaModel:
    """Holds weights as plain tensors; ``forward`` returns hidden states of selected rows."""

    def __init__(
        self, cfg: ModelConfig, weights: dict[str, torch.Tensor], attention: AttentionBackend,
        device: torch.device,
    ):
        self.cfg = cfg
        self.attention = attention
        self.rotary = Rotary(cfg, device)
        self.scale = cfg.head_dim ** -0.5
        missing = [n for n in self.expected_names() if n not in weights]
        if missing:
            raise ValueError(f"engine weights are missing {missing[:5]} ({len(missing)} in all)")
        self.w = weights
        self.lm_head = weights["embed_tokens.weight"] if cfg.tie_word_embeddings else (
            weights["lm_head.weight"]
        )

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
        cfg, w = self.cfg, self.w
        h = F.embedding(input_ids, w["embed_tokens.weight"])  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        n = len(input_ids)
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            x = rms_norm(h, w[p + "input_norm.weight"], cfg.rms_norm_eps)
            qkv = linear(x, w, p + "qkv")
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.view(n, cfg.num_heads, cfg.head_dim)
            k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
            v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, w[p + "q_norm.weight"], cfg.rms_norm_eps)
                k = rms_norm(k, w[p + "k_norm.weight"], cfg.rms_norm_eps)
            q = Rotary.apply(q, cos, sin)
            k = Rotary.apply(k, cos, sin)
            o = self.attention.forward(i, q, k, v, cache, meta, self.scale)
            h = h + linear(o.reshape(n, cfg.q_size), w, p + "o_proj")
            x = rms_norm(h, w[p + "post_norm.weight"], cfg.rms_norm_eps)
            gate, up = linear(x, w, p + "gate_up").chunk(2, dim=-1)
            h = h + linear(F.silu(gate) * up, w, p + "down")
        h = rms_norm(h.index_select(0, logit_rows), w["norm.weight"], cfg.rms_norm_eps)
        return F.linear(h, self.lm_head).float()
