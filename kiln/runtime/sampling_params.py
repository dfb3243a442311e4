"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.guided import GuidedSpec


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    ``temperature == 0`` is greedy. ``top_k <= 0`` disables top-k. ``logprobs=k`` returns the
    chosen token's logprob and the ``k`` most likely alternatives per generated token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    # OpenAI's additive penalties: logit -= frequency_penalty * count + presence_penalty *
    # (count > 0), counted over the generated tokens only (not the prompt).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # ((token_id, bias), ...) added to those tokens' logits before anything else.
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    guided: GuidedSpec | None = None
    # Per-request lookahead window (w, n, g), bounded by the engine's (W, N, G); None takes
    # the engine's; (1, 1, 0) is plain decoding. In ngram engines, (1, 1, 0) turns drafting off.
    lookahead: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias",
                           tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.lookahead is not None:
            if len(self.lookahead) != 3:
                raise ValueError(f"lookahead={self.lookahead!r} must be three integers (w, n, g)")
            object.__setattr__(self, "lookahead", tuple(int(v) for v in self.lookahead))
        checks = [
            (self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1"),
            (self.temperature >= 0, "temperature", self.temperature, "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty,
             "must be > 0 (1.0 disables it)"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs,
             "must be between 0 and 20"),
            (all(s for s in self.stop), "stop", self.stop, "must not contain empty strings"),
        ]
        for ok, name, value, rule in checks:
            if not ok:
                raise ValueError(f"{name}={value!r} {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
