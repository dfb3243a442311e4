"""kiln: from a checkpoint to a fast OpenAI-compatible endpoint."""

from __future__ import annotations

__version__ = "0.1.0"
