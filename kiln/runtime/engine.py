"""LLMEngine: add_request / step / abort. The only entry point serve and bench use."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.builder.speculative import SpeculativeConfig, validate_request_window
from kiln.config import ModelConfig
from kiln.dtypes import TORCH_DTYPES
from kiln.errors import RequestError
from kiln.runtime.cuda_graph import CudaGraphRunner, report_capture_failures
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.env import env_flag, env_str
from kiln.runtime.host_copy import to_device
from kiln.runtime.kv_cache import BlockManager, KVCache, fp8_kv_scales
from kiln.runtime.layers.attention import get_backend
from kiln.runtime.layers.linear import place_weights
from kiln.runtime.layers.sampler import INVALID_TOKEN, Sampler, describe_bad_row, kernels_enabled
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.models.llama import LlamaModel
from kiln.runtime.outputs import RequestOutput, TokenLogprob
from kiln.runtime.request import Request, request_output
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import ScheduledBatch, Scheduler
from kiln.runtime.speculative.break_even import spec_break_even
from kiln.runtime.speculative.pace import SpecPace
from kiln.runtime.speculative.workers import make_worker
from kiln.runtime.staging import StepStager
from kiln.runtime.warmup import warm_eager_forward, warm_sampler

# KV cache budget on CPU when the size is not given (CPU memory is shared with everything).
_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class RuntimeConfig:
    """Knobs of one running engine (the engine's limits come from engine.json).

    ``num_kv_blocks=None`` sizes the cache from free memory (CUDA) or from
    max_batch_size x max_seq_len capped at 1 GiB (CPU). ``max_num_tokens``/``max_num_seqs``
    of None take the engine's limits.
    """

    device: str | None = None  # "cuda" when available, else "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_tokens: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.85
    # "auto": the Triton kernels on CUDA when triton imports, else the torch reference.
    # KILN_ATTENTION_BACKEND=torch|triton overrides the default.
    attention_backend: str = field(
        default_factory=lambda: env_str("KILN_ATTENTION_BACKEND", "auto"))
    # CUDA graphs for decode / speculative / short steps (CUDA + the triton backend only).
    # KILN_CUDA_GRAPHS=0 turns them off.
    cuda_graphs: bool = field(
        default_factory=lambda: env_flag("KILN_CUDA_GRAPHS", True))
    # Steps of at most this many tokens may run as graphs (larger ones run eagerly).
    max_graph_tokens: int = 1024
    # Graphs for steps with more tokens than the decode buckets hold (prompts, prompt chunks
    # beside decodes; kiln/runtime/cuda_graph.py). KILN_PREFILL_GRAPHS=0 turns them off
    # (shorter start-up; such steps then run eagerly).
    prefill_graphs: bool = field(
        default_factory=lambda: env_flag("KILN_PREFILL_GRAPHS", True))
    # Schedule and launch the next decode step before reading this step's tokens (host work
    # overlaps the GPU; see LLMEngine.step). KILN_ASYNC_SCHEDULING=0 turns it off.
    async_scheduling: bool = field(
        default_factory=lambda: env_flag("KILN_ASYNC_SCHEDULING", True))
    # Pause a request's speculation while it commits fewer tokens per speculative step than
    # the step costs in decode steps (kiln/runtime/speculative/pace.py; output unchanged).
    # On by default: it beat always-speculating on code and chat alike (docs/decisions.md);
    # KILN_ADAPTIVE_SPECULATION=0 turns it off.
    adaptive_speculation: bool = field(
        default_factory=lambda: env_flag("KILN_ADAPTIVE_SPECULATION", True))
    # The break-even in committed tokens per speculative step; None: measured at start-up on
    # CUDA (speculative/break_even.py: whole engine steps for lookahead, else graph
    # replays), and no pacing where there is nothing to measure (no CUDA graphs).
    spec_break_even: float | None = None


@dataclass
class StepResult:
    """Tokens each request commits this step, and how many of its tokens now have KV.

    ``advance`` overrides the scheduled token count (speculative steps keep fewer);
    ``draft_logits`` holds draft plans' rows for the speculative worker to verify.
    """

    tokens: dict[Request, list[int]] = field(default_factory=dict)
    logprobs: dict[Request, list[TokenLogprob]] = field(default_factory=dict)
    advance: dict[Request, int] = field(default_factory=dict)
    draft_logits: dict[Request, torch.Tensor] = field(default_factory=dict)
    verified: set[Request] = field(default_factory=set)  # requests whose draft was verified


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device, tokens not yet read.

    ``host`` receives ``tokens`` (pinned on CUDA) and is valid once ``ready`` has passed.
    ``advanced``: the scheduler already counted this step's KV (a next step was scheduled
    on top of it); ``placeholders``: requests holding a stand-in for this step's token.
    """

    batch: ScheduledBatch
    reqs: list[Request]
    tokens: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None
    advanced: bool = False
    placeholders: list[Request] = field(default_factory=list)


@dataclass(frozen=True)
class EngineLimits:
    """The subset of the engine's recorded limits the runtime enforces."""

    max_batch_size: int
    max_seq_len: int
    max_input_len: int
    max_num_tokens: int


class LLMEngine:
    """Runs a built engine. Not thread-safe: one thread calls these methods."""

    def __init__(
        self, model_config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Any,
        limits: EngineLimits, dtype: torch.dtype, config: RuntimeConfig | None = None,
        spec: Any = None,
    ):
        t_start = time.perf_counter()
        config = config or RuntimeConfig()
        self.config = config
        self.spec = spec
        self.generation_defaults = dict(spec.generation_defaults.values) if spec is not None else {}
        self.model_config = model_config
        self.limits = limits
        self.dtype = dtype
        self.device = torch.device(
            config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.tokenizer = tokenizer
        weights = place_weights(weights, self.device, dtype)  # FP8 + scales keep their dtype
        self.attention_backend = _resolve_backend(config.attention_backend, self.device)
        # The Triton kernels (fused norm / rotary / activation) go with the Triton backend
        # (off CUDA that backend runs only under TRITON_INTERPRET, in tests).
        fused = self.attention_backend == "triton"
        self.model = LlamaModel(model_config, weights, get_backend(self.attention_backend),
                                self.device, fused=fused,
                                max_positions=limits.max_seq_len + limits.max_num_tokens + 64)
        t_model = time.perf_counter()
        num_blocks = config.num_kv_blocks or self._auto_num_blocks()
        if num_blocks * config.block_size < limits.max_seq_len:
            raise ValueError(
                f"num_kv_blocks={num_blocks} x block_size={config.block_size} holds fewer "
                f"tokens than max_seq_len={limits.max_seq_len}; one request must always fit: "
                f"use at least {-(-limits.max_seq_len // config.block_size)} blocks"
            )
        kv_scales = fp8_kv_scales(weights, model_config.num_layers)  # None: KV in `dtype`
        self.cache = KVCache(model_config.num_layers, num_blocks, config.block_size,
                             model_config.num_kv_heads, model_config.head_dim,
                             dtype if kv_scales is None else torch.float8_e4m3fn, self.device,
                             *(kv_scales or ()))
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=config.max_num_seqs or limits.max_batch_size,
            max_num_tokens=config.max_num_tokens or limits.max_num_tokens,
        )
        t_cache = time.perf_counter()
        self.runner = ModelRunner(self.model, self.cache, self.device)
        # Speculative settings come from the engine artifact only (validated at build).
        self.speculative = spec.speculative if spec is not None else SpeculativeConfig()
        graphs_s = 0.0
        tokens_per_step = self.speculative.tokens_per_step if self.speculative.enabled else 1
        if fused:  # the Triton path: staged inputs (and CUDA graphs on CUDA)
            max_seqs = self.scheduler.max_num_seqs
            self.runner.stager = StepStager(
                max_seqs, max(self.scheduler.max_num_tokens, max_seqs * tokens_per_step),
                # room for a full request plus one speculative step
                -(-(limits.max_seq_len + tokens_per_step) // config.block_size),
                config.block_size, max_seqs * tokens_per_step ** 2 if tokens_per_step > 1 else 0,
                self.device)
            if config.cuda_graphs:
                self.runner.graphs = CudaGraphRunner(
                    self.model, self.cache, self.runner.stager, max_seqs,
                    self.scheduler.max_num_tokens, tokens_per_step, config.max_graph_tokens,
                    prefill=config.prefill_graphs)
                graphs_s = self.runner.graphs.capture()
                report_capture_failures(self.runner)
        self.sampler = Sampler()
        t_warm = time.perf_counter()
        if fused and self.device.type == "cuda":  # what the graphs did not compile
            warm_eager_forward(self.model, self.cache, self.runner.stager, tokens_per_step)
            warm_sampler(self.sampler, model_config.vocab_size, self.device)
        # Seconds from the constructor's start; from_engine_dir adds the weight loading.
        self.startup_times = {"place_weights_s": t_model - t_start,
                              "kv_cache_s": t_cache - t_model, "cuda_graphs_s": graphs_s,
                              "warmup_s": time.perf_counter() - t_warm,
                              "total_s": time.perf_counter() - t_start}
        self.detokenizer = Detokenizer(tokenizer)
        eos = set(model_config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.spec_worker = make_worker(self.speculative)
        self._guided_compiler = None
        self._requests: dict[str, Request] = {}
        self._failed: list[Request] = []  # failed in the running step; reported with its outputs
        self._step_reqs: list[Request] = []  # the requests the running step serves
        self._ids = itertools.count()
        self.num_steps = 0
        self.spec_stats = {"steps": 0, "accepted_tokens": 0}  # over all requests
        self.spec_break_even = None  # set below, once the engine can run steps
        # compiled kernels the engine directory shipped for this machine (from_engine_dir)
        self.kernels_installed: dict[str, int] = {}
        self.async_scheduling = config.async_scheduling  # may be switched between steps
        self._inflight: LaunchedStep | None = None
        self._host_tokens = [torch.empty(self.scheduler.max_num_seqs, dtype=torch.long,
                                         pin_memory=self.device.type == "cuda")
                             for _ in range(2)]  # two: one per step in flight
        self._host_turn = 0
        if self.spec_worker:
            t_pace = time.perf_counter()
            self.spec_break_even = spec_break_even(self)
            self.startup_times["spec_break_even_s"] = time.perf_counter() - t_pace
            self.startup_times["total_s"] += self.startup_times["spec_break_even_s"]

    @classmethod
    def from_engine_dir(cls, path: str | Path, config: RuntimeConfig | None = None) -> LLMEngine:
        """Load a directory written by ``kiln build``."""
        from kiln.builder import load_engine

        config = config or RuntimeConfig()
        art = load_engine(path)
        spec = art.spec
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        from kiln.runtime.kernels import tuning  # build-time tuned kernel configs (no re-tuning)

        tuning.install(spec.kernel_configs, device)
        kernels, kernels_s = {}, 0.0
        if torch.device(device).type == "cuda":  # before anything compiles
            from kiln.runtime.kernel_cache import install_for_engine

            kernels, kernels_s = install_for_engine(Path(path), device)
        dtype = TORCH_DTYPES[spec.dtype]
        lim = spec.limits
        limits = EngineLimits(lim.max_batch_size, lim.max_seq_len, lim.max_input_len,
                              lim.max_num_tokens)
        t0 = time.perf_counter()
        weights = art.load_weights(device, dtype)
        tokenizer = art.load_tokenizer()
        load_s = time.perf_counter() - t0
        engine = cls(spec.model, weights, tokenizer, limits, dtype, config, spec=spec)
        engine.startup_times = {"load_weights_s": load_s, **engine.startup_times,
                                "total_s": load_s + engine.startup_times["total_s"]}
        if kernels:  # the engine shipped compiled kernels for this machine
            engine.startup_times = {"install_kernels_s": kernels_s, **engine.startup_times,
                                    "total_s": kernels_s + engine.startup_times["total_s"]}
            engine.kernels_installed = kernels
        return engine

    def _auto_num_blocks(self) -> int:
        c = self.model_config
        per_block = KVCache.bytes_per_block(
            c.num_layers, self.config.block_size, c.num_kv_heads, c.head_dim, self.dtype
        )
        want = -(-self.limits.max_batch_size * self.limits.max_seq_len // self.config.block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization) - (1 << 30)
        else:
            budget = _CPU_KV_BYTES
        need_one = -(-self.limits.max_seq_len // self.config.block_size)
        return max(min(want, budget // per_block), need_one)

    # -- requests ------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of the engine's chat template over ``messages`` with a generation prompt."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this engine's tokenizer has no chat template; send raw text")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request (text is tokenized as-is, no chat template); returns its id."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("prompt is empty; send at least one token", "prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                               f"[0, {vocab})", "prompt")
        if len(ids) > self.limits.max_input_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens; this engine accepts at most "
                f"{self.limits.max_input_len} (max_input_len); shorten the prompt or rebuild "
                "with a larger --max-input-len", "prompt"
            )
        for name, toks in (("stop_token_ids", params.stop_token_ids),
                           ("logit_bias", [t for t, _ in params.logit_bias])):
            bad = [t for t in toks if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"{name}: token ids {bad[:5]} are outside the vocabulary "
                                   f"[0, {vocab})", name)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        req = Request(request_id, ids, params, self.eos_token_ids)
        if params.guided is not None:
            req.matcher = self.guided_compiler.compile(params.guided)
        window = self._spec_window(params)
        if window is not None:
            self.spec_worker.init_request(req, window)
            if self.spec_break_even is not None and params.seed is None:
                req.spec_pace = SpecPace(self.spec_break_even)
        self.detokenizer.init_request(req)
        self.scheduler.add(req)
        self._requests[request_id] = req
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None or req.is_finished:
            return
        self.scheduler.finish(req)
        req.finish("abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of requests that got tokens or finished.

        Async scheduling: a decode step whose tokens can stay on the device is launched, then
        the step after it is scheduled and launched on top (its input tokens copied on the
        device from this step's samples, stand-ins on the host), and only then are this
        step's tokens read and committed. The host's work of one step overlaps the GPU's
        work of the next; a request that stops on a token runs one discarded extra row.

        Failures: what goes wrong for one request (its grammar, its sampling, a logits row
        that is not finite, its speculative proposal or verification, its detokenization)
        fails that request alone (``fail_request``: finish_reason "error" and a message in
        its output). Any other exception fails the requests of the step it came from and the
        engine goes on; only a device that no longer works raises out of ``step()``.
        """
        self._step_reqs = []
        try:
            outputs = self._step()
        except Exception as e:
            if not self._step_reqs or self._device_broken():
                raise
            self._inflight = None
            for req in self._step_reqs:
                self.fail_request(req, "the engine step", e)
            outputs = []
        if self._failed:
            outputs += [request_output(r) for r in self._failed]
            self._failed.clear()
        return outputs

    def fail_request(self, req: Request, stage: str, cause: BaseException | str) -> None:
        """Fail one request: it finishes with reason "error" and a message naming ``stage``
        and the cause, its KV blocks are freed, its output goes out with this step's, and
        every other request goes on. A finished request is left as it is."""
        if req.is_finished:
            return
        if isinstance(cause, BaseException):
            cause = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        req.error = f"{stage} failed: {cause}"
        req.draft = None
        self.scheduler.finish(req)
        req.finish("error")
        self._requests.pop(req.request_id, None)
        self._failed.append(req)
        print(f"warning: request {req.request_id} failed ({req.error}); the engine goes on",
              file=sys.stderr, flush=True)

    def _device_broken(self) -> bool:
        """Whether the device still runs work after an exception (a CUDA fault is sticky:
        every later call fails, so the engine cannot go on)."""
        if self.device.type != "cuda":
            return False
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - any failure here means the device is gone
            return True
        return False

    def _step(self) -> list[RequestOutput]:
        launched = self._inflight
        if launched is not None and all(r.is_finished for r in launched.reqs):
            self._inflight = launched = None  # every request it ran has stopped or was aborted
        if launched is None:
            if self.spec_worker is not None:
                self.spec_worker.propose_all(list(self.scheduler.running), self.fail_request)
            batch = self.scheduler.schedule()
            self._step_reqs = [r for r, _ in batch.items]
            if not batch:
                if self.scheduler.waiting and not self.scheduler.running:
                    req = self.scheduler.waiting[0]
                    self.fail_request(
                        req, "scheduling",
                        f"its {req.num_tokens} tokens do not fit the KV cache even alone "
                        f"({self.blocks.num_blocks} blocks of {self.blocks.block_size} "
                        "tokens); give the engine more KV blocks")
                return []
            if not self._can_launch(batch):
                if self.spec_worker is not None and any(r.draft is not None
                                                        for r, _ in batch.items):
                    result = self.spec_worker.step(self, batch)
                else:
                    result = self.forward_and_sample(batch)
                return self._finish_step(batch, result)
            launched = self._launch(batch)
        else:
            self._step_reqs = list(launched.reqs)
        self._inflight = None
        try:
            self._inflight = self._launch_next(launched)
        except BaseException:
            # nothing stays in flight: drop the stand-ins, commit the launched step's real
            # tokens (later outputs carry them), then report the failure
            for r in launched.placeholders:
                r.all_token_ids.pop()
            launched.placeholders = []
            self._collect(launched)
            raise
        return self._collect(launched)

    def _can_launch(self, batch: ScheduledBatch) -> bool:
        """Whether the step's tokens can be chosen on the device alone (plain decode rows,
        no grammar, no penalties / logprobs / seeds)."""
        if not self.async_scheduling:
            return False
        reqs = [r for r, _ in batch.items]
        return (all(r.draft is None and r.matcher is None for r in reqs)
                and self.sampler.device_only([r.params for r in reqs],
                                             [r.generator for r in reqs],
                                             kernels=self.device.type == "cuda"
                                             and kernels_enabled()))

    def _launch(self, batch: ScheduledBatch,
                input_patch: torch.Tensor | None = None) -> LaunchedStep:
        fwd = self.runner.execute(batch, input_patch)
        reqs, logits = _sample_logits(fwd)
        tokens = self.sampler.choose(logits, [r.params for r in reqs],
                                     [r.generator for r in reqs])
        host, ready = tokens, None
        if self.device.type == "cuda":
            self._host_turn ^= 1
            host = self._host_tokens[self._host_turn][: len(reqs)]
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return LaunchedStep(batch, reqs, tokens, host, ready)

    def _launch_next(self, cur: LaunchedStep) -> LaunchedStep | None:
        """Schedule and launch the decode step after ``cur`` before its tokens are known, or
        None when the next step needs the host (the plain scheduler then runs after it)."""
        sched = self.scheduler
        if (len(cur.reqs) != len(cur.batch.items) or len(cur.reqs) != len(sched.running)
                or any(r.is_finished or _may_speculate_next(r) for r in cur.reqs)):
            return None  # partial prefill chunks, aborted or speculating requests
        cont = [r for r in cur.reqs
                if len(r.output_token_ids) + 1 < r.params.max_tokens
                and r.num_tokens + 1 < self.limits.max_seq_len]  # the rest stop on length
        if not cont or sched.would_admit(len(cont)):
            return None  # waiting requests would be admitted: the scheduler decides
        sched.after_step(cur.batch)
        cur.advanced = True
        batch = sched.reserve_decode(cont)
        if batch is None:
            return None  # out of blocks: the scheduler preempts
        for r in cont:
            r.all_token_ids.append(0)  # stand-in for cur's token (real one: _collect)
            cur.placeholders.append(r)
        patch = cur.tokens
        if len(cont) != len(cur.reqs):
            kept = set(cont)
            keep = [i for i, r in enumerate(cur.reqs) if r in kept]
            patch = cur.tokens[to_device(keep, torch.long, cur.tokens.device)]
        return self._launch(batch, patch)

    def _collect(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens and commit them (the step's one host sync)."""
        if launched.ready is not None:
            launched.ready.synchronize()
        tokens = launched.host.tolist()
        for r in launched.placeholders:
            r.all_token_ids.pop()
        result = StepResult()
        for i, (req, tok) in enumerate(zip(launched.reqs, tokens)):
            if tok == INVALID_TOKEN:
                self.fail_request(req, "sampling", "its logits row is not finite (NaN or inf "
                                  "in the model's output)")
            elif not req.is_finished:  # aborted while in flight: its token is dropped
                result.tokens[req] = [tok]
        return self._finish_step(launched.batch, result, advanced=launched.advanced)

    def _finish_step(self, batch: ScheduledBatch, result: StepResult,
                     advanced: bool = False) -> list[RequestOutput]:
        """Commit a step's tokens, advance the scheduler, detokenize; the step's outputs."""
        # requests that stopped or were aborted while the step was in flight are gone
        live = None if advanced else ScheduledBatch(
            [(r, n) for r, n in batch.items if not r.is_finished])
        self.num_steps += 1
        now = time.perf_counter()
        committed: dict[Request, int] = {}
        for req, toks in result.tokens.items():
            try:
                committed[req] = self._commit(req, toks, result.logprobs.get(req), now)
            except Exception as e:  # noqa: BLE001 - this request's tokens, its failure
                self.fail_request(req, "committing its tokens", e)
                continue
            if req in result.advance:
                result.advance[req] = min(result.advance[req], committed[req])
        if not advanced:  # requests that failed while committing have no blocks left
            self.scheduler.after_step(ScheduledBatch(
                [(r, n) for r, n in live.items if r.error is None]), result.advance)
        outputs = []
        for req, n in committed.items():
            try:
                self._after_commit(req, n, req in result.verified)
            except Exception as e:  # noqa: BLE001
                self.fail_request(req, "updating its state after the step", e)
                continue
            if req.is_finished:
                self.scheduler.finish(req)
                self._requests.pop(req.request_id, None)
            outputs.append(request_output(req))
        return outputs

    def _after_commit(self, req: Request, n: int, verified: bool) -> None:
        """Speculation statistics and state, pacing, and detokenization after ``req``
        committed ``n`` tokens (``verified``: in a verified speculative step)."""
        if verified:
            req.metrics.spec_steps += 1
            req.metrics.spec_tokens += n
            self.spec_stats["steps"] += 1
            self.spec_stats["accepted_tokens"] += n
        if req.spec_state is not None and self.spec_worker is not None:
            self.spec_worker.on_commit(req, n)
            if req.spec_pace is not None:
                if verified:
                    req.spec_pace.on_spec_step(n)
                elif req.num_computed_tokens == req.num_tokens - 1:  # a decode step
                    req.spec_pace.on_plain_step()
        self.detokenizer.update(req, final=req.is_finished)

    def forward_and_sample(self, batch: ScheduledBatch) -> StepResult:
        """Run the model; sample one token for each request that reached its last token.

        Draft plans' logits are returned untouched in ``draft_logits`` for the worker.
        """
        fwd = self.runner.execute(batch)
        result = StepResult()
        reqs, logits = _sample_logits(fwd)
        if reqs:
            logits = self._apply_guided(logits, reqs)
            tokens, logprobs = self._sample(logits, reqs)
            for i, (req, tok, lp) in enumerate(zip(reqs, tokens, logprobs)):
                if tok == INVALID_TOKEN:
                    self.fail_request(req, "sampling", describe_bad_row(logits[i]))
                if req.is_finished:  # failed here or in its grammar mask
                    continue
                result.tokens[req] = [tok]
                if lp is not None:
                    result.logprobs[req] = [lp]
        for req, (first, count) in fwd.draft_rows.items():
            if not req.is_finished:
                result.draft_logits[req] = fwd.logits[first : first + count]
        return result

    def _sample(self, logits: torch.Tensor, reqs: list[Request]
                ) -> tuple[list[int], list[TokenLogprob | None]]:
        """The sampler over all rows at once; if that raises, each row alone, so the row
        that raised fails its request (token INVALID_TOKEN) and the others are sampled."""
        def run(rows: torch.Tensor, rs: list[Request]):
            return self.sampler(rows, [r.params for r in rs], [r.all_token_ids for r in rs],
                                [r.generator for r in rs], [r.num_prompt_tokens for r in rs])

        try:
            return run(logits, reqs)
        except Exception:  # noqa: BLE001 - find the row it belongs to
            tokens: list[int] = []
            logprobs: list[TokenLogprob | None] = []
            for i, req in enumerate(reqs):
                try:
                    (tok,), (lp,) = run(logits[i : i + 1], [req])
                except Exception as e:  # noqa: BLE001
                    self.fail_request(req, "sampling", e)
                    tok, lp = INVALID_TOKEN, None
                tokens.append(tok)
                logprobs.append(lp)
            return tokens, logprobs

    def _commit(self, req: Request, tokens: list[int], logprobs, now: float) -> int:
        """Append tokens until one finishes the request; returns how many were appended."""
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.num_steps += 1
        appended = 0
        for i, tok in enumerate(tokens):
            req.append_token(tok)
            appended += 1
            if req.logprobs is not None and logprobs is not None:
                req.logprobs.append(logprobs[i])
            req.check_stop_token(self.limits.max_seq_len)
            if req.matcher is not None and not req.is_finished:
                if not req.matcher.accept(tok):
                    raise RuntimeError(f"the grammar rejected token {tok}, which its own mask "
                                       "allowed")
                if req.matcher.is_terminated():
                    req.finish("stop")
            if req.is_finished:
                break
        return appended

    def _spec_window(self, params: SamplingParams) -> tuple[int, int, int] | None:
        """The request's (w, n, g) when it speculates, else None (validated against the
        engine's window; a request outside it is rejected with both named)."""
        spec = self.speculative
        if params.lookahead is not None:
            w, n, g = validate_request_window(spec, *params.lookahead)
            if (w, n, g) == (1, 1, 0):
                return None
        elif spec.mode == "lookahead":
            w, n, g = spec.lookahead
        elif spec.mode == "ngram":
            w, n, g = 1, 1, 0
        else:
            return None
        # Speculation here verifies with the plain sampler's distribution (and, for greedy
        # structured output, the grammar); requests that need per-token state the verifier
        # does not replay decode plainly.
        if ((params.guided is not None and not params.greedy) or params.logprobs is not None
                or params.penalized):
            return None
        return (w, n, g)

    @property
    def guided_compiler(self):
        """The structured-output compiler for this engine's tokenizer (built on first use)."""
        if self._guided_compiler is None:
            from kiln.runtime.guided.xgrammar_backend import XGrammarCompiler

            self._guided_compiler = XGrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self._guided_compiler

    def _apply_guided(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Mask out tokens each guided request's grammar forbids (logits [rows, V])."""
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not rows:
            return logits
        mask = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool)
        for j, i in enumerate(rows):
            try:
                reqs[i].matcher.fill_mask(mask[j])
            except Exception as e:  # noqa: BLE001 - its row stays all masked, then dropped
                self.fail_request(reqs[i], "structured output (the grammar's token mask)", e)
        idx = torch.tensor(rows, device=logits.device)
        allowed = mask.to(logits.device, non_blocking=True)
        logits = logits.clone()
        logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        return logits

    # -- conveniences ----------------------------------------------------------------------
    def generate(
        self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Add one request and yield its output after each step that advanced it."""
        rid = self.add_request(prompt, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(rid)

    @property
    def tokens_per_spec_step(self) -> float | None:
        """Mean tokens committed per speculative step over the engine's life."""
        s = self.spec_stats
        return s["accepted_tokens"] / s["steps"] if s["steps"] else None

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks


def _sample_logits(fwd) -> tuple[list[Request], torch.Tensor]:
    """The requests that sample this step and their logits rows, in order (rows 0..n-1, as
    in every graph step: a view, no gather)."""
    reqs = list(fwd.sample_rows)
    rows = list(fwd.sample_rows.values())
    logits = fwd.logits[: len(rows)] if rows == list(range(len(rows))) else fwd.logits[rows]
    return reqs, logits


def _may_speculate_next(req: Request) -> bool:
    """Whether the step after the one in flight may speculate for ``req`` (then it cannot be
    launched ahead: its draft needs the in-flight token). A paced request that stays paused
    through the in-flight step's commit decodes plainly next."""
    if req.spec_state is None:
        return False
    return req.spec_pace is None or req.spec_pace.pause_left <= 1


def _resolve_backend(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type == "cuda":
        from kiln.runtime import kernels

        if kernels.available():
            return "triton"
    return "torch"
