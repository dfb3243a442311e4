"""Triton kernels for the CUDA runtime path, one module per kernel.

Each module holds the ``@triton.jit`` kernel, one checked wrapper (validates shapes, dtypes
and devices, raises ``ValueError`` naming the bad argument) and the torch reference beside
it. Importing this package does not import triton; import a kernel module only where
triton is installed (``kiln.runtime.kernels.available()`` says whether it is).

| module | wrapper | reference |
|---|---|---|
| paged_attention | ``paged_attention`` | ``paged_attention_ref`` |
| kv_write | ``reshape_and_cache`` | ``reshape_and_cache_ref`` |
| rms_norm | ``rms_norm`` / ``fused_add_rms_norm`` (``_fp8``: e4m3 output, static or per-token scales) | ``fused_add_rms_norm_ref`` |
| rotary | ``rotary_embedding_`` (in place) | ``rotary_embedding_ref`` |
| activation | ``silu_and_mul`` / ``silu_and_mul_fp8`` (e4m3 output, static or per-token scales) | ``silu_and_mul_ref`` |
| gemv | ``gemv`` (M <= 8 rows, tensor-core tiles up to 128; bf16/fp16 or FP8 W8A16 weights), ``gemv_add_rms_norm`` (one row, the add + RMSNorm as its prologue) | ``gemv_ref`` |
| fp8_quant | ``quantize_fp8_padded`` (static per-tensor or dynamic per-token scales) | ``quantize_fp8_padded_ref`` |
| sampling | ``sample_tokens`` (greedy argmax / Gumbel-max temperature sampling) | ``sample_tokens_ref`` |
| lookahead | ``lookahead_propose`` / ``lookahead_commit`` (a lookahead step's proposal; verification, n-gram inserts and window shift; one program per request) | ``DeviceLookahead`` (kiln/runtime/speculative/device_lookahead.py) |
| ngram | ``ngram_propose`` / ``ngram_commit`` (a prompt-lookup step's draft search over the request's tokens; chain verification and the history update; one program per request) | ``DeviceNgram`` (kiln/runtime/speculative/device_ngram.py) |

The GEMV is four files: gemv (the wrappers), gemv_kernel (the kernel and its launch),
gemv_tiles (its tile operations) and gemv_configs (launch configs and the routing rules,
no triton). Tuned launch configs: tuned_configs (the table a wrapper reads at launch),
tuning (tune at build, install at load), tunable / tunables (the built-in tunables).

Every kernel follows the programmatic-dependent-launch protocol of ``_pdl.py`` (checked by
tests/unit/test_pdl_protocol.py) and compiles for sm_90 on CPU-only machines
(tests/unit/test_kernels_compile_sm90.py).
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """Whether triton can be imported (the kernels need it; the torch path does not)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False
