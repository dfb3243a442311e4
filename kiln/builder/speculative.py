"""Speculative decoding settings recorded in engine.json (validated once, at build)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpeculativeConfig:
    """mode "none" | "lookahead" | "ngram". Lookahead records its (W, N, G) window."""

    mode: str = "none"
    max_draft_len: int = 0
    lookahead: tuple[int, int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.lookahead is not None:
            d["lookahead"] = list(self.lookahead)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        d = dict(d)
        if d.get("lookahead") is not None:
            d["lookahead"] = tuple(d["lookahead"])
        return cls(**d)
