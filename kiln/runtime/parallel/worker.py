"""A follower rank: ``python -m kiln.runtime.parallel.worker ENGINE --rank R --port P
--leader-pid PID --config JSON`` (started by rank 0, ``Ranks.start``).

It loads its shard, builds its model and KV cache with rank 0's RuntimeConfig, then runs
rank 0's commands until told to stop. It never outlives rank 0: its heartbeat thread
(``supervisor.Heartbeat``) ends the process when its parent is no longer ``--leader-pid``,
when rank 0's store or beat is gone, or when rank 0 ends the engine. On any error it
publishes the message in the rendezvous store (rank 0 reports it), prints one line on
stderr (the traceback with KILN_DEBUG=1) and exits 1.

A follower ignores SIGINT: Ctrl-C in a terminal reaches every process of the foreground
group, and rank 0 handles it (the server drains, then says Stop); a follower that died of it
would fail the engine under the requests being drained.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn


def run(engine_dir: str, rank: int, store, config, heartbeat, share: int | None = None,
        local_rank: int | None = None) -> None:
    """Load rank ``rank``'s shard of ``engine_dir``, build its parts, follow rank 0.
    ``share``: the ranks on this host (default: all of the engine's); ``local_rank``: this
    rank's place among them (default ``rank``), its GPU on a CUDA engine."""
    import dataclasses

    import torch

    from kiln.artifact.loader import load_engine
    from kiln.dtypes import TORCH_DTYPES
    from kiln.runtime.config import EngineLimits
    from kiln.runtime.models.calibration import ActivationCalibrator
    from kiln.runtime.parallel.control import follow
    from kiln.runtime.parallel.group import START_TIMEOUT_S, TPGroup
    from kiln.runtime.parallel.launch import check_same_engine
    from kiln.runtime.parallel.ranks import Ranks, cpu_share, rank_device
    from kiln.runtime.startup import assemble

    art = load_engine(engine_dir, verify_checksums=False)  # rank 0 checked every file
    spec = art.spec
    check_same_engine(store, engine_dir)  # and this host holds the same files
    device = rank_device(torch.device(config.device), rank if local_rank is None else local_rank,
                         share or spec.tp)
    config = dataclasses.replace(config, device=str(device))
    if device.type == "cpu":
        torch.set_num_threads(cpu_share(share or spec.tp))
    else:  # as rank 0 did (LLMEngine.from_engine_dir): the build's kernels and configs
        from kiln.runtime.kernel_cache import install_for_engine
        from kiln.runtime.kernels import tuning

        torch.cuda.set_device(device)
        tuning.install(spec.kernel_configs, str(device))
        install_for_engine(Path(engine_dir), str(device))
    if not heartbeat.started.wait(START_TIMEOUT_S):  # rank 0 holds every rank up to its beat
        raise TimeoutError(f"rank {rank}'s heartbeat did not start within {START_TIMEOUT_S} s")
    store.set(f"kiln/up/{rank}", "1")
    ranks = Ranks(spec.parallel, spec.model, TPGroup(rank, spec.tp, store, device))
    dtype = TORCH_DTYPES[spec.dtype]
    lim = spec.limits
    limits = EngineLimits(lim.max_batch_size, lim.max_seq_len, lim.max_input_len,
                          lim.max_num_tokens)
    weights = art.load_weights(device, dtype, rank=rank, calibrator=ActivationCalibrator)
    parts = assemble(spec.model, weights, limits, dtype, config, spec.speculative,
                     attention=getattr(spec, "attention", None), tp=ranks)
    follow(parts.runner, ranks.group)
    heartbeat.stop()  # rank 0 said Stop: its store may go any moment now
    ranks.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kiln.runtime.parallel.worker")
    parser.add_argument("engine")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--leader-pid", type=int, required=True)
    parser.add_argument("--config", required=True, help="RuntimeConfig as JSON")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from kiln.runtime.config import RuntimeConfig
    from kiln.runtime.parallel.group import START_TIMEOUT_S
    from kiln.runtime.parallel.supervisor import Heartbeat

    heartbeat = Heartbeat("127.0.0.1", args.port, args.rank, leader_pid=args.leader_pid)

    def body(store) -> None:
        run(args.engine, args.rank, store, RuntimeConfig(**json.loads(args.config)), heartbeat)

    _guarded(args.rank, lambda: dist.TCPStore(
        "127.0.0.1", args.port, is_master=False,
        timeout=datetime.timedelta(seconds=START_TIMEOUT_S)), body)


def follow_launched(engine_dir: str, launch) -> NoReturn:
    """A rank torchrun started (``launch``, kiln.runtime.parallel.launch), not rank 0: the
    same as a follower rank 0 starts, with rank 0's RuntimeConfig from the store and no
    parent to watch; then exit the process (0 once rank 0 said Stop)."""
    from kiln.runtime.config import RuntimeConfig
    from kiln.runtime.parallel.group import START_TIMEOUT_S
    from kiln.runtime.parallel.launch import CONFIG_KEY
    from kiln.runtime.parallel.supervisor import Heartbeat

    heartbeat = Heartbeat(launch.host, launch.port, launch.rank)

    def body(store) -> None:
        config = RuntimeConfig(**json.loads(store.get(CONFIG_KEY).decode()))
        run(engine_dir, launch.rank, store, config, heartbeat, share=launch.local_world,
            local_rank=launch.local_rank)

    _guarded(launch.rank, lambda: launch.store(START_TIMEOUT_S), body)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # not back into the command rank 0 runs


def _guarded(rank: int, connect: Callable[[], Any], body: Callable[[Any], None]) -> None:
    """``body(store)`` on the store ``connect()`` returns; on any error publish it in the
    store (rank 0 reports it), print one line on stderr and exit 1. SIGINT is ignored
    meanwhile (rank 0's to handle)."""
    from kiln import env

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = None
    try:
        store = connect()
        body(store)
    except BaseException as e:  # noqa: BLE001 - published, then exit 1
        message = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if store is not None:
            try:
                store.set(f"kiln/error/{rank}", message)
            except RuntimeError:  # rank 0 (the store's host) is gone
                pass
        if env.debug_enabled():
            traceback.print_exc()
        print(f"kiln tensor-parallel rank {rank}: error: {message}", file=sys.stderr,
              flush=True)
        os._exit(1)  # no gloo teardown: the peers may be gone


if __name__ == "__main__":
    main()
