"""Kernel launch configs: tuned once at build, recorded in engine.json, installed at load.

A ``Tunable`` (kiln/runtime/kernels/tunable.py) describes one kernel: the problems an engine
runs, a stable key per problem (what the kernel's wrapper looks up at launch), the candidate
launch configs, a runner and a timer. ``tune`` picks, per key, the fastest candidate whose
output matches the kernel's default config on the same inputs (a tuned config never changes
results beyond rounding) and returns the engine.json section; ``install`` makes a section's
configs the active ones in this process (kiln/runtime/kernels/tuned_configs.py, where a
wrapper's ``lookup`` finds them at launch).

engine.json "kernel_configs"::

    {"tuned": true, "gpu": "NVIDIA H200", "capability": [9, 0], "triton": "3.6.0",
     "torch": "2.11.0+cu130", "tuned_at": "2026-11-30", "tune_s": 21.4,
     "configs": {kernel: {key: config}},          # what lookup returns
     "stats": {kernel: {key: {"default_us", "best_us", "speedup", "candidates"}}},
     "skipped": {kernel: n}, "rejected": {kernel: n}}   # failed to run / output differed

or ``{"tuned": false, "reason": "..."}``. The tunables are the built-in ones
(kiln/runtime/kernels/tunables.py: paged_attention, gemv) and those given to ``register``.
Importing this module does not import triton (an engine installs its configs on any machine).
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kiln.runtime.kernels import tuned_configs
from kiln.runtime.kernels.tunable import Tunable, TuneTarget, torch_dtype
from kiln.runtime.kernels.tuned_configs import active, clear, lookup

if TYPE_CHECKING:
    from kiln.artifact.spec import Limits
    from kiln.config import ModelConfig

__all__ = ["Tunable", "TuneTarget", "active", "clear", "close", "device_identity", "install",
           "lookup", "num_configs", "register", "registered", "tune", "untuned"]

# A non-default candidate must beat the default by this factor (geometric mean over the
# key's problems) to be chosen: timing noise never flips a config.
WIN_MARGIN = 0.97
# Output tolerances per dtype (rtol, atol as a fraction of max |default output|): a couple
# of ulps, so a different accumulation order passes and a wrong result does not.
TOLERANCES = {torch.bfloat16: (2**-7, 2**-8), torch.float16: (2**-10, 2**-11),
              torch.float32: (1e-4, 1e-5)}

_REGISTRY: dict[str, Tunable] = {}
_WARNED: set[str] = set()


def register(t: Tunable) -> None:
    """Add (or replace) a tunable kernel by name; it wins over a built-in of that name."""
    _REGISTRY[t.name] = t


def registered() -> dict[str, Tunable]:
    """The tunables ``tune`` runs: the built-in ones (none without triton), then those
    registered."""
    return {**_builtins(), **_REGISTRY}


@functools.cache
def _builtins() -> dict[str, Tunable]:
    try:  # the built-ins import their Triton kernels: triton is an optional dependency
        from kiln.runtime.kernels.tunables import BUILTINS
    except ImportError:  # no triton: nothing to tune
        return {}
    return {t.name: t for t in BUILTINS}


def device_identity(device: torch.device | str) -> dict[str, Any]:
    """GPU name, compute capability, triton and torch versions of ``device``."""
    device = torch.device(device)
    try:
        import triton  # optional: its version only

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        capability: list[int] | None = list(torch.cuda.get_device_capability(device))
    else:
        gpu, capability = f"cpu ({platform.machine() or 'unknown'})", None
    return {"gpu": gpu, "capability": capability, "triton": triton_version,
            "torch": torch.__version__}


def _major_minor(version: str | None) -> str:
    return ".".join(str(version or "?").split(".")[:2])


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)


def install(section: dict | None, device: torch.device | str) -> None:
    """Make ``section``'s configs the active ones for kernels launched in this process.

    No section, an untuned one or a non-CUDA device: defaults. A section tuned on another
    GPU, or with another triton major.minor, warns once (one line naming both) and leaves
    the defaults in place.
    """
    tuned_configs.clear()
    if not section or not section.get("tuned"):
        return
    device = torch.device(device)
    if device.type != "cuda":
        return
    here = device_identity(device)
    there_t, here_t = _major_minor(section.get("triton")), _major_minor(here["triton"])
    if section.get("gpu") != here["gpu"] or there_t != here_t:
        _warn_once(
            f"kernel configs in engine.json were tuned on {section.get('gpu')} (triton "
            f"{there_t}) but this is {here['gpu']} (triton {here_t}); using default kernel "
            "configs (rebuild the engine on this GPU to tune it)")
        return
    for kernel, configs in (section.get("configs") or {}).items():
        tuned_configs.set_configs(kernel, configs)


def untuned(reason: str) -> dict[str, Any]:
    """The section of an engine built without tuning."""
    return {"tuned": False, "reason": reason}


def num_configs(section: dict | None) -> int:
    """How many tuned configs a section holds (over all kernels)."""
    return sum(len(v) for v in ((section or {}).get("configs") or {}).values())


# ---- tuning ----------------------------------------------------------------------------


def close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether ``out`` equals ``ref`` up to rounding (finite, allclose at dtype tolerance)."""
    if out.shape != ref.shape or not bool(torch.isfinite(out).all()):
        return False
    rtol, atol = TOLERANCES.get(ref.dtype, TOLERANCES[torch.float32])
    ref32 = ref.float()
    scale = float(ref32.abs().max()) if ref32.numel() else 0.0
    return bool(torch.allclose(out.float(), ref32, rtol=rtol, atol=atol * scale + 1e-30))


def _dedup(configs: Sequence[dict]) -> list[dict]:
    seen: set[str] = set()
    out = []
    for c in configs:
        k = json.dumps(c, sort_keys=True)
        if k not in seen:
            seen.add(k)
            out.append(c)
    return out


def tune(
    model: ModelConfig, limits: Limits, dtype: torch.dtype | str, device: torch.device | str,
    progress: Callable[[str, int, int], None] | None = None, *,
    kv_dtype: torch.dtype | str | None = None, weights_fp8: bool = False,
    tokens_per_step: int = 1, tree_mask: bool = False, kernels: Sequence[str] | None = None,
    lm_head_fp8: bool = False,
) -> dict[str, Any]:
    """Tune every registered kernel (or those named in ``kernels``) that runs on ``device``
    for this engine's shapes; returns the engine.json section.

    ``progress(description, done, total)`` is called after each candidate. A candidate that
    raises (does not compile or launch) is skipped; one whose output differs from the
    default config's is rejected; neither is fatal.
    """
    device = torch.device(device)
    kv = torch_dtype(kv_dtype) if kv_dtype else None
    target = TuneTarget(model, limits, torch_dtype(dtype), kv, weights_fp8, tokens_per_step,
                        tree_mask, lm_head_fp8)
    t0 = time.perf_counter()
    plan: list[tuple[Tunable, str, list[dict], list[dict]]] = []
    for name, t in registered().items():
        if (kernels is not None and name not in kernels) or device.type not in t.devices:
            continue
        groups: dict[str, list[dict]] = {}
        for p in t.problems(target):
            groups.setdefault(t.key(p), []).append(p)
        for key, ps in groups.items():
            plan.append((t, key, ps, _dedup([t.default(ps[0]), *t.candidates(ps[0])])))
    total = sum(len(c) for *_, c in plan)
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(label, done, total)

    configs: dict[str, dict[str, dict]] = {}
    stats: dict[str, dict[str, dict]] = {}
    skipped: dict[str, int] = {}
    rejected: dict[str, int] = {}
    for i, (t, key, ps, cands) in enumerate(plan):
        best, stat, n_skip, n_rej = _tune_key(t, key, ps, cands, device, tick)
        skipped[t.name] = skipped.get(t.name, 0) + n_skip
        rejected[t.name] = rejected.get(t.name, 0) + n_rej
        stats.setdefault(t.name, {})[key] = stat
        if best is not None:
            configs.setdefault(t.name, {})[key] = best
        last_of_kernel = i + 1 == len(plan) or plan[i + 1][0] is not t
        if last_of_kernel and t.release is not None:
            t.release()
    return {
        "tuned": True, **device_identity(device),
        "tuned_at": datetime.date.today().isoformat(),
        "tune_s": round(time.perf_counter() - t0, 2),
        "configs": configs, "stats": stats, "skipped": skipped, "rejected": rejected,
    }


def _tune_key(
    t: Tunable, key: str, problems: list[dict], candidates: list[dict], device: torch.device,
    tick: Callable[[str], None],
) -> tuple[dict | None, dict, int, int]:
    """(winning config or None, stats, skipped, rejected) for one key; candidates[0] is the
    default, whose output is the reference."""
    label = f"{t.name} {key}"
    default = candidates[0]
    try:
        refs = [t.run(p, default, device) for p in problems]
        base = [t.bench(p, default, device) for p in problems]
    except Exception as e:
        for _ in candidates:
            tick(label)
        return None, {"error": f"default config failed: {type(e).__name__}: {e}"[:300]}, \
            len(candidates), 0
    tick(label)
    best, best_score, best_times = default, 1.0, base
    n_skip = n_rej = 0
    for cand in candidates[1:]:
        try:
            times = []
            for p, ref in zip(problems, refs):
                if not close(t.run(p, cand, device), ref):
                    n_rej += 1
                    break
                times.append(t.bench(p, cand, device))
            else:
                score = math.exp(statistics.fmean(
                    math.log(max(x, 1e-12) / max(b, 1e-12)) for x, b in zip(times, base)))
                if score < WIN_MARGIN and score < best_score:
                    best, best_score, best_times = cand, score, times
        except Exception:
            n_skip += 1
        tick(label)
    stat = {"default_us": [round(b * 1e6, 2) for b in base],
            "best_us": [round(b * 1e6, 2) for b in best_times],
            "speedup": round(1.0 / best_score, 3), "candidates": len(candidates)}
    return best, stat, n_skip, n_rej
