"""The parts of a running engine, built from its recorded configuration and weights:
model, KV cache, scheduler, model runner (staging, CUDA graphs) and sampler, warmed up, with
the seconds each phase took. ``LLMEngine`` runs them; this module only assembles them."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.artifact.speculative import SpeculativeConfig
from kiln.config import ModelConfig
from kiln.runtime.config import EngineLimits, RuntimeConfig
from kiln.runtime.kv_cache import BlockManager, KVCache, fp8_kv_scales
from kiln.runtime.layers.attention_registry import BACKENDS, TRITON_BACKENDS, get_backend
from kiln.runtime.layers.linear import place_weights
from kiln.runtime.layers.sampler import Sampler
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.models.llama import LlamaModel
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.sizing import Sizing, kv_pool, size_engine
from kiln.runtime.speculative.device_step import DeviceProposer, DeviceSpecStep
from kiln.runtime.speculative.draft_model import DraftModel
from kiln.runtime.speculative.workers import device_by_default, make_device_state
from kiln.runtime.warmup import warm_eager_forward, warm_moved_rows, warm_sampler

if TYPE_CHECKING:
    from kiln.runtime.parallel import Ranks


@dataclass
class EngineParts:
    """What ``assemble`` built. ``startup_times``: seconds per phase and ``total_s``."""

    device: torch.device
    attention_backend: str
    model: LlamaModel
    cache: KVCache
    blocks: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    startup_times: dict[str, float]
    sizing: Sizing  # the limits it serves, the KV pool and running batch, and why
    # the speculative mode's device proposer (its state on the device), or None
    device_state: DeviceProposer | None = None
    draft: DraftModel | None = None  # a draft-model engine's draft
    # step class -> backend, from engine.json ``attention`` (None: the backend's own default)
    attention_classes: dict[str, str] | None = None


def assemble(model_config: ModelConfig, weights: dict[str, torch.Tensor],
             limits: EngineLimits, dtype: torch.dtype, config: RuntimeConfig,
             speculative: SpeculativeConfig,
             draft: tuple[ModelConfig, dict[str, torch.Tensor]] | None = None,
             attention: dict | None = None, tp: Ranks | None = None) -> EngineParts:
    """Place the weights, build the model and the KV cache (sized from free memory unless
    ``config.num_kv_blocks``, and the running batch with it: kiln/runtime/sizing.py; the
    limits the engine serves are ``EngineParts.sizing.limits``), the scheduler and the
    runner; on the Triton path stage the steps and capture CUDA graphs, then compile what
    the graphs did not. ``draft``: the draft model's config and weights (a draft-model
    engine): its own model, runner and KV cache of as many blocks as the target's
    (``DraftModel``). ``attention``: engine.json's ``attention`` section (the backend
    measured at build), which "auto" follows on CUDA.
    ``tp``: this process's rank of a tensor-parallel engine (kiln.runtime.parallel.Ranks):
    ``weights`` are its shard, the model and cache its share, as many KV blocks on every
    rank; on rank 0 the model, the cache and the device speculation state send what they do
    to the other ranks."""
    t_start = time.perf_counter()
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    weights = place_weights(weights, device, dtype)  # FP8 + scales keep their dtype
    backend, classes = resolve_backend(config.attention_backend, device, attention)
    # The Triton kernels (fused norm / rotary / activation) go with the Triton backend
    # (off CUDA that backend runs only under TRITON_INTERPRET, in tests).
    fused = backend in TRITON_BACKENDS
    if tp is not None and draft is not None:
        raise ValueError("a draft-model engine cannot be tensor-parallel; rebuild it "
                         "without --tp")
    c = tp.local_config() if tp is not None else model_config  # a rank's heads and MLP
    model = LlamaModel(c, weights, get_backend(backend, classes), device, fused=fused,
                       max_positions=limits.max_seq_len + limits.max_num_tokens + 64, tp=tp)
    t_model = time.perf_counter()
    bs = config.block_size
    kv_scales = fp8_kv_scales(weights, c.num_layers)  # None: KV in `dtype`
    kv_dtype = dtype if kv_scales is None else torch.float8_e4m3fn
    # the pool is sized at the cache's own element size (an FP8 cache holds twice the tokens
    # of a bf16 one in the same memory)
    block_bytes = KVCache.bytes_per_block(c.num_layers, bs, c.num_kv_heads, c.head_dim,
                                          kv_dtype)
    if draft is not None:  # a block id holds the request's target and draft KV
        dc = draft[0]
        block_bytes += KVCache.bytes_per_block(dc.num_layers, bs, dc.num_kv_heads, dc.head_dim,
                                               dtype)
    pool = kv_pool(block_bytes, limits, config, device)
    if tp is not None:
        pool = dataclasses.replace(pool, num_blocks=tp.agree_num_blocks(pool.num_blocks))
    sizing = size_engine(limits, pool, config)
    limits, num_blocks = sizing.limits, pool.num_blocks  # the limits it serves
    cache = KVCache(c.num_layers, num_blocks, bs, c.num_kv_heads, c.head_dim, kv_dtype, device,
                    *(kv_scales or ()), layout=config.kv_layout)
    blocks = BlockManager(num_blocks, bs, config.enable_prefix_caching)
    scheduler = Scheduler(blocks, max_num_seqs=sizing.max_num_seqs,
                          max_num_tokens=sizing.max_num_tokens, max_seq_len=limits.max_seq_len,
                          reserve=config.reserve_kv)
    t_cache = time.perf_counter()
    runner = ModelRunner(model, cache, device)
    # under tp every rank holds the same state and runs the same device steps
    device_state = (make_device_state(speculative, scheduler.max_num_seqs, limits.max_seq_len,
                                      device)
                    if device_speculation_on(config, speculative, device) else None)
    if device_state is not None:
        runner.spec_step = DeviceSpecStep(device_state)  # before the graphs capture it
    graphs_s = 0.0
    tokens_per_step = speculative.tokens_per_step if speculative.enabled else 1
    max_seqs, max_tokens = scheduler.max_num_seqs, scheduler.max_num_tokens
    if fused:  # the Triton path: staged inputs (and CUDA graphs on CUDA)
        runner.use_staging(max_seqs, max_tokens, limits.max_seq_len, tokens_per_step)
        if config.cuda_graphs and (tp is None or tp.graphs_possible(device)):
            # every rank captures the same buckets in the same order (their warm-up forwards'
            # collectives pair up); a rank whose capture fails stops the engine
            graphs_s = runner.capture_graphs(max_seqs, max_tokens, tokens_per_step,
                                             config.max_graph_tokens, config.prefill_graphs,
                                             strict=tp is not None)
    draft_model = (_assemble_draft(*draft, num_blocks, limits, dtype, config, device, backend,
                                   max_seqs, max_tokens, model_config.vocab_size)
                   if draft is not None else None)
    sampler = Sampler()
    t_warm = time.perf_counter()
    if fused and device.type == "cuda":  # what the graphs did not compile (every rank)
        warm_eager_forward(model, cache, runner.stager, tokens_per_step)
        warm_sampler(sampler, model_config.vocab_size, device)
        if device_state is not None:
            device_state.warm()
    if tp is not None:  # from here on rank 0 sends what it runs to the other ranks
        tp.ready()
        model, cache, device_state = tp.lead(model, cache, device_state)
        runner.leader, runner.cache = (model, cache) if tp.rank == 0 else (None, cache)
    times = {"place_weights_s": t_model - t_start, "kv_cache_s": t_cache - t_model,
             "cuda_graphs_s": graphs_s, "warmup_s": time.perf_counter() - t_warm,
             "total_s": time.perf_counter() - t_start}
    return EngineParts(device, backend, model, cache, blocks, scheduler, runner, sampler, times,
                       sizing, device_state, draft_model, classes)


def _assemble_draft(cfg: ModelConfig, weights: dict[str, torch.Tensor], num_blocks: int,
                    limits: EngineLimits, dtype: torch.dtype, config: RuntimeConfig,
                    device: torch.device, backend: str, max_seqs: int, max_tokens: int,
                    target_vocab: int) -> DraftModel:
    """The draft model, its KV cache (``num_blocks``, the target's block ids) and runner
    (on the Triton path staged, with decode and prefill CUDA graphs)."""
    weights = place_weights(weights, device, dtype)
    fused = backend in TRITON_BACKENDS
    model = LlamaModel(cfg, weights, get_backend(backend), device, fused=fused,
                       max_positions=limits.max_seq_len + limits.max_num_tokens + 64)
    cache = KVCache(cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads,
                    cfg.head_dim, dtype, device, layout=config.kv_layout)
    runner = ModelRunner(model, cache, device)
    if fused:
        runner.use_staging(max_seqs, max_tokens, limits.max_seq_len, 1)
        if config.cuda_graphs:
            runner.capture_graphs(max_seqs, max_tokens, 1, config.max_graph_tokens,
                                  config.prefill_graphs)
        if device.type == "cuda":
            warm_eager_forward(model, cache, runner.stager, 1)
            warm_moved_rows(runner)
    return DraftModel(runner, min(cfg.vocab_size, target_vocab), max_tokens, target_vocab)


def device_speculation_on(config: RuntimeConfig, speculative: SpeculativeConfig,
                          device: torch.device) -> bool:
    """Whether greedy speculative requests keep their state on the device:
    ``config.device_speculation``, or where that is None the measured default, prompt
    lookup on CUDA (RuntimeConfig's comment has the numbers)."""
    if config.device_speculation is not None:
        return config.device_speculation
    return device_by_default(speculative) and device.type == "cuda"


def resolve_backend(name: str, device: torch.device, recorded: dict | None = None
                    ) -> tuple[str, dict[str, str] | None]:
    """The attention backend to run and its step classes. A name other than "auto" (the
    runtime's ``attention_backend``) is taken as given. "auto": on CUDA with triton, the
    engine's recorded choice (engine.json ``attention``: measured at build, or the build's
    ``--attention-backend``), else Triton; elsewhere the torch reference."""
    if name != "auto":
        return name, None
    if device.type == "cuda":
        from kiln.runtime import kernels

        if kernels.available():
            rec = recorded or {}
            if rec.get("backend") in BACKENDS:
                return rec["backend"], rec.get("classes")
            return "triton", None
    return "torch", None
