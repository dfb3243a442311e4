"""Tensor parallelism: one engine over N ranks, one process each, on torch.distributed.

    ranks.py    Ranks: a process's rank; rank 0 starts the followers, watches and ends them
    worker.py   a follower process (python -m kiln.runtime.parallel.worker)
    launch.py   across hosts: under torchrun, torchrun's workers are the ranks
    supervisor.py  heartbeats over the rendezvous store; rank 0's watch that ends every rank
    group.py    TPGroup: the model's collectives (NCCL on CUDA, gloo on the CPU) and rank
                0's command channel (gloo)
    layers.py   row-parallel o_proj / down, vocab-parallel embedding and head
    control.py  what rank 0 sends: each step (its sizes and graph, the staged inputs by
                broadcast), eager forwards' inputs, KV moves, device speculation writes

Rank 0 runs the engine as for tp 1 (scheduler, runner, sampler, speculative workers) on its
shard; the others run the same forwards on theirs, the same CUDA graphs on CUDA. Rank 0
alone samples (every rank gets the head's gathered logits), and the tokens it picks reach
the others as the next step's inputs, so sampling state (seeds, grammars, penalties, host
speculative pools) exists once; device speculation state is on every rank, kept equal. An
engine without a ``parallel`` section (tp 1) never imports this package. The weight
layout is kiln.artifact.parallel's.
"""

from __future__ import annotations

from kiln.runtime.parallel.ranks import Ranks, TensorParallelError

__all__ = ["Ranks", "TensorParallelError"]
