"""Tensor parallelism: one engine over N ranks, one process each, on torch.distributed.

    ranks.py    Ranks: a process's rank; rank 0 starts the followers, watches and ends them
    worker.py   a follower process (python -m kiln.runtime.parallel.worker)
    launch.py   across hosts: under torchrun, torchrun's workers are the ranks
    supervisor.py  heartbeats over the rendezvous store; rank 0's watch that ends every rank
    group.py    TPGroup: the model's collectives and rank 0's command channel (gloo)
    layers.py   row-parallel o_proj / down, vocab-parallel embedding and head
    control.py  rank 0's model and cache send each forward's inputs and each KV move

Rank 0 runs the engine as for tp 1 (scheduler, runner, sampler, speculative workers) on its
shard; the others run the same forwards on theirs. Rank 0 alone samples: the head's logits
are gathered there, and the tokens it picks reach the others as the next forward's inputs,
so sampling state (seeds, grammars, penalties, speculative pools) exists once. An engine
without a ``parallel`` section (tp 1) never imports this package. The weight layout is
kiln.artifact.parallel's.
"""

from __future__ import annotations

from kiln.runtime.parallel.ranks import Ranks, TensorParallelError

__all__ = ["Ranks", "TensorParallelError"]
