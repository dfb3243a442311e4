"""SiLU-and-mul on the fused gate_up projection: [T, 2I] → silu(gate) * up, [T, I]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.runtime.kernels import _pdl
from kiln.runtime.kernels._checks import FLOAT_DTYPES, check_tensor
from kiln.runtime.kernels._pdl import pdl_begin


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, inter, stride_xt, stride_ot, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    gate = tl.load(x_ptr + t * stride_xt + offs, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + inter + offs, mask=m, other=0.0).to(tl.float32)
    # Same rounding as the eager path: silu rounded to the input dtype, then the product.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs, (act * up).to(out_ptr.dtype.element_ty), mask=m)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] (gate then up halves) → [T, I] = silu(gate) * up, in x's dtype."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] % 2:
        raise ValueError(f"x has {x.shape[1]} columns; gate_up needs an even count (2 * I)")
    t, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(t, inter, dtype=x.dtype, device=x.device)
    check_tensor("out", out, ndim=2, dtypes=(x.dtype,), device=x.device)
    if tuple(out.shape) != (t, inter):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(t, inter)}")
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), out.stride(0), BLOCK=block, num_warps=4,
        **_pdl.launch_kwargs(),
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The eager formulation in kiln/runtime/models/llama.py."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
