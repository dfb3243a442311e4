"""``Ranks``: a process's part in a tensor-parallel engine, and rank 0's follower processes.

Rank 0 is the process that loads the engine (``LLMEngine.from_engine_dir``): it hosts the
rendezvous store on a free loopback port, starts ranks 1..N-1 as ``python -m
kiln.runtime.parallel.worker`` processes, and runs the engine. It ends them (``close``) and
watches them (``supervisor.py``): a follower that exits is noticed at once, one that hangs
within the heartbeat timeout, whether the engine idles or waits in a collective. Rank 0
then ends every follower, tells the engine's listeners (the server's engine thread) and
raises ``TensorParallelError`` naming the rank and why (the error the follower published
in the store, its exit code, or its missing heartbeats) from the step that finds out.
A follower ends itself when rank 0 goes away, so no rank outlives the engine.

A process that must not outlive a failure (`kiln serve`, `generate`, `bench`) also calls
``exit_on_failure``: rank 0 may be blocked inside a collective that nothing in Python can
interrupt, so the supervisor then ends the process itself once the caller had
``EXIT_GRACE_S`` to report the failure and exit on its own.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from kiln.artifact.parallel import ParallelConfig
from kiln.config import ModelConfig
from kiln.runtime.kv_cache import KVCache
from kiln.runtime.memory import peak_memory
from kiln.runtime.parallel.control import (
    LeaderCache,
    LeaderModel,
    LeaderState,
    ReportMemory,
    Stop,
)
from kiln.runtime.parallel.group import START_TIMEOUT_S, TPGroup, wait_for
from kiln.runtime.parallel.layers import parallelize
from kiln.runtime.parallel.supervisor import Supervisor

STOP_TIMEOUT_S = 10  # a follower leaves its loop and exits within this after Stop
# After a failure, how long a process that called exit_on_failure gets to report it and
# exit before the supervisor ends it: the server's own shutdown takes at most ~7 s (the
# 2 s answer grace, a 5 s engine-thread join).
EXIT_GRACE_S = 10.0


class TensorParallelError(RuntimeError):
    """A rank exited, hung or failed: the ranks are out of step and the engine is done."""


class Ranks:
    """This process's rank of a tensor-parallel engine: its shard layout (``parallel``,
    ``model_config`` the whole model's), its groups; on rank 0 (``start``) the follower
    processes."""

    def __init__(self, parallel: ParallelConfig, model_config: ModelConfig, group: TPGroup,
                 procs: list[subprocess.Popen] | None = None, launched: bool = False):
        self.parallel, self.model_config, self.group = parallel, model_config, group
        self.procs = procs or []
        self.launched = launched  # torchrun started every rank (launch.py), not rank 0
        self.failed: str | None = None
        self.supervisor: Supervisor | None = None  # rank 0's, once started
        self._closed = False
        self._threads: int | None = None  # rank 0's torch threads before the engine
        self._lock = threading.Lock()  # failed is set once (engine thread or supervisor)
        self._listeners: list[Callable[[TensorParallelError], None]] = []
        self._ended = threading.Event()  # every follower ended after the failure
        self._exit_grace_s: float | None = None

    @property
    def rank(self) -> int:
        return self.group.rank

    @classmethod
    def start(cls, engine_dir: Path, parallel: ParallelConfig, model_config: ModelConfig,
              device: torch.device, config: Any, *,
              follow: Callable[[str, Any], NoReturn]) -> Ranks:
        """Rank 0: start the followers of the engine at ``engine_dir`` (each loads its shard
        with ``config``, a RuntimeConfig) and form the group with them. Under torchrun
        (launch.py) start none: torchrun's rank 0 forms the group with the ranks torchrun
        started, and any other rank follows it here, ``follow(engine_dir, launch)``
        (``worker.follow_launched``, which builds the rank's engine parts: the caller, above
        the runtime's start-up, hands it in), and then exits the process."""
        from kiln.runtime.parallel.launch import CONFIG_KEY, ENGINE_KEY, engine_digest, launched

        launch = launched()
        if launch is not None:
            launch.check(parallel.tp)
            if launch.rank != 0:
                follow(str(engine_dir), launch)  # exits the process
        local_world = parallel.tp if launch is None else launch.local_world
        device = rank_device(device, 0, local_world)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        from kiln.runtime import env

        heartbeat_timeout_s = env.tp_heartbeat_timeout_s()
        settings = json.dumps(dataclasses.asdict(config))
        procs: list[subprocess.Popen] = []
        if launch is not None:
            store = launch.store(START_TIMEOUT_S)
            store.set(CONFIG_KEY, settings)
            host, port = launch.host, launch.port

            def exited(s: dist.Store) -> list[str]:
                return _published(s, parallel.tp)
        else:
            store = dist.TCPStore("127.0.0.1", 0, parallel.tp, is_master=True,
                                  timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
                                  wait_for_workers=False)
            host, port = "127.0.0.1", store.port

            def exited(s: dist.Store) -> list[str]:
                return _exited(procs, s)
        failed: list[str] = []  # the supervisor's reason, while start-up polls
        supervisor = Supervisor(host, port, parallel.tp, heartbeat_timeout_s, exited,
                                failed.append)
        try:
            store.set(ENGINE_KEY, engine_digest(engine_dir))
            for rank in range(1, parallel.tp if launch is None else 1):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kiln.runtime.parallel.worker", str(engine_dir),
                     "--rank", str(rank), "--port", str(store.port), "--leader-pid",
                     str(os.getpid()), "--config", settings],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))

            def check() -> None:
                reasons = exited(store) or failed
                if reasons:
                    raise TensorParallelError(
                        f"tensor-parallel engine (tp={parallel.tp}) did not start: "
                        f"{'; '.join(reasons)}; every rank was ended")

            wait_for(store, [f"kiln/up/{r}" for r in range(1, parallel.tp)], check)
            ranks = cls(parallel, model_config, TPGroup(0, parallel.tp, store, device), procs,
                        launched=launch is not None)
        except BaseException:
            supervisor.stop()
            for p in procs:
                _end(p)
            raise
        # from here on a failure the supervisor finds ends every rank at once
        ranks.supervisor = supervisor
        supervisor.hand_over(ranks._stop_all)
        atexit.register(ranks.kill)
        # the ranks share the cores (worker.py): rank 0 takes its share too while the
        # engine runs (smollm2 tp 3 on 2 cores: 2.7 -> 4.0 tokens/s)
        if device.type == "cpu":
            ranks._threads = torch.get_num_threads()
            torch.set_num_threads(cpu_share(local_world))
        return ranks

    # -- what the model and the engine parts ask of a rank ----------------------------------
    def local_config(self) -> ModelConfig:
        return self.parallel.local_config(self.model_config)

    def parallelize(self, linears: dict, embedding: torch.Tensor, head: str):
        """``LlamaModel``'s layers of this rank (kiln.runtime.parallel.layers)."""
        return parallelize(linears, embedding, head, self.group, self.model_config.vocab_size)

    def graphs_possible(self, device: torch.device) -> bool:
        """CUDA graphs can hold this engine's steps: their collectives can be captured
        (NCCL; not with ``KILN_TP_BACKEND=gloo``, which then runs every step eagerly)."""
        return device.type != "cuda" or self.group.capturable

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The KV blocks every rank allocates: the fewest any rank can hold."""
        return self.group.agree_min("num_kv_blocks", num_blocks, self._check)

    def lead(self, model: Any, cache: KVCache, state: Any = None) -> tuple[Any, Any, Any]:
        """Rank 0: the model, cache and device speculation state (or None) that send what
        they do to the followers; a follower: its own, driven by ``control.follow``."""
        if self.rank != 0:
            return model, cache, state
        return (LeaderModel(model, self.group, self.fail),
                LeaderCache(cache, self.group, self.fail),
                LeaderState(state, self.group, self.fail) if state is not None else None)

    def memory(self, device: torch.device) -> list[dict]:
        """Rank 0: every rank's peak memory (kiln.runtime.memory), in rank order."""
        try:
            self.group.send(ReportMemory())
            return self.group.gather_object(peak_memory(device))
        except Exception as e:
            raise self.fail(e) from e

    def ready(self) -> None:
        """Wait until every rank has built its model and cache."""
        self.group.publish("ready", "1")
        self.group.gather_published("ready", self._check)

    # -- failure and shutdown (rank 0) -----------------------------------------------------
    def on_failure(self, callback: Callable[[TensorParallelError], None]) -> None:
        """Call ``callback(error)`` once the engine failed (from the supervisor's thread, or
        from the thread whose collective failed); at once if it already did."""
        with self._lock:
            self._listeners.append(callback)
            failed = self.failed
        if failed is not None:
            callback(self._error())

    def exit_on_failure(self, grace_s: float = EXIT_GRACE_S) -> None:
        """This process must not outlive a failure: ``grace_s`` after one, if it still runs
        (rank 0 blocked in a collective), the supervisor prints the reason and ends it with
        exit code 1; at interpreter exit after one, it skips the teardown of the groups."""
        if self._exit_grace_s is None:
            atexit.register(self._exit_if_failed)  # runs before kill (atexit is LIFO)
        self._exit_grace_s = grace_s

    def fail(self, cause: BaseException) -> TensorParallelError:
        """Rank 0 after a collective or a command failed: end every follower; the error
        names the ranks that exited and why."""
        if self.failed is None:
            deadline = time.monotonic() + 2  # a follower that failed is exiting now
            while (self.failed is None and time.monotonic() < deadline
                   and all(p.poll() is None for p in self.procs)
                   and not (self.launched and self._exited())):
                time.sleep(0.05)
            why = "; ".join(self._exited()) or (
                f"a collective failed ({type(cause).__name__}: {cause})")
            self._stop_all(why)
        self._ended.wait()  # the supervisor may be ending the followers right now
        return self._error()

    def _error(self) -> TensorParallelError:
        return TensorParallelError(f"{self.failed}; every rank was ended")

    def _stop_all(self, why: str) -> None:
        """The engine failed (``why``): record it, end every rank, tell the listeners. The
        first caller (supervisor or engine thread) does it; later ones find it done."""
        with self._lock:
            if self.failed is not None:
                return
            self.failed = f"tensor-parallel engine (tp={self.parallel.tp}) stopped: {why}"
            listeners = list(self._listeners)
        if self.supervisor is not None:
            self.supervisor.stop(wait=False)  # this may be its thread
            self.supervisor.abort(self.failed)
        for p in self.procs:
            _end(p)
        self._ended.set()
        if self._exit_grace_s is not None:
            threading.Thread(target=self._exit_later, name="kiln-tp-exit", daemon=True).start()
        error = self._error()
        for callback in listeners:
            callback(error)

    def _exit_later(self) -> None:
        time.sleep(self._exit_grace_s)
        print(f"error: {self.failed}; rank 0 did not stop within {self._exit_grace_s:g} s "
              "(a collective it waits in cannot be interrupted): exiting", file=sys.stderr,
              flush=True)
        os._exit(1)

    def _exit_if_failed(self) -> None:
        """At interpreter exit after a failure: skip the groups' teardown (it may wait on
        peers that are gone); the exit code is 1 whatever the caller's was."""
        if self.failed is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def _check(self) -> None:
        """Rank 0 while it waits on the followers at start-up: raise if one failed."""
        if self.failed is not None:
            self._ended.wait()
            raise self._error()
        if any(p.poll() is not None for p in self.procs) or (self.launched and self._exited()):
            raise self.fail(RuntimeError("a follower exited during start-up"))

    def _exited(self) -> list[str]:
        """Why each follower that failed did (rank 0)."""
        if self.launched:
            return _published(self.group.store, self.parallel.tp)
        return _exited(self.procs, self.group.store)

    def close(self) -> None:
        """End the followers (``Stop``, then a kill after ``STOP_TIMEOUT_S``) and leave
        the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.supervisor is not None:  # followers exiting on Stop are no failure
            self.supervisor.stop()
        if self.rank == 0 and self.failed is None:
            try:
                self.group.send(Stop())
            except RuntimeError:  # a follower already gone: ended below
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _end(p)
        self.group.close()
        self.kill()

    def kill(self) -> None:
        """End every follower now (rank 0; also at interpreter exit) and give rank 0 its
        threads back."""
        if self.supervisor is not None:
            self.supervisor.stop()
        for p in self.procs:
            _end(p)
        atexit.unregister(self.kill)
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None


def rank_device(device: torch.device, local_rank: int, local_world: int) -> torch.device:
    """The device of this host's rank ``local_rank`` of ``local_world`` on an engine run on
    ``device``: the CPU, or one GPU per rank, cuda:<local rank> (choose which GPUs with
    CUDA_VISIBLE_DEVICES). With ``KILN_TP_BACKEND=gloo`` ranks may share GPUs (tests)."""
    if device.type != "cuda":
        return device
    from kiln.runtime.parallel.group import model_backend

    count = torch.cuda.device_count()
    if local_rank == 0 and device.index not in (None, 0):
        raise ValueError(
            f"a tensor-parallel engine puts rank r on cuda:r, so rank 0 runs on cuda:0, not "
            f"{device}: choose the GPUs with CUDA_VISIBLE_DEVICES (e.g. "
            f"CUDA_VISIBLE_DEVICES={device.index},{device.index + 1}) and pass --device cuda")
    if count >= local_world:
        return torch.device("cuda", local_rank)
    if model_backend(device) == "gloo" and count:
        return torch.device("cuda", local_rank % count)
    raise ValueError(
        f"this host runs {local_world} ranks of a tensor-parallel engine, one GPU each, but "
        f"sees {count} GPU(s): run it on a host with {local_world} GPUs (CUDA_VISIBLE_DEVICES "
        "lists them), across hosts with torchrun, or build the engine with a smaller --tp")


def cpu_share(tp: int) -> int:
    """Torch threads of one rank of a CPU engine: its share of this machine's cores
    (``tp`` processes of all the cores each thrash: smollm2 tp 3 on 2 cores 35 s -> 7 s)."""
    return max(1, (os.cpu_count() or 1) // tp)


def _exited(procs: list[subprocess.Popen], store: dist.Store) -> list[str]:
    """Why each follower that exited did: the error it published in the store, else its
    exit code or signal (follower i is rank i + 1)."""
    reasons = []
    for rank, proc in enumerate(procs, 1):
        if proc.poll() is None:
            continue
        key = f"kiln/error/{rank}"
        if store.check([key]):
            reasons.append(f"rank {rank} failed: {store.get(key).decode()}")
            continue
        rc = proc.returncode
        how = (f"was killed by signal {signal.Signals(-rc).name}" if rc < 0
               else f"exited with code {rc}")
        reasons.append(f"rank {rank} (pid {proc.pid}) {how}")
    return reasons


def _published(store: dist.Store, world: int) -> list[str]:
    """The errors that followers rank 0 did not start (launch.py) published in the store."""
    keys = [f"kiln/error/{rank}" for rank in range(1, world)]
    return [f"rank {k.rsplit('/', 1)[1]} failed: {store.get(k).decode()}" for k in keys
            if store.check([k])]


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
