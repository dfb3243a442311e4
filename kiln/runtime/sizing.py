"""How big a running engine is: its KV pool, its running batch and the sequence length it
serves, from the engine's recorded limits and the device's memory; and the one line that
says so (``kiln serve`` prints it).

The KV pool takes what memory is left once the weights are placed (as vLLM's does), not
max_batch_size x max_seq_len; the running batch is max_batch_size or what that pool holds at
``RUNNING_SEQ_TOKENS`` tokens a sequence, whichever is fewer.

- CUDA: the ``gpu_memory_utilization`` share of free memory less ``GPU_HEADROOM_BYTES`` (the
  CUDA graphs, activations and speculative state are allocated after the pool), at most
  max_batch_size full sequences. One max_seq_len sequence must fit, else a ValueError that
  names the tokens that do fit and the fix.
- CPU (the reference and test path): at most ``CPU_KV_SEQS`` full sequences and at most
  ``CPU_KV_BYTES``, so an engine that records a long context (random:llama-3-8b: 131,072
  tokens) starts with a bounded pool. When that pool holds fewer tokens than max_seq_len, the
  engine serves sequences of what it holds (``Sizing.limits``: max_seq_len and max_input_len
  lowered, the rest as recorded) and a longer prompt is refused at admission; the line says
  so and how to get the recorded context (``num_kv_blocks``).
- ``RuntimeConfig.num_kv_blocks`` given: that pool, and the running batch is max_batch_size;
  a pool that cannot hold one max_seq_len sequence is a ValueError.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kiln.runtime.config import EngineLimits, RuntimeConfig

# The CPU pool's ceilings (CPU memory is shared with everything, and the CPU runs the
# reference path and the tests, which a larger pool buys nothing): 64 full sequences, 1 GiB.
CPU_KV_SEQS = 64
CPU_KV_BYTES = 1 << 30
# On CUDA, what the pool leaves free beyond the utilization share: CUDA graphs, activations
# of the largest eager step, the device speculation state.
GPU_HEADROOM_BYTES = 1 << 30
# The context a running sequence is assumed to average when the pool caps the running batch.
# Short on purpose: the cap must not cost batch where requests are short (a 128-token prompt
# and answer hold 256); a pool that turns out too small for the running batch preempts the
# newest request (it recomputes later), nothing is lost. Not measured: a guess on the side of
# the larger batch.
RUNNING_SEQ_TOKENS = 512


@dataclass(frozen=True)
class KVPool:
    """KV blocks and where their number came from: ``source`` "cuda", "cpu" or "given"
    (``RuntimeConfig.num_kv_blocks``); ``why`` says it in words for the start-up line."""

    num_blocks: int
    block_size: int
    source: str
    why: str

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size


def kv_pool(bytes_per_block: int, limits: EngineLimits, config: RuntimeConfig,
            device: torch.device) -> KVPool:
    """The KV pool of an engine with these limits on ``device`` (module docstring); measured
    after the weights are placed."""
    bs = config.block_size
    if config.num_kv_blocks:
        return KVPool(config.num_kv_blocks, bs, "given", "num_kv_blocks")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization) - GPU_HEADROOM_BYTES
        seqs = limits.max_batch_size
        why = (f"{config.gpu_memory_utilization:g} of the {free / 2**30:.1f} GiB free after the "
               f"weights, less {GPU_HEADROOM_BYTES / 2**30:g} GiB")
    else:
        budget, seqs = CPU_KV_BYTES, min(limits.max_batch_size, CPU_KV_SEQS)
        why = f"CPU: at most {CPU_KV_SEQS} sequences, {CPU_KV_BYTES / 2**30:g} GiB"
    want = -(-seqs * limits.max_seq_len // bs)  # no more than that many full sequences
    return KVPool(max(0, min(want, budget // bytes_per_block)), bs, device.type, why)


@dataclass(frozen=True)
class Sizing:
    """What an engine runs with. ``limits``: the limits it serves (the recorded ones, or on
    the CPU a shorter max_seq_len, see the module docstring); ``recorded``: engine.json's."""

    limits: EngineLimits
    recorded: EngineLimits
    pool: KVPool
    max_num_seqs: int
    max_num_tokens: int
    seqs_why: str
    tokens_why: str

    def line(self) -> str:
        """One line: the sequence length, token budget, running batch and KV pool chosen,
        each with where it came from."""
        lim, rec, pool = self.limits, self.recorded, self.pool
        seq = f"max_seq_len {lim.max_seq_len:,} "
        seq += ("(engine)" if lim.max_seq_len == rec.max_seq_len else
                f"(what the KV pool holds; the engine records {rec.max_seq_len:,}: give "
                f"num_kv_blocks={-(-rec.max_seq_len // pool.block_size)} or more to serve it)")
        return (f"{seq}, max_num_tokens {self.max_num_tokens:,} ({self.tokens_why}), running "
                f"batch {self.max_num_seqs:,} ({self.seqs_why}), KV cache {pool.num_blocks:,} "
                f"blocks x {pool.block_size} = {pool.tokens:,} tokens ({pool.why})")


def size_engine(limits: EngineLimits, pool: KVPool, config: RuntimeConfig) -> Sizing:
    """The sizing of an engine with these recorded limits over ``pool`` (module docstring).
    Raises ValueError when a given or CUDA pool cannot hold one max_seq_len sequence."""
    served = limits
    if pool.tokens < limits.max_seq_len:
        if pool.source != "cpu":
            raise ValueError(_too_small(limits, pool))
        room = limits.max_seq_len - limits.max_input_len  # the output and draft room
        if pool.tokens <= room:
            raise ValueError(_too_small(limits, pool))
        served = dataclasses.replace(limits, max_seq_len=pool.tokens,
                                     max_input_len=pool.tokens - room)
    if config.max_num_seqs:
        seqs, seqs_why = config.max_num_seqs, "runtime config"
    elif pool.source == "given":
        seqs, seqs_why = limits.max_batch_size, "engine max_batch_size"
    else:
        avg = min(served.max_seq_len, RUNNING_SEQ_TOKENS)
        holds = max(1, pool.tokens // avg)
        seqs = min(limits.max_batch_size, holds)
        seqs_why = (f"engine max_batch_size; the KV pool holds {holds:,} sequences of {avg:,} "
                    "tokens" if seqs == limits.max_batch_size else
                    f"the KV pool holds {holds:,} sequences of {avg:,} tokens; engine "
                    f"max_batch_size {limits.max_batch_size:,}")
    tokens = config.max_num_tokens or limits.max_num_tokens
    tokens_why = "runtime config" if config.max_num_tokens else "engine"
    return Sizing(served, limits, pool, seqs, tokens, seqs_why, tokens_why)


def _too_small(limits: EngineLimits, pool: KVPool) -> str:
    need = -(-limits.max_seq_len // pool.block_size)
    if pool.source != "cuda":
        what = (f"num_kv_blocks {pool.num_blocks:,} x block_size {pool.block_size} holds "
                f"{pool.tokens:,} tokens")
        fix = f"use num_kv_blocks={need} or more"
    else:
        what = (f"the KV cache holds {pool.tokens:,} tokens ({pool.num_blocks:,} blocks of "
                f"{pool.block_size}; {pool.why})")
        fix = (f"rebuild the engine with --max-seq-len {pool.tokens} or less, or give the KV "
               "cache more memory (gpu_memory_utilization, or a card with more free memory)")
    return (f"{what}, fewer than max_seq_len {limits.max_seq_len:,}; one request must always "
            f"fit: {fix}")
