"""Structured output: the per-request grammar interface the engine drives.

The engine only sees ``GuidedSpec`` (what the request asked for), ``GuidedCompiler``
(spec -> matcher, cached, with a timeout) and ``GuidedMatcher`` (per-request state). The
xgrammar backend lives in ``kiln.runtime.guided.xgrammar_backend``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

GUIDED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class GuidedSpec:
    """What a request's output must match.

    kind: "json_object" (any JSON object; value None), "json_schema" (value: the schema as
    JSON text), "regex" (value: the pattern), "choice" (value: tuple of strings), "grammar"
    (value: EBNF text, GBNF-style as xgrammar reads it), "structural_tag" (value: an xgrammar
    structural tag as JSON text: tool calls, kiln.tools).
    """

    kind: str
    value: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in GUIDED_KINDS:
            raise ValueError(f"guided kind {self.kind!r} is unknown; use one of {GUIDED_KINDS}")
        if self.kind == "choice":
            if not self.value or not all(isinstance(c, str) and c for c in self.value):
                raise ValueError("choice needs a non-empty list of non-empty strings")
            object.__setattr__(self, "value", tuple(self.value))
        elif self.kind != "json_object" and not isinstance(self.value, str):
            raise ValueError(f"{self.kind} needs a string value")


class GuidedMatcher(ABC):
    """One request's grammar state. Owned by the request; only the engine thread calls it."""

    @abstractmethod
    def fill_mask(self, mask: torch.Tensor) -> None:
        """Set ``mask`` (bool [vocab_size], CPU, all False on entry) True where allowed."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar rejects it (state unchanged)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the output is complete (the only allowed continuation is to stop)."""


class GuidedCompiler(ABC):
    """Compiles specs into matchers for one tokenizer; caches compiled grammars."""

    @abstractmethod
    def compile(self, spec: GuidedSpec) -> GuidedMatcher:
        """A fresh matcher; raises RequestError (bad grammar, or compilation timed out)."""


def mask_logits(logits: torch.Tensor, matchers: Sequence[GuidedMatcher | None],
                on_error: Callable[[int, BaseException], None]) -> torch.Tensor:
    """``logits`` [rows, V] with the tokens each row's grammar forbids at -inf (rows
    without a matcher unchanged; a copy when any row has one). A matcher that raises
    leaves its row all -inf and goes to ``on_error(row, exc)``."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    mask = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool)
    for j, i in enumerate(rows):
        try:
            matchers[i].fill_mask(mask[j])
        except Exception as e:
            on_error(i, e)
    idx = torch.tensor(rows, device=logits.device)
    allowed = mask.to(logits.device, non_blocking=True)
    logits = logits.clone()
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits
