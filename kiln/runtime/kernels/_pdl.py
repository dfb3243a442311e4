"""Programmatic dependent launch (PDL) for kiln's Triton kernels on Hopper and later.

A decode step is a chain of small kernels (a GEMV, the rotary/KV write, attention, a norm,
...). Normally each one starts only after the previous one has drained and its launch has
gone through the front end: a few microseconds of idle SMs at every boundary, about 300
boundaries per llama-3-8b step. With PDL (``launch_pdl=True``) a kernel is launched as soon
as every program of the kernel before it has called ``griddepcontrol.launch_dependents``; it
then waits (``griddepcontrol.wait``) before it reads or writes anything an earlier kernel
touches. What it may do before the wait: set up, and (the GEMV) prefetch its first weight
tiles into L2: no kernel writes weights.

The protocol every kiln kernel launched with ``launch_kwargs()`` follows (``PDL`` constexpr):

    [read-only weights, staged metadata only]  ->  gdc_wait()  ->  gdc_launch_dependents()
        ->  the work

Staged metadata (``STAGED_EARLY``) is what the host uploads before the step's kernels and no
kernel writes: query_start_loc, context_lens, the block table, positions, slots, and
constant tables (cos/sin). L2 prefetches (``prefetch_l2``) may name any address. Every
program waits, including those that then return at once, so a kernel completes only after
the one before it. tests/unit/test_pdl_protocol.py checks these rules on the source.

``gdc_wait`` returns once the previous kernel has completed and its writes are visible;
since that kernel waited for its own predecessor before completing, the wait covers every
earlier kernel in the stream. Kernels that are not ours (torch's) launch normally and are
full barriers. CUDA graph capture keeps the programmatic edges.

``KILN_PDL``: ``0`` off, ``1`` PDL, ``2`` (the default) PDL and, in the CUDA-core GEMV, an
L2 prefetch of the program's first two weight tiles before the wait. Replay ms, modes
0 / 1 / 2 (docs/decisions.md): llama-3-8b FP8 batch 1
2.98 / 2.82-2.85 / 2.80, bf16 4.34 / 4.13-4.16 / 4.16, smollm2 0.72 / 0.58-0.60 / 0.55.
PDL is off without CUDA capability 9.0, under ``TRITON_INTERPRET`` and where this triton
lacks ``launch_pdl``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from kiln.runtime import env

OFF, ON, PREFETCH = 0, 1, 2
_forced: int | None = None


@functools.cache
def supported() -> bool:
    """Whether this process can launch with PDL (Hopper+, compiled triton with the option)."""
    if env.triton_interpret():
        return False
    try:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
            return False
        # the CUDA backend is optional in a triton build: without it, no PDL
        from triton.backends.nvidia.compiler import CUDAOptions

        return ("launch_pdl" in CUDAOptions.__dataclass_fields__
                and hasattr(tl.extra.cuda, "gdc_wait"))
    except Exception:
        return False


def mode() -> int:
    """OFF, ON or PREFETCH: ``forced`` (benchmarks), else ``KILN_PDL`` (default PREFETCH;
    read once, by kiln/runtime/env.py)."""
    if not supported():
        return OFF
    if _forced is not None:
        return _forced
    return env.pdl_mode()


# Kernels that read the step's staged metadata (attention: query_start_loc, context_lens, the
# block table; rotary + KV write: positions, slots, and the constant cos/sin cache) read it
# before their wait: the host uploads it before the step's kernels and no kernel writes it.
# 8B FP8 batch-1 engine step: 2.654 -> 2.639 ms at contexts 129-256, 2.772 -> 2.749 at
# 1793-1920. A kernel lets the next one launch after its own wait, not before it: before
# it, the step went 2.751 -> 2.813 ms at 1793-1920 (docs/decisions.md).


def launch_kwargs() -> dict:
    """Keyword arguments for a kernel launch: the ``PDL`` constexpr, and ``launch_pdl``."""
    if mode() == OFF:
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


def staged_early() -> bool:
    """Whether kernels read the step's staged metadata before their PDL wait."""
    return mode() != OFF


@contextlib.contextmanager
def forced(m: int):
    """Launch with mode ``m`` inside the block (A/B benchmarks; graphs captured inside keep
    it). Ignored where PDL is not supported."""
    global _forced
    if m not in (OFF, ON, PREFETCH):
        raise ValueError(f"PDL mode {m!r} must be 0, 1 or 2")
    old, _forced = _forced, m
    try:
        yield
    finally:
        _forced = old


def prefetch() -> bool:
    """Whether the GEMV prefetches its weight slice into L2 before the wait (PREFETCH)."""
    return mode() == PREFETCH


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """Wait for the kernels before this one, then let the next kernel launch (see above)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(addr, ok):
    """Fire and forget: pull the line at each address where ``ok`` into L2 (PTX
    ``prefetch.global.L2``; no register waits for it). Safe before the wait on any address:
    L2 is the point of coherence, so a prefetched line is never stale. GPU only (inline PTX)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        constraints="=r,l,r", args=[addr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1)
