"""Rotary position embedding (default, linear and llama3 frequency scaling)."""

from __future__ import annotations

import math

import torch

from kiln.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with the config's rope scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3)")
    return inv


class Rotary:
    """Applies rotary embedding to q and k given per-token positions (rotate-half layout)."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        self.inv_freq = inv_frequencies(cfg).to(device)  # [head_dim // 2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        # [num_tokens, head_dim // 2] → [num_tokens, 1, head_dim], computed in float32.
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, heads, head_dim]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
