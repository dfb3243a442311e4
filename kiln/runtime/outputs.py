"""What the engine hands back after each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kiln.runtime.request import Request


@dataclass
class TokenLogprob:
    """Logprob of the chosen token and the top alternatives ({token_id: logprob})."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


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


def request_output(req: Request) -> RequestOutput:
    """What ``req`` has produced so far, with only this step's new part in ``new_*``
    (a stop string's possible start held back while it runs); marks it sent."""
    text = req.text
    if not req.is_finished and req.params.stop:
        # Hold back what could still become the start of a stop string.
        hold = max(len(s) for s in req.params.stop) - 1
        text = text[: max(len(text) - hold, req.sent_text_len)]
    new_text = text[req.sent_text_len :]
    new_ids = req.output_token_ids[req.sent_token_len :]
    req.sent_text_len = len(text)
    req.sent_token_len = len(req.output_token_ids)
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=list(req.output_token_ids),
        text=text,
        new_token_ids=new_ids,
        new_text=new_text,
        finished=req.is_finished,
        finish_reason=req.finish_reason,
        metrics=req.metrics,
        logprobs=list(req.logprobs) if req.logprobs is not None else None,
        stop_reason=req.stop_reason,
        error=req.error,
    )
