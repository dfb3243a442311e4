"""The attention backends by name: ``get_backend(name)``.

``"torch"``: the plain-torch reference (attention.py), the oracle every kernel is checked
against and the CPU backend. ``"triton"``: the Triton kernels over the paged cache
(triton_attention.py; CUDA, or Triton's CPU interpreter in tests). ``"flash-attn"``:
Triton with flash-attn-4 for the step classes it won at build (flash_attention.py; an
optional package). Which one an engine runs is ``RuntimeConfig.attention_backend``
(``KILN_ATTENTION_BACKEND``, kiln/runtime/env.py); "auto" takes engine.json ``attention``
(measured at build, attention_select.py) on CUDA and is resolved at start-up
(kiln/runtime/startup.py).
"""

from __future__ import annotations

from kiln.runtime.layers.attention import AttentionBackend, TorchAttention
from kiln.runtime.layers.flash_attention import FlashAttention
from kiln.runtime.layers.triton_attention import TritonAttention

BACKENDS: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttention, "triton": TritonAttention, "flash-attn": FlashAttention}
# Backends built on the Triton kernels: the fused norm / rotary / activation kernels, staged
# inputs and CUDA graphs go with them.
TRITON_BACKENDS = ("triton", "flash-attn")


def get_backend(name: str, classes: dict[str, str] | None = None) -> AttentionBackend:
    """A new instance of the backend ``name``; an unknown name is a ValueError listing the
    valid ones. ``classes``: the step class → backend map an engine recorded at build
    (attention_select.py); flash-attn then runs the classes it won, Triton the rest."""
    if name == "flash-attn" and classes is not None:
        won = tuple(c for c, b in classes.items() if b == "flash-attn")
        return FlashAttention(classes=won or ("prompt",))
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"attention backend {name!r} is unknown; choose one of {sorted(BACKENDS)}"
        ) from None
