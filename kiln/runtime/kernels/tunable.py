"""What a tunable kernel is (``Tunable``), what it is tuned for (``TuneTarget``), and how one
call is timed (``time_cuda``): the vocabulary shared by the tuner (tuning.py) and the
built-in tunables (tunables.py). Importing this module does not import triton."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kiln.artifact.spec import Limits
    from kiln.config import ModelConfig


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


def torch_dtype(d: torch.dtype | str) -> torch.dtype:
    """``d`` as a torch dtype: a dtype, or its name (``fp8`` is float8_e4m3fn)."""
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
