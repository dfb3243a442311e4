"""What the engine hands back after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Logprob of the chosen token and the top alternatives ({token_id: logprob}, most
    likely first); ``rank``: the token's rank in its row, 1 = most likely (prompt logprobs
    set it; None where it was not computed)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_steps: int = 0  # decode steps that produced tokens for this request
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    spec_steps: int = 0  # speculative steps (lookahead / ngram) this request took
    spec_tokens: int = 0  # tokens those steps committed
    # accepted draft tokens that came from a shared cache of earlier responses (suffix)
    spec_cached_tokens: int = 0

    @property
    def tokens_per_spec_step(self) -> float | None:
        """Mean committed tokens per speculative step (acceptance), None without any."""
        return self.spec_tokens / self.spec_steps if self.spec_steps else None


@dataclass
class RequestOutput:
    """The state of one request after a step.

    ``token_ids``/``text`` hold everything generated so far; ``new_token_ids``/``new_text``
    only what this step added (for streaming). ``finish_reason`` is None while running, else
    "stop" (eos, stop string or stop token), "length" (max_tokens or max_seq_len), "abort",
    or "error": serving this request failed (``error`` says why; the engine goes on).
    ``prompt_logprobs`` (``SamplingParams.prompt_logprobs``): one entry per prompt token,
    None for the first, set on every output once the whole prompt has been scored (its
    first output with tokens at the latest; the list is shared, read it only).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None  # why the request failed (finish_reason "error")
    prompt_logprobs: list[TokenLogprob | None] | None = None

