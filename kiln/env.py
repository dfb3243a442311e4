"""The environment variables the toolchain outside the runtime reads (sources, builder, CLI),
and the one place it reads them. The runtime's own (attention backend, CUDA graphs, PDL,
...) are in kiln/runtime/env.py; this module imports nothing of kiln but its errors, so
``kiln.sources`` and the CLI read these without importing the runtime.

- ``KILN_CACHE``: the folder kiln caches downloads and built engines in (the built-in
  model's GGUF file, ``engines/`` for sources that serve / generate / bench build once).
  Unset or empty: ``~/.cache/kiln``. ``~`` is expanded.
- ``KILN_DEBUG``: ``1``, ``true``, ``yes`` or ``on`` (any case): an error shows its full
  traceback, as with ``kiln --debug`` (which sets it to ``1`` for the rest of the process).
  Anything else, or unset: errors are one line.
- ``KILN_PRECOMPILE_TIMEOUT_S``: seconds (a number > 0) after which the kernel
  precompilation of ``kiln build`` (the engine's first start, in a subprocess) is stopped;
  the engine is then built without shipped kernels. Unset: ``PRECOMPILE_TIMEOUT_S``.
  Anything else fails the build before any weight is read.
"""

from __future__ import annotations

import os
from pathlib import Path

from kiln.errors import KilnError

DEBUG = "KILN_DEBUG"
_DEBUG_ON = ("1", "true", "yes", "on")
# An 8B engine's first start took 17-20 s on the H200: the limit only stops a start that hangs.
PRECOMPILE_TIMEOUT_S = 900.0


def cache_dir() -> Path:
    """``$KILN_CACHE``, default ``~/.cache/kiln``."""
    return Path(os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln").expanduser()


def debug_enabled() -> bool:
    """Whether ``KILN_DEBUG`` asks for tracebacks."""
    return os.environ.get(DEBUG, "").strip().lower() in _DEBUG_ON


def enable_debug() -> None:
    """``kiln --debug``: tracebacks for the rest of this process (and its subprocesses)."""
    os.environ[DEBUG] = "1"


def precompile_timeout_s() -> float:
    """``KILN_PRECOMPILE_TIMEOUT_S`` (seconds, > 0), else ``PRECOMPILE_TIMEOUT_S``;
    KilnError for any other value."""
    raw = os.environ.get("KILN_PRECOMPILE_TIMEOUT_S")
    if raw is None:
        return PRECOMPILE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise KilnError(f"KILN_PRECOMPILE_TIMEOUT_S={raw!r} is not a number of seconds > 0; "
                        f"set it to e.g. {PRECOMPILE_TIMEOUT_S:g}, or unset it")
    return value
