"""flash-attn-4 backend: the flash-attention project's CuTe-DSL kernels (Hopper) for steps of
prompt tokens, over kiln's paged cache as it is; kiln's Triton kernels for everything else.

Named ``"flash-attn"`` in attention_registry.py (``KILN_ATTENTION_BACKEND=flash-attn``). The
package (``pip install 'kiln-llm[flash-attn]'``) is imported on first use; without it, or for
a step it cannot take, the Triton kernels run, after one log line. flash-attn-4 reads the
cache layout kiln writes ([blocks, block_size, kv_heads, head_dim], any block size) through
``page_table`` = the step's block tables and ``seqused_k`` = its context lengths; its causal
mask is aligned to the end of the keys, as kiln's in-step mask is.

Which steps it takes: the step classes a build measured it faster on (engine.json
``attention``, kiln/runtime/layers/attention_select.py), by default prompts and prompt
chunks beside decodes (2.7x faster than Triton at 8000 tokens on the H200, docs/decisions.md
"flash-attn-4 over kiln's paged cache"), never under CUDA-graph capture. Decode (one query
token) and speculative tree steps stay on Triton, which matches or beats it at decode and
runs inside the decode graphs; flash-attn-4 has no tree masks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from kiln.runtime.layers.attention import step_class
from kiln.runtime.layers.triton_attention import TritonAttention

log = logging.getLogger("kiln.attention")

HEAD_DIMS = (64, 96, 128, 192, 256)  # flash-attn-4's SM90 forward kernels
DTYPES = (torch.bfloat16, torch.float16)


def _import() -> Callable[..., Any] | None:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as e:  # an absent or broken install: Triton runs instead
        log.warning("attention backend flash-attn: flash-attn-4 is not usable (%s: %s); "
                    "using the Triton kernels (pip install 'kiln-llm[flash-attn]')",
                    type(e).__name__, e)
        return None
    return flash_attn_varlen_func


class FlashAttention(TritonAttention):
    """TritonAttention whose steps of the step classes ``classes`` (attention_select.py:
    "prompt" by default, the class flash-attn-4 wins; a build's measurement decides per
    engine) run flash-attn-4's varlen paged forward."""

    name = "flash-attn"

    def __init__(self, varlen: Callable[..., Any] | None = None,
                 classes: tuple[str, ...] = ("prompt",)) -> None:
        super().__init__()
        self.varlen = varlen if varlen is not None else _import()
        self.classes = tuple(classes)

    def takes(self, q: torch.Tensor, kc: torch.Tensor, dm: Any) -> bool:
        """Whether flash-attn-4 runs this step: a CUDA step of one of ``classes`` (never a
        tree-masked one), 16-bit q and cache, a head size it has kernels for, not under
        CUDA-graph capture (it compiles on first use and launches from the host)."""
        return (self.varlen is not None and q.is_cuda and dm.mask is None
                and step_class(dm) in self.classes and q.dtype in DTYPES
                and kc.dtype == q.dtype and q.shape[-1] in HEAD_DIMS
                and not torch.cuda.is_current_stream_capturing())

    def flash(self, q, kc, vc, dm, scale):
        """flash-attn-4 over the paged cache: causal, aligned to the end of the keys."""
        out = self.varlen(
            q, kc, vc, cu_seqlens_q=dm.query_start_loc, max_seqlen_q=dm.max_query_len,
            seqused_k=dm.context_lens, page_table=dm.block_tables, softmax_scale=scale,
            causal=True)
        return out[0] if isinstance(out, tuple) else out

    def _attend(self, q, kc, vc, dm, scale, k_scale, v_scale):
        if self.takes(q, kc, dm):
            try:
                return self.flash(q, kc, vc, dm, scale)
            except Exception as e:  # a shape it refuses: Triton from now on, said once
                log.warning("attention backend flash-attn: flash-attn-4 failed on a step "
                            "(%s: %s); using the Triton kernels from now on",
                            type(e).__name__, e)
                self.varlen = None
        return TritonAttention._attend(q, kc, vc, dm, scale, k_scale, v_scale)
