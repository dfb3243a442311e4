"""The running engine's configuration: ``RuntimeConfig`` (knobs of one process) and
``EngineLimits`` (what engine.json recorded and the runtime enforces)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.env import env_flag, env_flag_or_none, env_str, kv_layout


@dataclass(frozen=True)
class RuntimeConfig:
    """Knobs of one running engine (the engine's limits come from engine.json).

    ``num_kv_blocks=None`` sizes the cache from free memory (CUDA: ``gpu_memory_utilization``
    of what the weights leave, less 1 GiB) or on the CPU at most 64 full sequences and 1 GiB,
    and the running batch from that cache (kiln/runtime/sizing.py); given, it must hold one
    max_seq_len sequence and the batch is max_batch_size. ``max_num_tokens``/``max_num_seqs``
    of None take those. Fields that default from an environment variable
    read it when the config is made (kiln/runtime/env.py lists them); a field given
    explicitly wins.
    """

    device: str | None = None  # "cuda" when available, else "cpu"
    block_size: int = 16
    # How a KV block sits in memory (kiln/runtime/kv_cache.py): "HND" (a head's tokens side by
    # side: a decode reads a head's block in one run; llama-3-8b FP8 decode step at batch 256
    # 1.6 % faster, docs/decisions.md "KV cache layout HND") or "NHD" (a token's heads side by
    # side).
    kv_layout: str = field(default_factory=kv_layout)
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_tokens: int | None = None
    enable_prefix_caching: bool = True
    # Admit a waiting request only while the KV pool holds what it and the running requests
    # are expected to grow to (kiln/runtime/scheduler.py); off: admit while its prompt fits
    # and preempt (recompute) the newest when blocks run out.
    reserve_kv: bool = field(default_factory=lambda: env_flag("KILN_RESERVE_KV", True))
    gpu_memory_utilization: float = 0.85
    # "auto": the Triton kernels on CUDA when triton imports, else the torch reference.
    attention_backend: str = field(
        default_factory=lambda: env_str("KILN_ATTENTION_BACKEND", "auto"))
    # CUDA graphs for decode / speculative / short steps (CUDA + the triton backend only).
    cuda_graphs: bool = field(default_factory=lambda: env_flag("KILN_CUDA_GRAPHS", True))
    # Steps of at most this many tokens may run as graphs (larger ones run eagerly).
    max_graph_tokens: int = 1024
    # Graphs for steps with more tokens than the decode buckets hold (prompts, prompt chunks
    # beside decodes; kiln/runtime/cuda_graph.py); off: a shorter start-up, such steps eager.
    prefill_graphs: bool = field(default_factory=lambda: env_flag("KILN_PREFILL_GRAPHS", True))
    # Launch the next decode step before reading this step's tokens (host work overlaps the
    # GPU; see LLMEngine.step).
    async_scheduling: bool = field(
        default_factory=lambda: env_flag("KILN_ASYNC_SCHEDULING", True))
    # A request speculates only while its speculative steps are expected to commit more
    # tokens than a step costs in decode steps at the running batch, estimated from what it
    # commits (kiln/runtime/speculative/pace.py; output unchanged). On by default: it beat
    # always-speculating on every bundled prompt set (docs/decisions.md).
    adaptive_speculation: bool = field(
        default_factory=lambda: env_flag("KILN_ADAPTIVE_SPECULATION", True))
    # The break-even in committed tokens per speculative step; None: measured at start-up on
    # CUDA (speculative/break_even.py), and no pacing where there is nothing to measure.
    spec_break_even: float | None = None
    # Speculative state, proposal, greedy verification and the KV move of accepted rows on
    # the device for greedy requests (lookahead at the engine's window:
    # kiln/runtime/speculative/device_lookahead.py; prompt lookup: device_ngram.py; a draft
    # model's verification: device_draft.py), inside the masked buckets' CUDA graphs and the
    # async pipeline; the host worker stays for the rest. None (the default): on for
    # prompt-lookup engines on CUDA, where it beat the host worker (smollm2 grounded prompts
    # 1.80x vs 1.16x plain at batch 1, 1.22x vs 0.76x at batch 8), on for draft-model
    # engines on CUDA (7B / 0.5B shapes, K=4: a step 1.789x a plain one vs 1.910x, batch 1;
    # docs/decisions.md), off for lookahead: equal to plain greedy on the H200 (real smollm2, float32)
    # but no faster than the host worker there (bf16 (7,7,7), 2026-12-04: grounded 1.15x vs
    # 1.22x at batch 1, 0.87x vs 0.77x at batch 8; chat 0.89x vs 0.95x; docs/decisions.md).
    device_speculation: bool | None = field(
        default_factory=lambda: env_flag_or_none("KILN_DEVICE_SPECULATION"))


@dataclass(frozen=True)
class EngineLimits:
    """The subset of the engine's recorded limits the runtime enforces."""

    max_batch_size: int
    max_seq_len: int
    max_input_len: int
    max_num_tokens: int
