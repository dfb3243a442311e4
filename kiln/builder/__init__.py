"""Engine spec, validation, weight preparation and the atomic engine writer."""

from __future__ import annotations

from kiln.builder.loader import EngineArtifact, load_engine
from kiln.builder.spec import ENGINE_FORMAT_VERSION, EngineSpec, Limits, QuantConfig
from kiln.builder.writer import build_engine

__all__ = [
    "ENGINE_FORMAT_VERSION",
    "EngineArtifact",
    "EngineSpec",
    "Limits",
    "QuantConfig",
    "build_engine",
    "load_engine",
]
