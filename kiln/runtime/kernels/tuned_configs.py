"""The kernel launch configs installed in this process, which a kernel's wrapper asks at launch.

``kiln.runtime.kernels.tuning.install`` fills the table from engine.json when an engine loads
(configs tuned on this GPU when it was built); ``lookup`` is two dict lookups, None meaning
"use your default". This module imports no kernel: the kernels import it, and the tuning
machinery above them (tuning, tunables) writes it.
"""

from __future__ import annotations

_ACTIVE: dict[str, dict[str, dict]] = {}  # kernel -> key -> config


def lookup(kernel: str, key: str) -> dict | None:
    """The installed config of ``kernel`` for ``key``, or None (use the default)."""
    configs = _ACTIVE.get(kernel)
    return configs.get(key) if configs else None


def active() -> dict[str, dict[str, dict]]:
    """A copy of the configs installed in this process."""
    return {k: dict(v) for k, v in _ACTIVE.items()}


def clear() -> None:
    """Forget installed configs (every kernel uses its default)."""
    _ACTIVE.clear()


def set_configs(kernel: str, configs: dict[str, dict]) -> None:
    """Install ``configs`` (key -> config) as ``kernel``'s, replacing what it had."""
    _ACTIVE[kernel] = {str(k): dict(v) for k, v in configs.items()}
