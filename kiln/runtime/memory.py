"""A process's memory high-water marks, as benchmarks report them per rank.

``peak_rss_bytes``: the process's peak resident set (weights, KV cache, activations and the
interpreter, on any device): Linux's VmHWM, the high-water mark of this process image. Not
``getrusage``'s ru_maxrss, which keeps the peak from before an exec: a tp-2 follower started
by a 500 MB test process (fork, then exec) reported 528 MB there against its own 248 MB.
``device_peak_bytes``: on CUDA, the most the caching allocator handed out on this process's
device (``max_memory_allocated``), else None. A tensor-parallel engine gathers every rank's
(``LLMEngine.memory_by_rank``).
"""

from __future__ import annotations

import re
import resource
import sys
from pathlib import Path

import torch


def peak_memory(device: torch.device | str) -> dict:
    """This process's peak memory (see the module docstring); ``device``: where its engine
    runs."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda": the current one, by number
        device = torch.device("cuda", torch.cuda.current_device())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"device": str(device), "peak_rss_bytes": peak_rss_bytes(), "device_peak_bytes": peak}


def peak_rss_bytes() -> int:
    """This process image's peak resident set: VmHWM where /proc has it, else ru_maxrss."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        status = ""
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    if found:
        return int(found.group(1)) * 1024
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB elsewhere
