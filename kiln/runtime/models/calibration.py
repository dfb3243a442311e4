"""Static FP8 activation scales of a random engine, calibrated at load.

A random engine's weights are made at load from its seed (kiln/artifact/weights.py), so its
activation scales are too: the unquantized model runs over a few seeded random-token
sequences (``RandomCalibration``, recorded in engine.json) and every FP8 linear gets
``input_scale`` = max|input| / 448 over them, the max calibration ``kiln quantize``
(modelopt) does for a real checkpoint. q/k/v and gate/up read one input each, so their
fused linears get the one scale modelopt's separate quantizers would all record.

The model runs layer by layer in the reference formulation (``reference_layer``) with
plain causal attention over each sequence, so a caller that makes the weights one layer at a
time (a tensor-parallel rank) needs no more than one layer's unquantized weights at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from kiln.artifact.weights import LINEARS, RandomCalibration
from kiln.config import ModelConfig
from kiln.runtime.fp8 import fp8_scale
from kiln.runtime.layers.rotary import Rotary
from kiln.runtime.models.llama import reference_layer


class ActivationCalibrator:
    """Runs the model forward as its unquantized weights arrive (the embedding, then each
    layer in order) and returns each layer's ``{prefix}.input_scale`` tensors.

    Holds the hidden states of the calibration batch, [num_seqs * seq_len, hidden] in the
    compute dtype, between layers."""

    def __init__(self, cfg: ModelConfig, data: RandomCalibration, device: torch.device | str,
                 dtype: torch.dtype):
        self.cfg = cfg
        self.data = data
        device = torch.device(device)
        self.tokens = data.tokens(cfg.vocab_size).to(device)  # [S, T]
        positions = torch.arange(data.seq_len, device=device).repeat(data.num_seqs)
        self.cos, self.sin = Rotary(cfg, device).cos_sin(positions, dtype)
        self.dtype = dtype
        self.h: torch.Tensor | None = None  # [S * T, hidden]
        self.next_layer = 0

    @torch.inference_mode()
    def observe(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Feed a part of the unquantized engine weights: the embedding starts the forward,
        each layer (in order) advances it. Returns the input scales ([] float32) of the
        layers in ``weights``."""
        if "embed_tokens.weight" in weights:
            self.h = F.embedding(self.tokens.reshape(-1), weights["embed_tokens.weight"])
        scales: dict[str, torch.Tensor] = {}
        while f"layers.{self.next_layer}.qkv.weight" in weights:
            scales.update(self._layer(self.next_layer, weights))
            self.next_layer += 1
        return scales

    def _layer(self, i: int, w: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.h is None:
            raise ValueError("calibration needs the embedding (embed_tokens.weight) before "
                             f"layer {i}")
        scales: dict[str, torch.Tensor] = {}

        def linear(prefix: str):
            def run(x: torch.Tensor) -> torch.Tensor:
                scales[prefix + ".input_scale"] = fp8_scale(x)
                return F.linear(x, w[prefix + ".weight"], w.get(prefix + ".bias"))
            return run

        lin = {f"layers.{i}.{n}": linear(f"layers.{i}.{n}") for n in LINEARS}
        self.h = reference_layer(self.cfg, w, lin, i, self.h, self.cos, self.sin, self._attend)
        return scales

    def _attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> torch.Tensor:
        """Causal attention within each sequence: q [S*T, nh, hd], k/v [S*T, nkv, hd] ->
        [S*T, nh, hd]."""
        cfg, s, t = self.cfg, self.data.num_seqs, self.data.seq_len
        group = cfg.num_heads // cfg.num_kv_heads

        def heads(x: torch.Tensor, rep: int) -> torch.Tensor:  # -> [S, heads, T, hd]
            x = x.view(s, t, -1, cfg.head_dim).transpose(1, 2)
            return x.repeat_interleave(rep, dim=1) if rep > 1 else x

        o = F.scaled_dot_product_attention(heads(q, 1), heads(k, group), heads(v, group),
                                           is_causal=True, scale=cfg.head_dim ** -0.5)
        return o.transpose(1, 2).reshape(s * t, cfg.num_heads, cfg.head_dim)
