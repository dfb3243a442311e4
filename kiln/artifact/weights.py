"""weights.safetensors: the runtime tensor names and shapes (a contract between the builder,
which writes them, and kiln.runtime, which reads them), FP8 tensors and their scales, and the
seeded random weights a random engine makes at load instead of shipping a file.

Runtime names, with shapes; nh/nkv heads, hd head_dim, H hidden, I intermediate, V vocab:

    embed_tokens.weight              [V, H]
    layers.{i}.input_norm.weight     [H]
    layers.{i}.qkv.weight            [(nh + 2*nkv) * hd, H]   cat(q, k, v) on dim 0
    layers.{i}.qkv.bias              [(nh + 2*nkv) * hd]      only when qkv_bias
    layers.{i}.q_norm.weight         [hd]                     only when qk_norm (Qwen3)
    layers.{i}.k_norm.weight         [hd]                     only when qk_norm
    layers.{i}.o_proj.weight         [H, nh * hd]
    layers.{i}.post_norm.weight      [H]
    layers.{i}.gate_up.weight        [2*I, H]                 cat(gate, up) on dim 0
    layers.{i}.down.weight           [H, I]
    norm.weight                      [H]
    lm_head.weight                   [V, H]                   omitted when tied (see below)

An FP8 linear (one of LINEARS) has ``{name}.weight`` [N, K] e4m3, ``{name}.weight_scale`` []
f32 and ``{name}.input_scale`` [] f32 (static activations only); with an FP8 KV cache every
layer has ``layers.{i}.k_scale`` and ``layers.{i}.v_scale`` [] f32. An FP8 lm_head
(engine.json ``quantization.lm_head == "fp8"``) is ``lm_head.weight`` e4m3 +
``lm_head.weight_scale`` [V] f32, one per row; a tied model then gets it as a separate head
made from the embedding (``separate_head``), and keeps ``embed_tokens.weight``. How FP8
checkpoints become these tensors: kiln/builder/fp8.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kiln.config import ModelConfig

RANDOM_STD = 0.02
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
LINEARS = ("qkv", "o_proj", "gate_up", "down")
_SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".k_scale", ".v_scale", ".kv_scale",
                   ".output_scale")


def _layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    p = f"layers.{i}."
    shapes = {p + "input_norm.weight": (h,), p + "qkv.weight": (qkv, h)}
    if cfg.qkv_bias:
        shapes[p + "qkv.bias"] = (qkv,)
    if cfg.qk_norm:
        shapes[p + "q_norm.weight"] = (hd,)
        shapes[p + "k_norm.weight"] = (hd,)
    shapes[p + "o_proj.weight"] = (h, cfg.q_size)
    shapes[p + "post_norm.weight"] = (h,)
    shapes[p + "gate_up.weight"] = (2 * inter, h)
    shapes[p + "down.weight"] = (h, inter)
    return shapes


def has_lm_head(cfg: ModelConfig, separate_head: bool = False) -> bool:
    """Whether the engine holds ``lm_head.weight``: untied models always, tied ones only with
    ``separate_head`` (the FP8 copy of the embedding)."""
    return separate_head or not cfg.tie_word_embeddings


def runtime_shapes(cfg: ModelConfig, separate_head: bool = False) -> dict[str, tuple[int, ...]]:
    """Every runtime tensor name → shape, in file order (embedding, layers, norm, lm_head)."""
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_layers):
        shapes.update(_layer_shapes(cfg, i))
    shapes["norm.weight"] = (cfg.hidden_size,)
    if has_lm_head(cfg, separate_head):
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def weight_groups(cfg: ModelConfig) -> list[list[str]]:
    """The runtime names in groups that ``quantize_random`` converts alone: the embedding
    with the final norm and lm_head (an FP8 head of a tied model is made from the
    embedding), then each layer."""
    outer = ["embed_tokens.weight", "norm.weight"]
    if has_lm_head(cfg):
        outer.append("lm_head.weight")
    return [outer, *(list(_layer_shapes(cfg, i)) for i in range(cfg.num_layers))]


def is_scale_name(name: str) -> bool:
    return name.endswith(_SCALE_SUFFIXES)


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3(w / s), s) with s = amax(w) / 448 (float32, never 0)."""
    s = (w.detach().abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    return (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def quantize_per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3(w / s[:, None]), s [N]) with s = each row's amax / 448 (float32, never 0)."""
    s = (w.detach().abs().amax(dim=1).float() / FP8_MAX).clamp(min=1e-12)
    return (w.float() / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def quantize_lm_head(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``lm_head.weight`` → e4m3 ``lm_head.weight`` + ``lm_head.weight_scale`` [V] (each
    row's amax / 448), in place of ``weights``; where there is none (a tied model's random
    weights), made from ``embed_tokens.weight``, which stays. Per row, not per tensor: on
    smollm2-135m (tied) perplexity 18.92 (bf16 head) -> 19.17 per row, 19.38 per tensor
    (weight-only; `kiln eval` on CPU, activations quantized too: 19.27 / 19.48), at the same
    speed."""
    name = "lm_head.weight" if "lm_head.weight" in weights else "embed_tokens.weight"
    q, s = quantize_per_row(weights[name])
    weights["lm_head.weight"], weights["lm_head.weight_scale"] = q, s.to(q.device)
    return weights


def quantize_random(weights: dict[str, torch.Tensor], cfg: ModelConfig, *,
                    fp8_weights: bool, kv_fp8: bool, fp8_lm_head: bool = False,
                    per_row: bool = False) -> dict[str, torch.Tensor]:
    """Random engine weights → FP8 linears with per-tensor weight scales (``per_row``: one
    per output row, ``quantize_per_row``; any ``{name}.input_scale`` in ``weights`` is kept:
    static activations), with ``kv_fp8`` KV scales of 1.0, with ``fp8_lm_head`` the FP8
    lm_head (``quantize_lm_head``). Converts in place of the dict, one tensor at a time.
    ``weights`` may be a part (``random_weights(names=)``): the layers it has, the head where
    it has the embedding."""
    if fp8_lm_head and "embed_tokens.weight" in weights:
        quantize_lm_head(weights)
    for i in range(cfg.num_layers):
        if f"layers.{i}.qkv.weight" not in weights:
            continue
        for lin in LINEARS if fp8_weights else ():
            name = f"layers.{i}.{lin}.weight"
            w = weights.pop(name)
            q, s = quantize_per_row(w) if per_row else quantize_per_tensor(w)
            del w
            weights[name], weights[f"layers.{i}.{lin}.weight_scale"] = q, s.to(q.device)
        if kv_fp8:
            dev = weights[f"layers.{i}.qkv.weight"].device
            weights[f"layers.{i}.k_scale"] = torch.ones((), device=dev)
            weights[f"layers.{i}.v_scale"] = torch.ones((), device=dev)
    return weights


@dataclass(frozen=True)
class RandomCalibration:
    """How a random FP8 engine's static activation scales are made at load: the unquantized
    model runs over ``num_seqs`` sequences of ``seq_len`` token ids drawn uniformly from the
    vocabulary by a CPU generator seeded with ``seed`` (the same tokens on every device),
    and each FP8 linear's ``input_scale`` is its input's amax / 448 over them
    (kiln/runtime/models/calibration.py). Recorded in engine.json
    ``quantization.scales.calibration``."""

    num_seqs: int = 4
    seq_len: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_seqs", "seq_len", "seed"):
            v = getattr(self, name)
            least = 0 if name == "seed" else 1
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"random calibration {name} must be an integer >= {least}, "
                                 f"got {v!r}")

    def tokens(self, vocab_size: int) -> torch.Tensor:
        """[num_seqs, seq_len] int64 token ids on the CPU."""
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(vocab_size, (self.num_seqs, self.seq_len), generator=g)

    def to_dict(self) -> dict[str, Any]:
        return {
            "description": f"per-tensor input amax / 448, calibrated at load on {self.num_seqs} "
                           f"random-token sequences of {self.seq_len} tokens (seed {self.seed})",
            "calib_size": self.num_seqs, "calib_seq_len": self.seq_len, "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RandomCalibration:
        return cls(int(d["calib_size"]), int(d["calib_seq_len"]), int(d["seed"]))


def random_calibration(scales: dict[str, Any] | None) -> RandomCalibration | None:
    """The load-time calibration engine.json ``quantization.scales`` asks of a random FP8
    engine; None where its activations are dynamic (random engines built before
    calibration, or built with ``scales={"activations": "dynamic"}``)."""
    scales = scales or {}
    if scales.get("activations") != "static" or "calibration" not in scales:
        return None
    return RandomCalibration.from_dict(scales["calibration"])


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def tensor_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed per (engine seed, tensor name)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def random_weights(
    cfg: ModelConfig,
    seed: int,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    std: float = RANDOM_STD,
    names: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Deterministic N(0, std) weights made directly on ``device`` (norms are 1); only
    ``names`` where given (a part: a tensor-parallel rank makes its weights group by group).

    Each tensor has its own generator seeded from (seed, name), so the result does not depend
    on which tensors are made or in what order. Same device type + seed → same weights.
    """
    device = torch.device(device)
    out = {}
    shapes = runtime_shapes(cfg)
    if names is not None:
        shapes = {n: shapes[n] for n in names}
    for name, shape in shapes.items():
        if _is_norm(name):
            out[name] = torch.ones(shape, device=device, dtype=dtype)
            continue
        g = torch.Generator(device=device).manual_seed(tensor_seed(seed, name))
        t = torch.randn(shape, generator=g, device=device, dtype=dtype)
        out[name] = t.mul_(std)
    return out
