"""What one engine step carries between its stages: the tokens it commits (``StepResult``),
a step queued on the device whose tokens the host has not read yet (``LaunchedStep``), the
pinned buffers those tokens come back through (``TokenReadback``), and how a step's tokens
are chosen: on the device (``sample_on_device``, then ``read_result`` one step later) or on
the host (``sample_on_host``). A failure there fails its request alone (``Fail``: the
engine's ``fail_request``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kiln.runtime.guided import mask_logits
from kiln.runtime.host_copy import to_device
from kiln.runtime.layers.sampler import INVALID_TOKEN, Sampler, describe_bad_row
from kiln.runtime.outputs import TokenLogprob
from kiln.runtime.prompt_logprobs import score_prompt_rows
from kiln.runtime.request import Request
from kiln.runtime.scheduler import ScheduledBatch
from kiln.runtime.speculative.device_step import SpecOutput

Fail = Callable[[Request, str, "BaseException | str"], None]  # LLMEngine.fail_request
NOT_FINITE = "its logits row is not finite (NaN or inf in the model's output)"


@dataclass
class StepResult:
    """Tokens each request commits this step, and how many of its tokens now have KV.

    ``advance`` overrides the scheduled token count (speculative steps keep fewer);
    ``draft_logits`` holds draft plans' rows for the speculative worker to verify; plans run
    on the device were verified in the step already: ``spec`` (a ``SpecOutput``) holds what
    they committed, at each request's row ``spec_entries[req]``.
    """

    tokens: dict[Request, list[int]] = field(default_factory=dict)
    logprobs: dict[Request, list[TokenLogprob]] = field(default_factory=dict)
    advance: dict[Request, int] = field(default_factory=dict)
    draft_logits: dict[Request, torch.Tensor] = field(default_factory=dict)
    verified: set[Request] = field(default_factory=set)  # requests whose draft was verified
    spec_entries: dict[Request, int] = field(default_factory=dict)
    spec: SpecOutput | None = None

    def add_verified(self, req: Request, tokens: list[int]) -> None:
        """``req`` commits a verified speculative step's ``tokens``: x and the accepted
        drafts have KV (the advance), the last token is the bonus."""
        self.tokens[req] = tokens
        self.advance[req] = len(tokens)
        self.verified.add(req)


@dataclass
class LaunchedStep:
    """A step whose forward is queued on the device, its tokens chosen but not yet read.

    ``plain`` are the requests that sample a token; ``tokens`` [len(plain)] (device) their
    samples. Plans proposed and verified on the device (``spec_entries``: request -> its
    entry row) committed up to N tokens each: ``host`` receives [B, N + 1] rows of
    committed tokens and their count (``spec_shape``), then, flattened, the plain rows'
    samples (pinned on CUDA; valid once ``ready`` has passed). ``reqs`` are the requests
    whose tokens it reads; ``advance`` is what the scheduler counts at launch where it is not
    the scheduled count (one token for each request that verified a plan: its commit brings
    the rest). A step that needs the host to choose its tokens (``result``) chose them at
    launch: sampled, and its plans verified.
    """

    batch: ScheduledBatch
    reqs: list[Request]
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    spec_entries: dict[Request, int] = field(default_factory=dict)
    advance: dict[Request, int] | None = None
    plain: list[Request] = field(default_factory=list)
    spec_shape: tuple[int, int] = (0, 0)
    result: StepResult | None = None

    @property
    def stale(self) -> bool:
        """Every request it ran has stopped or was aborted: nothing to read."""
        return all(r.is_finished for r in self.reqs)

    def inputs_for(self, batch: ScheduledBatch) -> torch.Tensor:
        """The device token ids that are the inputs of ``batch``'s leading items, the
        requests this step sampled (a step scheduled on top of this one: prompt chunks,
        admissions and device plans after them have known inputs), in ``batch``'s order."""
        row = {r: i for i, r in enumerate(self.plain)}
        order = []
        for r, _ in batch.items:
            if r not in row:
                break
            order.append(row[r])
        if order == list(range(len(self.plain))):
            return self.tokens
        return self.tokens[to_device(order, torch.long, self.tokens.device)]


class TokenReadback:
    """Device -> host copies of a step's results without a sync at launch: two pinned
    buffers (one per step in flight) of ``max_elems`` longs and an event per copy."""

    def __init__(self, max_elems: int, device: torch.device):
        self.device = device
        pinned = device.type == "cuda"
        self._host = [torch.empty(max_elems, dtype=torch.long, pin_memory=pinned)
                      for _ in range(2)]
        self._turn = 0

    def start(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Queue the copy of ``tokens`` (any shape); returns (host view, event to wait on)."""
        if self.device.type != "cuda":
            return tokens, None
        self._turn ^= 1
        host = self._host[self._turn][: tokens.numel()].view(tokens.shape)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    @staticmethod
    def read(step: LaunchedStep) -> list:
        """The step's results on the host (its one sync)."""
        if step.ready is not None:
            step.ready.synchronize()
        return step.host.tolist()


def sample_logits(fwd) -> tuple[list[Request], torch.Tensor]:
    """The requests that sample this step and their logits rows, in order (rows 0..n-1, as
    in every graph step: a view, no gather)."""
    reqs = list(fwd.sample_rows)
    rows = list(fwd.sample_rows.values())
    logits = fwd.logits[: len(rows)] if rows == list(range(len(rows))) else fwd.logits[rows]
    return reqs, logits


def read_result(launched: LaunchedStep, rows: list[int], fail: Fail) -> StepResult:
    """A launched step's tokens from its host copy ``rows``: each plain row's sample, each
    device plan's commits (a row that is not finite or a plan that committed nothing fails
    its request; requests that finished since are dropped)."""
    result = StepResult()
    n, w = launched.spec_shape
    for req, tok in zip(launched.plain, rows[n * w :] if n else rows):
        if tok == INVALID_TOKEN:
            fail(req, "sampling", NOT_FINITE)
        elif not req.is_finished:
            result.tokens[req] = [tok]
    for req, e in launched.spec_entries.items():
        if req.is_finished:
            continue  # aborted or stopped in the step before: dropped
        row = rows[e * w : (e + 1) * w]
        if row[-1] < 1:
            fail(req, "speculative verification", "the device step committed no token")
            continue
        result.add_verified(req, row[: row[-1]])
    return result


def sample_on_device(batch: ScheduledBatch, fwd, verdict: torch.Tensor | None,
                     sampler: Sampler, readback: TokenReadback) -> LaunchedStep:
    """The step's tokens chosen on the device, their host copy queued: its plain rows'
    samples, and the commits of its plans verified on the device (``verdict`` [B, N + 1],
    ``DeviceSpecStep``; each such request counts one token at launch)."""
    plain, logits = sample_logits(fwd)
    tokens = None
    if plain or verdict is None:
        tokens = sampler.choose(logits, [r.params for r in plain], [r.generator for r in plain])
    if verdict is None:
        return LaunchedStep(batch, plain, tokens, *readback.start(tokens), plain=plain)
    reqs = [r for r, _ in batch.items]
    out = verdict.reshape(-1) if tokens is None else torch.cat([verdict.reshape(-1), tokens])
    return LaunchedStep(batch, reqs, tokens, *readback.start(out), fwd.spec_entries,
                        {r: 1 for r in reqs}, plain, tuple(verdict.shape))


def sample_on_host(fwd, sampler: Sampler, fail: Fail) -> StepResult:
    """The step's tokens chosen with the host (``fwd``: its ``ForwardOutput``): its prompt
    scores, grammar masks, and the sampler's full path (penalties, logprobs, seeds)."""
    if fwd.prompt_rows:
        _score_prompts(fwd.logits, fwd.prompt_rows, fail)
    result = StepResult()
    reqs, logits = sample_logits(fwd)
    if reqs:
        logits = mask_logits(logits, [r.matcher for r in reqs], lambda i, e: fail(
            reqs[i], "structured output (the grammar's token mask)", e))
        tokens, logprobs = sampler.sample_requests(
            logits, reqs, lambda i, e: fail(reqs[i], "sampling", e))
        for i, (req, tok, lp) in enumerate(zip(reqs, tokens, logprobs)):
            if tok == INVALID_TOKEN:
                fail(req, "sampling", describe_bad_row(logits[i]))
            if req.is_finished:  # failed here or in its grammar mask
                continue
            result.tokens[req] = [tok]
            if lp is not None:
                result.logprobs[req] = [lp]
    return result


def _score_prompts(logits: torch.Tensor, prompt_rows: dict[Request, tuple[int, int, int]],
                   fail: Fail) -> None:
    """Append the prompt logprobs this step scored to their requests (a request whose
    scores fail or are not finite fails alone)."""
    try:
        scored = score_prompt_rows(logits, prompt_rows)
    except Exception as e:
        for req in prompt_rows:
            fail(req, "scoring its prompt (prompt_logprobs)", e)
        return
    for req, lps in scored.items():
        if lps is None:
            fail(req, "scoring its prompt (prompt_logprobs)", "its logits are not finite "
                 "(NaN or inf in the model's output)")
        elif not req.is_finished:
            req.prompt_logprobs.extend(lps)
