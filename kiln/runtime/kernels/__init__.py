"""Triton kernels for the CUDA runtime path, one module per kernel.

Each module holds the ``@triton.jit`` kernel, one checked wrapper (validates shapes, dtypes
and devices, raises ``ValueError`` naming the bad argument) and the torch reference beside
it. Importing this package does not import triton; import a kernel module only where
triton is installed (``kiln.runtime.kernels.available()`` says whether it is).

| module | wrapper | reference |
|---|---|---|
| paged_attention | ``paged_attention`` | ``paged_attention_ref`` |
| kv_write | ``reshape_and_cache`` | ``reshape_and_cache_ref`` |
| rms_norm | ``rms_norm`` / ``fused_add_rms_norm`` | ``fused_add_rms_norm_ref`` |
| rotary | ``rotary_embedding_`` (in place) | ``rotary_embedding_ref`` |
| activation | ``silu_and_mul`` | ``silu_and_mul_ref`` |
| gemv | ``gemv`` (M <= 8 rows; bf16/fp16 or FP8 W8A16 weights) | ``gemv_ref`` |
| fp8_quant | ``quantize_fp8_padded`` (static or dynamic scale) | ``quantize_fp8_padded_ref`` |
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """Whether triton can be imported (the kernels need it; the torch path does not)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False
