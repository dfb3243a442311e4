"""``kiln quantize``: modelopt FP8 calibration and export (see modelopt_fp8.py)."""

from __future__ import annotations

from kiln.quantize.modelopt_fp8 import MODELOPT_VERSION, quantize

__all__ = ["MODELOPT_VERSION", "quantize"]
