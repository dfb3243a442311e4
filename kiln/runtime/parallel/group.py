"""``TPGroup``: one rank's torch.distributed groups, and the start-up handshakes over the
rendezvous store.

Two process groups over the same ranks:
- the model group (NCCL on CUDA, gloo on the CPU), for the forward's collectives: the
  all-reduce after o_proj, down and the embedding, the logits gather, and each staged step's
  input buffers (``broadcast``). On CUDA its collectives are captured in the CUDA graphs;
  NCCL's communicator is made at once (``device_id``) and used once before any capture.
  NVLink multicast (NVLS) stays off in every rank (``NO_MULTICAST``): on a host whose GPUs
  are shared, a program that uses it can put them out of service. Every rank runs the same
  forward, so its ranks meet within milliseconds; one that has not joined after
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
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 30
START_TIMEOUT_S = 600  # every rank loads its shard and builds its model within this
_IDLE = datetime.timedelta(days=365)
# set in every rank before NCCL starts (TPGroup)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
HEADER_WORDS = 16  # a command's fixed header on the control group (``send_words``)
_OBJECT = 0  # the header of a pickled command


def model_backend(device: torch.device) -> str:
    """The model group's backend for ranks on ``device``: gloo on the CPU; NCCL on CUDA
    unless ``KILN_TP_BACKEND=gloo`` (several ranks on one GPU, which NCCL refuses: for
    tests; no CUDA graphs then, gloo's collectives cannot be captured)."""
    from kiln.runtime import env

    return env.tp_backend() if device.type == "cuda" else "gloo"


class TPGroup:
    """This process's rank among ``world`` ranks (``store``: the rendezvous store rank 0
    hosts) whose model tensors live on ``device``. Shapes: ``all_reduce`` in place, any
    shape; ``gather_columns`` [rows, cols] → [rows, world * cols] (rank order) on every
    rank (an all-gather, which graphs capture; every rank's device speculation verifies on
    the same logits); ``broadcast`` in place, rank 0's tensor to every rank."""

    def __init__(self, rank: int, world: int, store: dist.Store,
                 device: torch.device | None = None):
        device = device or torch.device("cpu")
        if dist.is_initialized():
            raise RuntimeError("this process already runs a tensor-parallel engine (one "
                               "torch.distributed group per process); close() it first")
        self.rank, self.world, self.store = rank, world, store
        self.backend = model_backend(device)
        # a gloo group moves CUDA tensors through the host for what it cannot do on them
        self._via_host = self.backend == "gloo" and device.type == "cuda"
        bounded = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if self.backend == "nccl":
            os.environ.update(NO_MULTICAST)
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                                    timeout=bounded, device_id=device)
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=bounded)
        self.control = dist.new_group(backend="gloo", timeout=bounded if rank == 0 else _IDLE)
        if self.backend == "nccl":  # the communicator's first use, never inside a capture
            self.all_reduce(torch.ones(1, device=device))
            torch.cuda.synchronize(device)

    @property
    def capturable(self) -> bool:
        """CUDA graphs can capture the model group's collectives (NCCL)."""
        return self.backend == "nccl"

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return self._in_place(dist.all_reduce, t)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's ``t`` (in place, contiguous)."""
        return self._in_place(lambda x: dist.broadcast(x, src=0), t)

    def _in_place(self, op: Callable[[torch.Tensor], object], t: torch.Tensor) -> torch.Tensor:
        """``op`` on ``t`` in place; through a host copy where the group cannot take it."""
        if not self._via_host:
            op(t)
            return t
        host = t.cpu()
        op(host)
        return t.copy_(host)

    def gather_columns(self, local: torch.Tensor) -> torch.Tensor:
        local = local.contiguous()
        if self.backend == "nccl":
            rows, cols = local.shape
            out = torch.empty((self.world * rows, cols), dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(out, local)
            return out.view(self.world, rows, cols).transpose(0, 1).reshape(rows, -1)
        device = local.device
        if self._via_host:
            local = local.cpu()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1).to(device)

    def send(self, command: object) -> None:
        """Rank 0: pickle ``command`` to every other rank (``recv``)."""
        self.send_words([_OBJECT])
        dist.broadcast_object_list([command], src=0, group=self.control)

    def send_words(self, words: list[int]) -> None:
        """Rank 0: up to ``HEADER_WORDS`` integers to every other rank, the first > 0
        (``recv`` returns them as a list): one broadcast of a fixed tensor, no pickling
        (a step's command: 130 us against 470 us pickled, 2 ranks on a 2-core machine)."""
        header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        header[: len(words)] = torch.tensor(words, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)

    def recv(self) -> object:
        """A follower: rank 0's next ``send`` (the object) or ``send_words`` (a list)."""
        header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        if int(header[0]) != _OBJECT:
            return header.tolist()
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
