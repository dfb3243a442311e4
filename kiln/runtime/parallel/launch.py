"""A tensor-parallel engine across hosts: kiln's ranks as torchrun's workers.

Every host runs the same command line, kiln's command under torchrun::

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 -m kiln generate ENGINE ...

Under torchrun (``TORCHELASTIC_RUN_ID`` in the environment) rank 0 starts no follower
processes: the worker torchrun made ``RANK`` 0 runs the command as kiln's rank 0, every
other one loads its own shard of ENGINE (the same engine on every host) with rank 0's
RuntimeConfig (published in the store) and follows it (``worker.follow_launched``), then
exits without running the command. The ranks meet in torchrun's store
(``MASTER_ADDR:MASTER_PORT``: the rank-0 agent's, or rank 0's own when torchrun does not
share it). Rank 0 did not start the others, so it cannot see them exit: a follower's
failure reaches it as the error the follower publishes in the store, or as missing
heartbeats; rank 0 ends them through the store's abort key (``supervisor.py``).
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

CONFIG_KEY = "kiln/config"  # rank 0's RuntimeConfig as JSON, for the followers
ENGINE_KEY = "kiln/engine"  # rank 0's engine.json sha256: every rank must load that engine


def engine_digest(engine_dir: str | Path) -> str:
    """The sha256 of an engine's engine.json, which holds every weight file's checksum: two
    hosts' copies of one engine agree on it, any other engine does not."""
    return hashlib.sha256((Path(engine_dir) / "engine.json").read_bytes()).hexdigest()


def check_same_engine(store: dist.Store, engine_dir: str | Path) -> None:
    """A follower: ValueError unless its engine is rank 0's (a host with another build, or
    an older copy, would compute with other weights). ``store.get`` waits for rank 0's."""
    want = store.get(ENGINE_KEY).decode()
    have = engine_digest(engine_dir)
    if have != want:
        raise ValueError(
            f"the engine at {engine_dir} on this host is not rank 0's (engine.json sha256 "
            f"{have[:12]}… here, {want[:12]}… on rank 0): copy the same engine directory to "
            "every host")


@dataclass(frozen=True)
class Launch:
    """This process's place among torchrun's workers."""

    rank: int
    world: int
    local_world: int  # the ranks on this host (they share its cores)
    host: str  # the store: MASTER_ADDR:MASTER_PORT
    port: int
    agent_store: bool  # torchrun's agent hosts the store (else rank 0 does)
    restart: int
    local_rank: int = 0  # this rank's place on its host (its GPU: cuda:<local_rank>)

    def check(self, tp: int) -> None:
        """ValueError unless torchrun's workers are this engine's ranks."""
        if self.world != tp:
            raise ValueError(
                f"torchrun started {self.world} worker(s) (WORLD_SIZE={self.world}) but the "
                f"engine is tensor-parallel with tp={tp}: run --nnodes N --nproc-per-node P "
                f"with N * P = {tp}, or build the engine with --tp {self.world}")
        if self.restart:
            raise ValueError(
                f"torchrun restarted kiln's ranks (TORCHELASTIC_RESTART_COUNT={self.restart}); "
                "a tensor-parallel engine does not restart: run torchrun with --max-restarts 0")

    def store(self, timeout_s: float) -> dist.TCPStore:
        """The rendezvous store every rank uses (kiln keys, the groups, the heartbeats)."""
        return dist.TCPStore(self.host, self.port, self.world,
                             is_master=self.rank == 0 and not self.agent_store,
                             timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)


def launched(environ: Mapping[str, str] = os.environ) -> Launch | None:
    """This process's ``Launch`` when torchrun started it, else None."""
    if "TORCHELASTIC_RUN_ID" not in environ:
        return None
    try:
        return Launch(int(environ["RANK"]), int(environ["WORLD_SIZE"]),
                      int(environ.get("LOCAL_WORLD_SIZE", "1")), environ["MASTER_ADDR"],
                      int(environ["MASTER_PORT"]),
                      environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                      int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                      int(environ.get("LOCAL_RANK", "0")))
    except (KeyError, ValueError) as e:
        raise ValueError(f"torchrun's environment is incomplete or malformed ({e!r}): run "
                         "kiln under torchrun (python -m torch.distributed.run)") from None
