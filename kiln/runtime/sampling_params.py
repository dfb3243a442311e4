"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiln.errors import RequestError
from kiln.runtime.guided import GuidedSpec

# Temperatures below this are greedy (vLLM's rule): dividing logits by a smaller one
# overflows float32 and the row's softmax turns into NaN.
GREEDY_TEMPERATURE = 1e-5
# Bounds that keep every processed logit finite in float32: |logit| stays far below 3.4e38
# for any model logit, penalty and bias inside them (the penalty ranges are OpenAI's).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
ADDITIVE_PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
# max_tokens when none is given (OpenAI's default for /v1/completions, which uses it too)
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request and when to stop.

    ``temperature`` below ``GREEDY_TEMPERATURE`` (0 included) is greedy. ``top_k <= 0``
    disables top-k. ``logprobs=k`` returns the
    chosen token's logprob and the ``k`` most likely alternatives per generated token.
    ``prompt_logprobs=k`` returns, for every prompt token after the first, its logprob given
    the tokens before it, its rank and the ``k`` most likely alternatives
    (``RequestOutput.prompt_logprobs``): log_softmax of the raw model logits in float32, no
    temperature, penalties or logit bias. Its prefill computes logits at every prompt
    position, so such a request takes no prefix-cache hits.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
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
    prompt_logprobs: int | None = None
    guided: GuidedSpec | None = None
    # Per-request lookahead window (w, n, g), bounded by the engine's (W, N, G); None takes
    # the engine's; (1, 1, 0) is plain decoding. In ngram engines, (1, 1, 0) turns drafting off.
    lookahead: tuple[int, int, int] | None = None
    # Per-request draft length of a draft-model engine: 0 to the engine's max_draft_len (0:
    # plain decoding); None takes the engine's.
    max_draft_len: int | None = None
    # Whose shared cache of earlier responses the request drafts from and feeds (suffix
    # decoding): None, the engine-wide cache; a string, that tenant's own, apart from every
    # other tenant's and from the engine-wide one (kiln serve --suffix-cache-scope tenant).
    tenant: str | None = None
    # False keeps special tokens in the text (Mistral's [TOOL_CALLS] marker is one); a
    # stop token that ends the request has no text either way.
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "logit_bias",
                           tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.lookahead is not None:
            if len(self.lookahead) != 3:
                raise RequestError(f"lookahead={self.lookahead!r} must be three integers "
                                   "(w, n, g)", "lookahead")
            object.__setattr__(self, "lookahead", tuple(int(v) for v in self.lookahead))
        if self.max_draft_len is not None and (isinstance(self.max_draft_len, bool) or int(
                self.max_draft_len) != self.max_draft_len or self.max_draft_len < 0):
            raise RequestError(f"max_draft_len={self.max_draft_len!r} must be an integer >= 0 "
                               "(0: plain decoding)", "max_draft_len")
        for name, value in self._floats().items():
            if not math.isfinite(value):
                raise RequestError(f"{name}={value!r} must be a finite number", name)
        rp_lo, rp_hi = REPETITION_PENALTY_RANGE
        ap_lo, ap_hi = ADDITIVE_PENALTY_RANGE
        lb_lo, lb_hi = LOGIT_BIAS_RANGE
        checks = [
            (self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1"),
            (self.temperature >= 0, "temperature", self.temperature, "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]"),
            (rp_lo <= self.repetition_penalty <= rp_hi, "repetition_penalty",
             self.repetition_penalty, f"must be in [{rp_lo}, {rp_hi:g}] (1.0 disables it)"),
            (ap_lo <= self.frequency_penalty <= ap_hi, "frequency_penalty",
             self.frequency_penalty, f"must be in [{ap_lo:g}, {ap_hi:g}] (0 disables it)"),
            (ap_lo <= self.presence_penalty <= ap_hi, "presence_penalty",
             self.presence_penalty, f"must be in [{ap_lo:g}, {ap_hi:g}] (0 disables it)"),
            (all(t >= 0 and math.isfinite(b) and lb_lo <= b <= lb_hi
                 for t, b in self.logit_bias), "logit_bias", dict(self.logit_bias),
             f"must map token ids >= 0 to biases in [{lb_lo:g}, {lb_hi:g}]"),
            (self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed",
             self.seed, "must be a 64-bit integer, in [-2**63, 2**64 - 1]"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
             "must be token ids >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs,
             "must be between 0 and 20"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "prompt_logprobs", self.prompt_logprobs, "must be between 0 and 20"),
            (all(s for s in self.stop), "stop", self.stop, "must not contain empty strings"),
        ]
        for ok, name, value, rule in checks:
            if not ok:
                raise RequestError(f"{name}={value!r} {rule}", name)

    def _floats(self) -> dict[str, float]:
        return {"temperature": self.temperature, "top_p": self.top_p, "min_p": self.min_p,
                "repetition_penalty": self.repetition_penalty,
                "frequency_penalty": self.frequency_penalty,
                "presence_penalty": self.presence_penalty}

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens so far or on a bias (the sampler's
        host-side processors run; speculation does not replay them)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0 or bool(self.logit_bias))
