"""``TPGroup``: one rank's torch.distributed groups, and the start-up handshakes over the
rendezvous store.

Two process groups over the same ranks:
- the model group (gloo on the CPU), for the forward's collectives: the all-reduce after
  o_proj, down and the embedding, the logits gather. Every rank runs the same forward, so
  its ranks meet within milliseconds; one that has not joined after
  ``COLLECTIVE_TIMEOUT_S`` is dead or hung, and the collective raises instead of waiting.
- the control group (gloo), for rank 0's commands (``control.py``). Timeouts are each
  process's own: a follower waits there between steps for as long as the engine is idle,
  so its side has no short timeout; rank 0's side has ``COLLECTIVE_TIMEOUT_S``, since a
  gloo send completes only once the receiver takes it and a hung follower would otherwise
  hold rank 0 forever. A rank that dies closes its sockets and every peer's pending
  operation raises at once (gloo: "Connection closed by peer"); followers also watch their
  parent (``worker.py``).
Start-up waits (every rank up, every rank ready) go through the store instead, polled, so
that rank 0 can notice a follower that exited and say why (``Ranks``).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 30
START_TIMEOUT_S = 600  # every rank loads its shard and builds its model within this
_IDLE = datetime.timedelta(days=365)


class TPGroup:
    """This process's rank among ``world`` ranks (``store``: the rendezvous store rank 0
    hosts). Shapes: ``all_reduce`` in place, any shape; ``gather_columns`` [rows, cols] →
    on rank 0 [rows, world * cols] (rank order), elsewhere None."""

    def __init__(self, rank: int, world: int, store: dist.Store):
        if dist.is_initialized():
            raise RuntimeError("this process already runs a tensor-parallel engine (one "
                               "torch.distributed group per process); close() it first")
        self.rank, self.world, self.store = rank, world, store
        bounded = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=bounded)
        self.control = dist.new_group(backend="gloo", timeout=bounded if rank == 0 else _IDLE)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    def gather_columns(self, local: torch.Tensor) -> torch.Tensor | None:
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def send(self, command: object) -> None:
        """Rank 0: pickle ``command`` to every other rank (``recv``)."""
        dist.broadcast_object_list([command], src=0, group=self.control)

    def recv(self) -> object:
        box: list[object] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_object(self, obj: object) -> list[object] | None:
        """Every rank's ``obj`` (picklable) on rank 0 in rank order, over the control
        group; elsewhere None. Rank 0 sends the command that makes the others call it."""
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def publish(self, key: str, value: str) -> None:
        self.store.set(f"kiln/{key}/{self.rank}", value)

    def gather_published(self, key: str, check: Callable[[], None] = lambda: None) -> list[str]:
        """Every rank's ``publish(key, ...)`` value in rank order, once all are there;
        ``check()`` runs while waiting (rank 0 raises there when a follower exited)."""
        keys = [f"kiln/{key}/{r}" for r in range(self.world)]
        wait_for(self.store, keys, check)
        return [self.store.get(k).decode() for k in keys]

    def agree_min(self, key: str, value: int, check: Callable[[], None] = lambda: None) -> int:
        """The smallest ``value`` any rank offers (e.g. KV blocks: every rank the same)."""
        self.publish(key, str(value))
        return min(int(v) for v in self.gather_published(key, check))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def wait_for(store: dist.Store, keys: list[str], check: Callable[[], None],
             timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll until ``store`` has every key, running ``check()`` in between; TimeoutError
    naming the missing keys after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        check()
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise TimeoutError(f"tensor-parallel start-up: {missing} not set within "
                               f"{timeout_s:.0f} s")
        time.sleep(0.02)
