"""The speculative worker of an engine, chosen by the mode recorded at build."""

from __future__ import annotations

from kiln.builder.speculative import SpeculativeConfig
from kiln.runtime.speculative.lookahead import LookaheadWorker, warm_layouts
from kiln.runtime.speculative.ngram import NgramWorker
from kiln.runtime.speculative.worker import DraftWorker


def make_worker(spec: SpeculativeConfig) -> DraftWorker | None:
    """The engine's speculative worker for its recorded mode (None: plain decoding)."""
    if spec.mode == "lookahead":
        warm_layouts(spec.lookahead)  # the engine's window; other windows build on first use
        return LookaheadWorker()
    if spec.mode == "ngram":
        return NgramWorker(spec.max_draft_len, spec.ngram_max_match, spec.ngram_min_match)
    return None
