"""Build an engine: validate, prepare the weights, write the directory atomically.

What an engine is (engine.json's spec, the weight names, the directory layout, the loader)
is kiln.artifact's, which the runtime reads without importing this package.
"""

from __future__ import annotations

from kiln.builder.writer import build_engine

__all__ = ["build_engine"]
