"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time

import torch

from kiln.errors import RequestError
from kiln.runtime.outputs import RequestMetrics, RequestOutput, TokenLogprob
from kiln.runtime.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Token ids, progress and KV blocks of one request.

    The one scheduling rule: ``num_computed_tokens`` of ``all_token_ids`` have KV in the
    cache; the target is all of them. When a step computes up to the last token, its
    logits give the next token. Preemption resets ``num_computed_tokens`` to 0 (recompute).
    """

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        eos_token_ids: frozenset[int],
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # set when serving it failed (finish_reason "error")
        self.stop_reason: str | int | None = None
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # Prompt logprobs collected so far, in prompt order (None for the first token), when
        # params.prompt_logprobs asks for them; complete at num_prompt_tokens entries. They
        # survive preemption: a recompute scores only the positions still missing.
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        self.matcher = None  # GuidedMatcher when params.guided is set
        self.spec_state = None  # the speculative worker's per-request state, if it speculates
        self.draft = None  # DraftPlan for the next step (cleared after every step)
        self.spec_pace = None  # SpecPace when speculation is paced (speculative/pace.py)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed)
        # Incremental detokenization state, owned by Detokenizer.
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.sent_text_len = 0
        self.sent_token_len = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt logprobs are still to be collected: its prefill needs logits at
        every prompt position, so it may not start from prefix-cache hits."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def ends_on_length_after(self, num_new: int, max_seq_len: int) -> bool:
        """Whether ``num_new`` more tokens reach max_tokens or max_seq_len."""
        return (len(self.output_token_ids) + num_new >= self.params.max_tokens
                or self.num_tokens + num_new >= max_seq_len)

    def commit(self, tokens: list[int], logprobs: list[TokenLogprob] | None,
               max_seq_len: int, now: float) -> int:
        """Append a step's tokens until one finishes the request (a stop token, a length
        limit, the grammar's end); returns how many were appended. A token the grammar
        rejects raises (its mask allowed it: a bug, which fails this request)."""
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.num_steps += 1
        appended = 0
        for i, tok in enumerate(tokens):
            self.append_token(tok)
            appended += 1
            if self.logprobs is not None and logprobs is not None:
                self.logprobs.append(logprobs[i])
            self.check_stop_token(max_seq_len)
            if self.matcher is not None and not self.is_finished:
                if not self.matcher.accept(tok):
                    raise RuntimeError(f"the grammar rejected token {tok}, which its own mask "
                                       "allowed")
                if self.matcher.is_terminated():
                    self.finish("stop")
            if self.is_finished:
                break
        return appended

    def check_stop_token(self, max_seq_len: int) -> None:
        """Finish on eos / stop token / max_tokens / max_seq_len after a token was appended."""
        tok = self.output_token_ids[-1]
        p = self.params
        if not p.ignore_eos and tok in self.eos_token_ids:
            self.finish("stop", tok)
        elif tok in p.stop_token_ids:
            self.finish("stop", tok)
        elif len(self.output_token_ids) >= p.max_tokens or self.num_tokens >= max_seq_len:
            self.finish("length")

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.perf_counter()


def check_prompt(ids: list[int], params: SamplingParams, vocab_size: int,
                 max_input_len: int) -> None:
    """Raise RequestError (naming the field) for a prompt or token-id parameter the engine
    cannot run: empty, ids outside the vocabulary, longer than the engine's max_input_len."""
    if not ids:
        raise RequestError("prompt is empty; send at least one token", "prompt")
    for name, toks in (("prompt", ids), ("stop_token_ids", params.stop_token_ids),
                       ("logit_bias", [t for t, _ in params.logit_bias])):
        bad = [t for t in toks if not 0 <= t < vocab_size]
        if bad:
            what = "prompt token ids" if name == "prompt" else f"{name}: token ids"
            raise RequestError(f"{what} {bad[:5]} are outside the vocabulary "
                               f"[0, {vocab_size})", name)
        if name == "prompt" and len(ids) > max_input_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens; this engine accepts at most {max_input_len} "
                "(max_input_len); shorten the prompt or rebuild with a larger --max-input-len",
                "prompt")


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
        prompt_logprobs=None if req.scores_prompt else req.prompt_logprobs,
    )
