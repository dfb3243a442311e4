"""What one engine step carries between its stages: the tokens it commits (``StepResult``),
a step queued on the device whose tokens the host has not read yet (``LaunchedStep``), and
the pinned buffers those tokens come back through (``TokenReadback``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.runtime.host_copy import to_device
from kiln.runtime.outputs import TokenLogprob
from kiln.runtime.request import Request
from kiln.runtime.scheduler import ScheduledBatch
from kiln.runtime.speculative.device_step import SpecOutput


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
    """A step whose forward and sampling are queued on the device, tokens not yet read.

    ``tokens`` [len(reqs)] (device) is row i's sample for ``reqs[i]``; ``host`` receives
    them (pinned on CUDA) and is valid once ``ready`` has passed. A speculative step of
    device plans (``spec_entries``: request -> its row) samples only its ``plain`` rows
    (requests decoding one token beside the plans; ``tokens`` [len(plain)]): ``host``
    receives [B, N + 1] rows of committed tokens and their count (``spec_shape``), then,
    flattened, the plain rows' samples; ``advance`` is what the scheduler counted at launch
    (one token each: the rest comes with the commit).
    """

    batch: ScheduledBatch
    reqs: list[Request]
    tokens: torch.Tensor | None
    host: torch.Tensor
    ready: torch.cuda.Event | None
    spec_entries: dict[Request, int] | None = None
    advance: dict[Request, int] | None = None
    plain: list[Request] = field(default_factory=list)
    spec_shape: tuple[int, int] = (0, 0)

    @property
    def stale(self) -> bool:
        """Every request it ran has stopped or was aborted: nothing to read."""
        return all(r.is_finished for r in self.reqs)

    def inputs_for(self, batch: ScheduledBatch) -> torch.Tensor:
        """The device token ids that are the inputs of ``batch``'s leading items, the
        requests this step sampled (a step scheduled on top of this one: prompt chunks and
        admissions after them have known inputs), in ``batch``'s order."""
        row = {r: i for i, r in enumerate(self.reqs)}
        order = []
        for r, _ in batch.items:
            if r not in row:
                break
            order.append(row[r])
        if order == list(range(len(self.reqs))):
            return self.tokens
        return self.tokens[to_device(order, torch.long, self.tokens.device)]


    def inputs_for_plain(self, batch: ScheduledBatch) -> torch.Tensor:
        """The device token ids of ``batch``'s first items, this speculative step's plain
        rows (a step launched on top of it lays them out first): their samples."""
        row = {r: i for i, r in enumerate(self.plain)}
        order = [row[r] for r, _ in batch.items[: len(self.plain)]]
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
