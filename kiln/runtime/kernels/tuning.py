"""Kernel launch configs: tuned once at build, recorded in engine.json, installed at load.

A ``Tunable`` describes one kernel: the problems an engine runs (shapes from its model and
limits), a stable key per problem (what the kernel's wrapper looks up at launch), the
candidate launch configs, a runner (one call's output) and a timer. ``tune`` picks, per key,
the fastest candidate whose output matches the kernel's default config on the same inputs
(a tuned config never changes results beyond rounding) and returns the engine.json section;
``install`` makes a section's configs active in this process; ``lookup`` is what a wrapper
calls at launch (two dict lookups; None means "use your default").

engine.json "kernel_configs"::

    {"tuned": true, "gpu": "NVIDIA H200", "capability": [9, 0], "triton": "3.6.0",
     "torch": "2.11.0+cu130", "tuned_at": "2026-11-30", "tune_s": 21.4,
     "configs": {kernel: {key: config}},          # what lookup returns
     "stats": {kernel: {key: {"default_us", "best_us", "speedup", "candidates"}}},
     "skipped": {kernel: n}, "rejected": {kernel: n}}   # failed to run / output differed

or ``{"tuned": false, "reason": "..."}``. Importing this module does not import triton.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kiln.builder.spec import Limits
    from kiln.config import ModelConfig

# A non-default candidate must beat the default by this factor (geometric mean over the
# key's problems) to be chosen: timing noise never flips a config.
WIN_MARGIN = 0.97
# Output tolerances per dtype (rtol, atol as a fraction of max |default output|): a couple
# of ulps, so a different accumulation order passes and a wrong result does not.
TOLERANCES = {torch.bfloat16: (2**-7, 2**-8), torch.float16: (2**-10, 2**-11),
              torch.float32: (1e-4, 1e-5)}


@dataclass(frozen=True)
class TuneTarget:
    """What one engine runs: everything a Tunable needs to list its problems."""

    model: ModelConfig
    limits: Limits
    dtype: torch.dtype
    kv_dtype: torch.dtype | None = None  # None: the engine dtype
    weights_fp8: bool = False
    tokens_per_step: int = 1  # > 1 with speculative decoding (1 + max_draft_len)
    tree_mask: bool = False  # speculative steps use a tree mask (lookahead)
    lm_head_fp8: bool = False  # the lm_head is FP8 (kiln build --quantize-lm-head)

    @property
    def kv(self) -> torch.dtype:
        return self.kv_dtype or self.dtype


@dataclass(frozen=True)
class Tunable:
    """One tunable kernel. Problems and configs are JSON-able dicts.

    ``problems(target)`` lists the shapes to tune (several may share a key: the winner is
    best over all of them); ``key(problem)`` is the string the wrapper looks up;
    ``candidates(problem)`` the configs to try; ``default(problem)`` what the wrapper uses
    untuned; ``run(problem, config, device)`` one call's output on seeded inputs (the same
    inputs every time); ``bench(problem, config, device)`` seconds per call (warmup, CUDA
    events, median). ``release()`` frees cached inputs; ``devices``: device types it tunes on.
    """

    name: str
    problems: Callable[[TuneTarget], list[dict]]
    key: Callable[[dict], str]
    candidates: Callable[[dict], list[dict]]
    bench: Callable[[dict, dict, torch.device], float]
    default: Callable[[dict], dict]
    run: Callable[[dict, dict, torch.device], torch.Tensor]
    devices: tuple[str, ...] = ("cuda",)
    release: Callable[[], None] | None = None


_REGISTRY: dict[str, Tunable] = {}
_ACTIVE: dict[str, dict[str, dict]] = {}
_WARNED: set[str] = set()


def register(t: Tunable) -> None:
    """Add (or replace) a tunable kernel by name."""
    _REGISTRY[t.name] = t


def registered() -> dict[str, Tunable]:
    """The registered tunables, built-in ones (paged_attention, gemv if present) included."""
    _load_builtins()
    return dict(_REGISTRY)


def lookup(kernel: str, key: str) -> dict | None:
    """The installed config of ``kernel`` for ``key``, or None (use the default)."""
    configs = _ACTIVE.get(kernel)
    return configs.get(key) if configs else None


def active() -> dict[str, dict[str, dict]]:
    """A copy of the configs installed in this process."""
    return {k: dict(v) for k, v in _ACTIVE.items()}


def clear() -> None:
    """Forget installed configs (every kernel uses its default)."""
    _ACTIVE.clear()


def device_identity(device: torch.device | str) -> dict[str, Any]:
    """GPU name, compute capability, triton and torch versions of ``device``."""
    device = torch.device(device)
    try:
        import triton

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
    _ACTIVE.clear()
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
        _ACTIVE[kernel] = {str(k): dict(v) for k, v in configs.items()}


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
    target = TuneTarget(model, limits, _dtype(dtype), _dtype(kv_dtype) if kv_dtype else None,
                        weights_fp8, tokens_per_step, tree_mask, lm_head_fp8)
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
    except Exception as e:  # noqa: BLE001 - the default itself fails: leave the key untuned
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
        except Exception:  # noqa: BLE001 - does not compile / launch: skip it
            n_skip += 1
        tick(label)
    stat = {"default_us": [round(b * 1e6, 2) for b in base],
            "best_us": [round(b * 1e6, 2) for b in best_times],
            "speedup": round(1.0 / best_score, 3), "candidates": len(candidates)}
    return best, stat, n_skip, n_rej


def _dtype(d: torch.dtype | str) -> torch.dtype:
    if isinstance(d, torch.dtype):
        return d
    dt = getattr(torch, {"fp8": "float8_e4m3fn"}.get(d, d), None)
    if isinstance(dt, torch.dtype):
        return dt
    raise ValueError(f"unknown dtype {d!r}; use e.g. bfloat16, float16, float32 or fp8")


def time_cuda(fn: Callable[[int], Any], device: torch.device, variants: int = 1,
              reps: int = 15) -> float:
    """Seconds per call of ``fn(i)`` (i cycles over ``variants`` input copies, so a shape
    that fits in L2 is not timed hot): the calls are captured in a CUDA graph (no launch
    overhead in the number) and replayed; CUDA events; median of ``reps`` replays."""
    n = variants * max(1, -(-16 // variants))
    fn(0)  # compile and warm up outside the graph
    torch.cuda.synchronize(device)

    def eager() -> None:
        for i in range(n):
            fn(i % variants)

    replay = eager
    stream = torch.cuda.Stream(device)
    try:
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            eager()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            eager()
        replay = graph.replay
    except RuntimeError:
        torch.cuda.synchronize(device)
    for _ in range(2):
        replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / n)
    return statistics.median(times)


_BUILTINS_LOADED = False


def _load_builtins() -> None:
    """Register paged_attention and gemv (each only when its module imports)."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    from kiln.runtime.kernels import tunables

    try:
        _REGISTRY.setdefault("paged_attention", tunables.paged_attention_tunable())
    except ImportError:  # no triton: nothing to tune
        pass
    gemv_t = tunables.gemv_tunable()
    if gemv_t is not None:
        _REGISTRY.setdefault("gemv", gemv_t)
