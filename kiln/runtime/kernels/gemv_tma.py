"""Experiment: a one-row GEMV whose weight tiles arrive by TMA (tensor descriptors), with the
K loop software-pipelined by Triton (``num_stages`` tiles in flight per program in shared
memory, not registers). y [1, N] = x [1, K] @ (W [N, K] * scale)^T, bf16 or FP8 e4m3 W."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._pdl import pdl_begin


@triton.jit
def _gemv_tma_kernel(x_ptr, w_desc, scale_ptr, y_ptr, N, K,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                     HAS_SCALE: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    pdl_begin(PDL)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for kk in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = w_desc.load([pid * BLOCK_N, kk])
        xv = tl.load(x_ptr + kk + offs_k, mask=kk + offs_k < K, other=0.0)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:
        y = y * tl.load(scale_ptr)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def gemv_tma(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
             block_n: int = 16, block_k: int = 256, stages: int = 4,
             num_warps: int = 4) -> torch.Tensor:
    """x [1, K] bf16, weight [N, K] contiguous (bf16 or e4m3 with its scale); y [1, N]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n, k = weight.shape
    desc = TensorDescriptor(weight, shape=[n, k], strides=[k, 1], block_shape=[block_n, block_k])
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    fp8 = weight_scale is not None
    _gemv_tma_kernel[(triton.cdiv(n, block_n),)](
        x, desc, weight_scale if fp8 else y, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=stages, HAS_SCALE=fp8, num_warps=num_warps, **_pdl.launch_kwargs())
    return y
