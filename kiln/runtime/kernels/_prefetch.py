"""L2 prefetch hints for read-only weights, issued before a kernel's PDL wait.

Under programmatic dependent launch (``_pdl``) a kernel's programs become resident while the
kernel before it still runs; until ``pdl_begin`` returns they may touch only memory no kernel
of the step writes: the weights. A hint (PTX ``prefetch.global.L2``, one per 128-byte line)
starts the DRAM stream of a weight the step reads next while the device is busy with short,
latency-bound kernels (attention, norms), so the GEMV that follows finds its first bytes in
L2. Fire and forget: nothing waits for a hint, and a hint never changes what is computed.
GPU only (inline PTX): the CPU interpreter runs kernels with the hints switched off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE_BYTES = 128  # one hint per L2 line


@triton.jit
def _prefetch_l2(addr, ok):
    """Pull the line at each address where ``ok`` into L2 (no register waits for it)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        constraints="=r,l,r", args=[addr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1)


@triton.jit
def _prefetch_span(base_ptr, num_lines, part, num_parts, NT: tl.constexpr):
    """Program ``part`` of ``num_parts`` hints its share of the ``num_lines`` 128-byte lines
    from ``base_ptr`` (a uint8 pointer), NT lines per round (NT = the program's threads)."""
    per = tl.cdiv(num_lines, num_parts)
    lo = part * per
    hi = tl.minimum(lo + per, num_lines)
    offs = tl.arange(0, NT)
    for line in range(lo, hi, NT):
        idx = line + offs
        _prefetch_l2(base_ptr + idx.to(tl.int64) * 128, idx < hi)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (what ``_prefetch_span`` walks)."""
    return t.reshape(-1).view(torch.uint8)


def span_lines(b: torch.Tensor) -> int:
    """How many 128-byte lines hold the flat uint8 tensor ``b``."""
    return triton.cdiv(b.numel(), LINE_BYTES)
