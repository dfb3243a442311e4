"""FP8 checkpoints → FP8 engine tensors: detection, scale fusion, KV scales.

Reads the two FP8 Hugging Face formats other toolchains write:

* modelopt (``kiln quantize``, TensorRT-Model-Optimizer): ``hf_quant_config.json`` with
  ``quant_algo: FP8`` (and ``quantization_config.quant_method: modelopt`` in config.json);
  per Linear ``weight`` (e4m3), ``weight_scale``, ``input_scale`` (static); or
  ``quant_algo: FP8_PER_CHANNEL_PER_TOKEN`` (``--qformat fp8_pc_pt``): ``weight_scale`` [N],
  no ``input_scale`` (dynamic per-token activations); KV scales as
  ``self_attn.k_proj.k_scale`` / ``self_attn.v_proj.v_scale`` (older exports:
  ``self_attn.k_scale``).
* compressed-tensors ``float-quantized`` (llm-compressor): ``quantization_config`` with
  ``quant_method: compressed-tensors``, 8-bit float weights per tensor or per output channel
  (strategy ``channel``: ``weight_scale`` [N, 1], llm-compressor's FP8_DYNAMIC scheme),
  static or dynamic input activations, optional ``kv_cache_scheme``; KV scales as
  ``self_attn.k_scale``.

Engine tensors an FP8 linear gets (runtime names, see kiln/artifact/weights.py):
``{name}.weight`` [N, K] e4m3, ``{name}.weight_scale`` [] f32 (per tensor) or [N] f32 (per
output channel), ``{name}.input_scale`` [] f32 (static activations only); with an FP8 KV cache
every layer has ``layers.{i}.k_scale`` and ``layers.{i}.v_scale`` [] f32. Fused q/k/v and
gate/up shards with per-tensor scales are requantized to the largest shard scale: w =
e4m3(w_i.float() * s_i / s_max), so one scale serves the fused tensor. Per-channel shards
keep their e4m3 bytes: the fused tensor's scale is the shards' row scales concatenated.

The FP8 lm_head (``kiln build --quantize-lm-head``, any source) is the same layout,
``lm_head.weight`` [V, H] e4m3 + ``lm_head.weight_scale`` [V] f32, quantized per row from
the engine-dtype lm_head (tied models: from the embedding, which stays as it is). The
quantization itself, and random engines' FP8 made at load: kiln/artifact/weights.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.artifact.weights import FP8, FP8_MAX, LINEARS, is_scale_name
from kiln.config import ModelConfig
from kiln.errors import SourceError
from kiln.sources.base import SourceModel

# modelopt quant_algo values kiln builds: per-tensor weights with static activations, and
# per-channel weights ([N] scales) with dynamic per-token activations (no input_scale)
MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What an FP8 checkpoint declares. ``activations``: "static" or "dynamic";
    ``weights``: "tensor" (one scale per weight) or "channel" (one per output row)."""

    scheme: str  # "modelopt" | "compressed-tensors"
    activations: str
    kv_cache: bool  # the checkpoint declares an FP8 KV cache scheme
    producer: str
    calibration: dict[str, Any] | None = None
    weights: str = "tensor"


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SourceError(f"{path} is not valid JSON ({e})") from e


def detect_fp8_checkpoint(source: SourceModel) -> Fp8Checkpoint | None:
    """The FP8 scheme of a local checkpoint directory, or None for an unquantized one.

    Raises SourceError for quantization schemes kiln cannot run (naming what is supported).
    """
    path = source.provenance.get("path")
    if not path or not Path(path).is_dir():
        return None
    d = Path(path)
    hf = _read_json(d / "config.json") or {}
    qc = hf.get("quantization_config") or {}
    calib = _read_json(d / "kiln_quantize.json")
    modelopt = _read_json(d / "hf_quant_config.json")
    method = qc.get("quant_method")
    if modelopt is not None or method == "modelopt":
        q = (modelopt or {}).get("quantization", {})
        algo = q.get("quant_algo") or qc.get("quant_algo")
        if algo not in MODELOPT_ALGOS:
            raise SourceError(
                f"{d} is a modelopt checkpoint with quant_algo {algo!r}; kiln builds "
                f"{' and '.join(MODELOPT_ALGOS)}: re-export with `kiln quantize --qformat fp8` "
                "(or fp8_pc_pt)"
            )
        per_channel = algo == "FP8_PER_CHANNEL_PER_TOKEN"
        kv = (q.get("kv_cache_quant_algo") or (qc.get("kv_cache_scheme") or {}).get("type"))
        prod = (modelopt or {}).get("producer") or qc.get("producer") or {}
        return Fp8Checkpoint(
            scheme="modelopt", activations="dynamic" if per_channel else "static",
            kv_cache=kv in ("FP8", "float"),
            producer=f"{prod.get('name', 'modelopt')} {prod.get('version', '?')}",
            calibration=calib, weights="channel" if per_channel else "tensor",
        )
    if method == "compressed-tensors":
        groups = list((qc.get("config_groups") or {}).values())
        if not groups:
            raise SourceError(f"{d}/config.json: compressed-tensors config has no config_groups")
        acts, strategies = set(), set()
        for g in groups:
            w = g.get("weights") or {}
            strategy = w.get("strategy", "tensor")
            if (w.get("num_bits"), w.get("type")) != (8, "float") or strategy not in (
                "tensor", "channel"
            ):
                raise SourceError(
                    f"{d}: compressed-tensors weights {w} are not FP8 per tensor or per "
                    "channel; kiln builds 8-bit float weights with strategy 'tensor' or "
                    "'channel' (re-quantize with one of those, e.g. llm-compressor's FP8 or "
                    "FP8_DYNAMIC scheme)"
                )
            strategies.add(strategy)
            a = g.get("input_activations")
            if a is None:
                acts.add("none")
            elif (a.get("num_bits"), a.get("type")) != (8, "float"):
                raise SourceError(f"{d}: compressed-tensors input_activations {a} are not FP8")
            else:
                acts.add("dynamic" if a.get("dynamic") else "static")
        if len(acts) != 1 or "none" in acts:
            raise SourceError(
                f"{d}: compressed-tensors activation schemes {sorted(acts)}; kiln needs one FP8 "
                "scheme (static or dynamic) for every group (weight-only FP8: todo)"
            )
        fmt = qc.get("format", "float-quantized")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise SourceError(f"{d}: compressed-tensors format {fmt!r}; kiln reads float-quantized")
        kv = qc.get("kv_cache_scheme")
        return Fp8Checkpoint(
            scheme="compressed-tensors", activations=acts.pop(),
            kv_cache=bool(kv) and kv.get("type") == "float" and kv.get("num_bits") == 8,
            producer=f"compressed-tensors {qc.get('version', '?')}",
            weights="channel" if "channel" in strategies else "tensor",
        )
    if method is not None:
        raise SourceError(
            f"{d}/config.json has quantization quant_method {method!r}; kiln builds "
            "unquantized checkpoints and FP8 from modelopt or compressed-tensors"
        )
    return None


def without_scales(source: SourceModel) -> SourceModel:
    """A view of ``source`` whose tensor list omits scale tensors (for the shape checks)."""
    names = [n for n in source.tensor_names if not is_scale_name(n)]
    shapes = None
    if source.tensor_shapes is not None:
        shapes = {n: s for n, s in source.tensor_shapes.items() if not is_scale_name(n)}
    return dataclasses.replace(source, tensor_names=names, tensor_shapes=shapes)


def fuse_fp8_shards(
    parts: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate FP8 shards (w_i e4m3 [N_i, K], s_i) on dim 0: per-tensor scales (every s_i
    one value) through ``requantize_fused``; otherwise the bytes are kept and the scale is one
    per row, cat(s_i broadcast to [N_i]) (a per-tensor shard beside per-channel ones repeats
    its scale), which is exact."""
    if all(s.numel() == 1 for _, s in parts):
        return requantize_fused(parts)
    rows = [s.float().reshape(-1).expand(w.shape[0]) for w, s in parts]
    return torch.cat([w for w, _ in parts], dim=0), torch.cat(rows).contiguous()


def requantize_fused(
    parts: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate FP8 shards (w_i e4m3 [N_i, K], s_i []) on dim 0 under one scale.

    s = max(s_i); w = e4m3((w_i.float() * s_i) / s) in float32: dequantize, then quantize
    with the shared scale. The shard with the largest scale is copied bit for bit; the others
    shrink by s_i/s <= 1 and are rounded to nearest e4m3.
    """
    scales = [s.float().reshape(()) for _, s in parts]
    s_max = torch.stack(scales).max()
    out = []
    for (w, _), s in zip(parts, scales):
        if torch.equal(s, s_max):
            out.append(w)
        else:
            out.append(((w.float() * s) / s_max).clamp(-FP8_MAX, FP8_MAX).to(FP8))
    return torch.cat(out, dim=0), s_max


def fp8_lm_head_layout(
    layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``layout`` (name → (shape, dtype), file order) with lm_head.weight e4m3 and its
    float32 weight_scale right after it, the order ``quantize_lm_head`` leaves a group in."""
    out = {}
    for name, (shape, dtype) in layout.items():
        if name == "lm_head.weight":
            out[name] = (shape, FP8)
            out["lm_head.weight_scale"] = ((shape[0],), torch.float32)
        else:
            out[name] = (shape, dtype)
    return out


def _kv_scale(source: SourceModel, names: set[str], i: int, kind: str) -> torch.Tensor | None:
    a = f"model.layers.{i}.self_attn."
    for n in (f"{a}{kind}_proj.{kind}_scale", f"{a}{kind}_scale", f"{a}kv_scale"):
        if n in names:
            return source.get_tensor(n).float().reshape(())
    return None


def prepare_fp8_groups(
    source: SourceModel, cfg: ModelConfig, plan: list[dict[str, list[str]]], dtype: torch.dtype,
    *, kv_fp8: bool, report: dict[str, Any],
) -> Iterator[dict[str, torch.Tensor]]:
    """Like ``prepare_groups`` for an FP8 checkpoint (``plan`` from ``tensor_plan``).

    FP8 linears are fused by requantization; unquantized ones (excluded modules) and all
    other tensors are cast to ``dtype``. With ``kv_fp8`` each layer group gets k_scale and
    v_scale (1.0 when the checkpoint has none). ``report`` collects counts for warnings:
    kv_missing (layers without scales), kv_ones (layers with both scales exactly 1.0).
    """
    names = set(source.tensor_names)
    report.setdefault("kv_missing", 0)
    report.setdefault("kv_ones", 0)
    report.setdefault("fp8_linears", 0)
    for gi, group in enumerate(plan):
        out: dict[str, torch.Tensor] = {}
        for name, hf_names in group.items():
            prefix = name[: -len(".weight")] if name.endswith(".weight") else None
            if prefix and prefix.rsplit(".", 1)[-1] in LINEARS:
                mods = [n[: -len(".weight")] for n in hf_names]
                quantized = [m + ".weight_scale" in names for m in mods]
                if any(quantized):
                    if not all(quantized):
                        raise SourceError(
                            f"{name}: shards {mods} are partly FP8 ({quantized}); kiln fuses "
                            "them into one tensor, so all or none must be quantized"
                        )
                    parts = [(source.get_tensor(m + ".weight"),
                              source.get_tensor(m + ".weight_scale")) for m in mods]
                    for (w, s), m in zip(parts, mods):
                        if w.dtype != FP8 or s.numel() not in (1, w.shape[0]):
                            raise SourceError(
                                f"{m}: weight {w.dtype} {list(w.shape)} with weight_scale of "
                                f"shape {list(s.shape)}; kiln needs e4m3 weights with one "
                                "scale per tensor or one per output row"
                            )
                    w, s = fuse_fp8_shards(parts)
                    out[name] = w.contiguous()
                    out[prefix + ".weight_scale"] = s
                    inputs = [source.get_tensor(m + ".input_scale").float().reshape(())
                              for m in mods if m + ".input_scale" in names]
                    if inputs:
                        out[prefix + ".input_scale"] = torch.stack(inputs).max()
                    report["fp8_linears"] += 1
                    continue
            parts = [source.get_tensor(n).to(dtype) for n in hf_names]
            out[name] = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)).contiguous()
        if kv_fp8 and 0 < gi <= cfg.num_layers:
            i = gi - 1
            k, v = _kv_scale(source, names, i, "k"), _kv_scale(source, names, i, "v")
            if k is None or v is None:
                report["kv_missing"] += 1
            k = torch.tensor(1.0) if k is None else k
            v = torch.tensor(1.0) if v is None else v
            if float(k) == 1.0 and float(v) == 1.0:
                report["kv_ones"] += 1
            out[f"layers.{i}.k_scale"], out[f"layers.{i}.v_scale"] = k, v
        yield out


def fp8_layout(
    source: SourceModel, cfg: ModelConfig, plan: list[dict[str, list[str]]],
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, *, kv_fp8: bool,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Engine tensor name → (shape, dtype) in the order ``prepare_fp8_groups`` yields them,
    decided from tensor names alone (the safetensors header is written before any data)."""
    names = set(source.tensor_names)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for gi, group in enumerate(plan):
        for name, hf_names in group.items():
            prefix = name[: -len(".weight")] if name.endswith(".weight") else None
            mods = [n[: -len(".weight")] for n in hf_names]
            if (prefix and prefix.rsplit(".", 1)[-1] in LINEARS
                    and any(m + ".weight_scale" in names for m in mods)):
                out[name] = (shapes[name], FP8)
                per_row = any(_numel(source, m + ".weight_scale") > 1 for m in mods)
                out[prefix + ".weight_scale"] = (
                    (shapes[name][0],) if per_row else (), torch.float32)
                if any(m + ".input_scale" in names for m in mods):
                    out[prefix + ".input_scale"] = ((), torch.float32)
            else:
                out[name] = (shapes[name], dtype)
        if kv_fp8 and 0 < gi <= cfg.num_layers:
            out[f"layers.{gi - 1}.k_scale"] = ((), torch.float32)
            out[f"layers.{gi - 1}.v_scale"] = ((), torch.float32)
    return out


def _numel(source: SourceModel, name: str) -> int:
    """Elements of the source tensor ``name``: from the header's shapes where the source
    lists them, else read (scales are small)."""
    if source.tensor_shapes is not None and name in source.tensor_shapes:
        return math.prod(source.tensor_shapes[name])
    return source.get_tensor(name).numel()


def kv_warning(report: dict[str, Any], num_layers: int) -> str | None:
    """The loud warning text for missing or all-1.0 KV scales, or None."""
    if report.get("kv_missing"):
        return (
            f"FP8 KV cache: {report['kv_missing']}/{num_layers} layers have no k_scale/v_scale "
            "in the checkpoint; using 1.0. Values outside +-448 saturate and small ones lose "
            "precision: calibrate with `kiln quantize --kv-cache-dtype fp8`"
        )
    if report.get("kv_ones") == num_layers:
        return (
            "FP8 KV cache: every k_scale/v_scale is exactly 1.0, which looks uncalibrated; "
            "accuracy may suffer: calibrate with `kiln quantize --kv-cache-dtype fp8`"
        )
    return None
