"""The environment variables the runtime reads, and the one place it reads them. Those of
the toolchain around it (KILN_CACHE, KILN_DEBUG, KILN_PRECOMPILE_TIMEOUT_S) are in
kiln/env.py, which the sources and the CLI read without importing the runtime.

``RuntimeConfig``'s defaults (read when a config is made; an explicit field wins):

- ``KILN_ATTENTION_BACKEND``: ``auto`` (default: the Triton kernels on CUDA when triton
  imports, else the torch reference), ``torch``, ``triton`` or ``flash-attn`` (Triton, with
  flash-attn-4 for prompt steps when the package is installed).
- ``KILN_KV_LAYOUT``: ``HND`` (default: a KV block stores each head's tokens side by side)
  or ``NHD`` (each token's heads side by side; kiln/runtime/kv_cache.py).
- ``KILN_CUDA_GRAPHS``: ``0`` runs every step eagerly (default ``1``: decode, speculative
  and short steps replay CUDA graphs; CUDA and the triton backend only).
- ``KILN_PREFILL_GRAPHS``: ``0`` runs steps larger than the decode buckets eagerly (a
  shorter start-up; default ``1``: graphs for them too).
- ``KILN_ASYNC_SCHEDULING``: ``0`` waits for a step's tokens before scheduling the next one
  (default ``1``: the next decode step is launched first; same results).
- ``KILN_RESERVE_KV``: ``0`` admits a waiting request while its prompt fits the KV pool and
  preempts the newest when blocks run out (default ``1``: admission reserves the KV the
  running requests are expected to grow to; kiln/runtime/scheduler.py).
- ``KILN_ADAPTIVE_SPECULATION``: ``0`` always speculates (default ``1``: a request pauses
  speculation while it commits fewer tokens per step than the step costs; same results).
- ``KILN_DEVICE_SPECULATION``: ``1`` keeps greedy speculative requests' state on the
  device (lookahead: window and n-gram table; prompt lookup: the request's tokens) and
  drafts and verifies there, ``0`` keeps it in the host worker (same results). Unset: on
  for prompt-lookup engines on CUDA, off otherwise.

For these, unset means the default and ``0`` or an empty value means off.

The kernels (read once, at the first launch that asks, then kept):

- ``KILN_PDL``: programmatic dependent launch on Hopper: ``0`` off, ``1`` PDL, ``2``
  (default) PDL and the GEMV's L2 weight prefetch before its wait. Ignored where PDL is not
  supported; any other value is a ValueError at the first launch.
- ``TRITON_INTERPRET``: set and not ``0``: the kernels run in Triton's CPU interpreter
  (tests); triton itself reads it when the kernels are built, at import.

Tensor parallelism (read when a tensor-parallel engine starts):

- ``KILN_TP_HEARTBEAT_TIMEOUT_S``: seconds (a number >= 1) a rank may go without a
  heartbeat before rank 0 declares it hung and ends the engine (default 10;
  kiln/runtime/parallel/supervisor.py). Anything else is a ValueError at load.
- ``KILN_TP_BACKEND``: the model's collectives on CUDA, ``nccl`` (default) or ``gloo``
  (several ranks may share a GPU: tests on one GPU; eager, no CUDA graphs). Anything else
  is a ValueError at load.

Tests that change one of the cached two call ``pdl_mode.cache_clear()`` /
``triton_interpret.cache_clear()``.
"""

from __future__ import annotations

import functools
import os

PDL_MODES = ("0", "1", "2")  # off, PDL, PDL and the GEMV weight prefetch
PDL_DEFAULT = "2"
# well inside gloo's 30 s collective timeout, far above a beat's 0.5 s interval
TP_HEARTBEAT_TIMEOUT_S = 10.0


def env_flag(name: str, default: bool) -> bool:
    """``name`` as a switch: unset gives ``default``; ``0`` or empty is False, else True."""
    raw = os.environ.get(name)
    return default if raw is None else raw not in ("0", "")


def env_flag_or_none(name: str) -> bool | None:
    """``env_flag`` with no default: None where ``name`` is unset (the caller decides)."""
    raw = os.environ.get(name)
    return None if raw is None else raw not in ("0", "")


def env_str(name: str, default: str) -> str:
    """``name``'s value, or ``default`` where it is unset."""
    return os.environ.get(name, default)


def kv_layout() -> str:
    """``KILN_KV_LAYOUT`` (default ``HND``): the KV cache layout engines run, which the
    build-time attention measurements time too."""
    return env_str("KILN_KV_LAYOUT", "HND")


@functools.cache
def triton_interpret() -> bool:
    """Whether the Triton kernels run in the CPU interpreter (``TRITON_INTERPRET``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def pdl_mode() -> int:
    """``KILN_PDL`` as 0, 1 or 2 (default 2); anything else is a ValueError (not cached)."""
    raw = os.environ.get("KILN_PDL", PDL_DEFAULT).strip()
    if raw not in PDL_MODES:
        raise ValueError(f"KILN_PDL={raw!r} must be 0 (off), 1 (PDL) or 2 (PDL and the "
                         "GEMV weight prefetch)")
    return int(raw)


def tp_heartbeat_timeout_s() -> float:
    """``KILN_TP_HEARTBEAT_TIMEOUT_S`` (seconds, >= 1), else ``TP_HEARTBEAT_TIMEOUT_S``;
    ValueError for any other value."""
    raw = os.environ.get("KILN_TP_HEARTBEAT_TIMEOUT_S")
    if raw is None:
        return TP_HEARTBEAT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 1:
        raise ValueError(f"KILN_TP_HEARTBEAT_TIMEOUT_S={raw!r} is not a number of seconds >= 1 "
                         "(a rank beats every 0.5 s); set it to e.g. "
                         f"{TP_HEARTBEAT_TIMEOUT_S:g}, or unset it")
    return value


def tp_backend() -> str:
    """``KILN_TP_BACKEND`` (``nccl`` or ``gloo``), else ``nccl``; ValueError otherwise."""
    name = os.environ.get("KILN_TP_BACKEND", "").strip().lower() or "nccl"
    if name not in ("nccl", "gloo"):
        raise ValueError(f"KILN_TP_BACKEND={name!r}: expected nccl (the default) or gloo")
    return name
