"""LLMEngine: add_request / step / abort. The only entry point serve and bench use.

A step is schedule -> launch -> collect. The scheduler decides what runs (token budget,
blocks, admission, preemption); the model runner runs it; the sampler picks tokens on
the device; collecting commits them to their requests and builds the step's outputs.
With async scheduling a step whose tokens can be chosen on the device alone is launched
and, before its tokens are read, the step after it is scheduled (``schedule_ahead``) and
launched on top: the host's work of one step overlaps the GPU's work of the next.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.artifact.speculative import SpeculativeConfig
from kiln.config import ModelConfig
from kiln.dtypes import TORCH_DTYPES
from kiln.errors import RequestError
from kiln.runtime.config import EngineLimits, RuntimeConfig
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.guided import mask_logits
from kiln.runtime.layers.sampler import INVALID_TOKEN, describe_bad_row, kernels_enabled
from kiln.runtime.models.calibration import ActivationCalibrator
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.prompt_logprobs import score_prompt_rows
from kiln.runtime.request import Request, check_prompt, request_output
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import ScheduledBatch
from kiln.runtime.speculative.break_even import spec_break_even
from kiln.runtime.speculative.pace import gate_batch
from kiln.runtime.speculative.worker import on_device
from kiln.runtime.speculative.workers import make_worker, request_window
from kiln.runtime.startup import assemble
from kiln.runtime.step import LaunchedStep, StepResult, TokenReadback, sample_logits

if TYPE_CHECKING:
    from kiln.runtime.parallel import Ranks

__all__ = ["EngineLimits", "LLMEngine", "RuntimeConfig", "StepResult"]


class LLMEngine:
    """Runs a built engine. Not thread-safe: one thread calls these methods."""

    def __init__(
        self, model_config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: Any,
        limits: EngineLimits, dtype: torch.dtype, config: RuntimeConfig | None = None,
        spec: Any = None, draft: tuple[ModelConfig, dict[str, torch.Tensor]] | None = None,
        tp: Ranks | None = None,
    ):
        """``draft``: a draft-model engine's draft (its model config and weights). ``tp``:
        rank 0 of a tensor-parallel engine (kiln.runtime.parallel.Ranks, made by
        ``from_engine_dir``); ``weights`` are its shard. ``close()`` ends the other ranks."""
        config = config or RuntimeConfig()
        self.tp = tp
        self.config = config
        self.spec = spec
        self.generation_defaults = dict(spec.generation_defaults.values) if spec is not None else {}
        self.model_config = model_config
        self.limits = limits
        self.dtype = dtype
        self.tokenizer = tokenizer
        # Speculative settings come from the engine artifact only (validated at build).
        self.speculative = spec.speculative if spec is not None else SpeculativeConfig()
        parts = assemble(model_config, weights, limits, dtype, config, self.speculative, draft,
                         attention=getattr(spec, "attention", None), tp=tp)
        # the limits it serves (a CPU pool may hold less than the recorded max_seq_len)
        self.limits, self.sizing = parts.sizing.limits, parts.sizing
        self.device, self.attention_backend = parts.device, parts.attention_backend
        self.attention_classes = parts.attention_classes
        self.model, self.cache, self.blocks = parts.model, parts.cache, parts.blocks
        self.scheduler, self.runner, self.sampler = parts.scheduler, parts.runner, parts.sampler
        # Seconds from the constructor's start; from_engine_dir adds the weight loading.
        self.startup_times = parts.startup_times
        self.detokenizer = Detokenizer(tokenizer)
        eos = set(model_config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.spec_worker = make_worker(self.speculative, parts.device_state, parts.draft)
        self._guided_compiler = None
        self._requests: dict[str, Request] = {}
        self._failed: list[Request] = []  # failed in the running step; reported with its outputs
        self._step_reqs: list[Request] = []  # the requests the running step serves
        self._ids = itertools.count()
        self.num_steps = 0
        # over all requests: verified speculative steps of requests, the tokens they
        # committed, engine steps that verified any (each one masked), and those of them
        # that ran synchronously (host plans, or rows the device cannot sample alone)
        self.spec_stats = {"steps": 0, "accepted_tokens": 0, "engine_steps": 0,
                           "sync_engine_steps": 0}
        self.spec_break_even = None  # set below, once the engine can run steps
        # compiled kernels the engine directory shipped for this machine (from_engine_dir)
        self.kernels_installed: dict[str, int] = {}
        self.async_scheduling = config.async_scheduling  # may be switched between steps
        self._inflight: LaunchedStep | None = None
        # the host copies of a step's samples, or of a device speculative step's commits
        # ([B, N + 1]: tokens and their count) and its plain rows' samples
        # the most a device speculative step commits per request (0: none on the device)
        self._spec_width = parts.device_state.commit_width if parts.device_state else 0
        seqs = self.scheduler.max_num_seqs
        self._readback = TokenReadback((seqs + 1) * (self._spec_width + 1) + seqs,
                                       self.device)
        if self.spec_worker:
            t_pace = time.perf_counter()
            self.spec_break_even = spec_break_even(self)
            self.startup_times["spec_break_even_s"] = time.perf_counter() - t_pace
            self.startup_times["total_s"] += self.startup_times["spec_break_even_s"]

    @classmethod
    def from_engine_dir(cls, path: str | Path, config: RuntimeConfig | None = None) -> LLMEngine:
        """Load a directory written by ``kiln build``."""
        from kiln.artifact.loader import load_engine

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
        tp = None
        if spec.tp > 1:  # the other ranks start first and load their shards meanwhile
            from kiln.runtime.parallel import Ranks
            from kiln.runtime.parallel.worker import follow_launched

            tp = Ranks.start(Path(path), spec.parallel, spec.model, torch.device(device),
                             dataclasses.replace(config, device=str(device)),
                             follow=follow_launched)
        try:
            weights = art.load_weights(device, dtype, calibrator=ActivationCalibrator)
            tokenizer = art.load_tokenizer()
            draft = ((art.draft.spec.model,
                      art.draft.load_weights(device, dtype, calibrator=ActivationCalibrator))
                     if getattr(art, "draft", None) is not None else None)
            load_s = time.perf_counter() - t0
            engine = cls(spec.model, weights, tokenizer, limits, dtype, config, spec=spec,
                         draft=draft, tp=tp)
        except BaseException:
            if tp is not None:
                tp.kill()
            raise
        engine.startup_times = {"load_weights_s": load_s, **engine.startup_times,
                                "total_s": load_s + engine.startup_times["total_s"]}
        if kernels:  # the engine shipped compiled kernels for this machine
            engine.startup_times = {"install_kernels_s": kernels_s, **engine.startup_times,
                                    "total_s": kernels_s + engine.startup_times["total_s"]}
            engine.kernels_installed = kernels
        return engine

    # -- requests ------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict],
                            tools: list[dict] | None = None) -> list[int]:
        """Token ids of the engine's chat template over ``messages`` with a generation prompt;
        ``tools`` (OpenAI tool objects) go to the template's own tools branch."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this engine's tokenizer has no chat template; send raw text")
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=True
            )
        except TemplateError as e:  # the template's own raise_exception: a bad conversation
            raise ValueError(f"the model's chat template rejected the messages: {e}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def tool_parser(self) -> str | None:
        """The tool-call family of this engine's chat template (kiln.tools.PARSERS): the one
        engine.json records, else (engines built before it was recorded, engines made in
        memory) the one its template speaks; None: no tool calling."""
        tools = getattr(getattr(self, "spec", None), "tools", None)
        if tools is not None:
            return tools.parser
        from kiln.tools import detect_parser

        template = getattr(self.tokenizer, "chat_template", None)
        return detect_parser(template if isinstance(template, str) else None)

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request (text is tokenized as-is, no chat template); returns its id."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt(ids, params, self.model_config.vocab_size, self.limits.max_input_len)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        req = Request(request_id, ids, params, self.eos_token_ids)
        if params.guided is not None:
            req.matcher = self.guided_compiler.compile(params.guided)
        window = request_window(self.speculative, params)
        if window is not None:
            self.spec_worker.init_request(req, window)
            if self.spec_break_even is not None and params.seed is None:
                req.spec_pace = self.spec_worker.pace(req, self.spec_break_even)
        self.detokenizer.init_request(req)
        self.scheduler.add(req)
        self._requests[request_id] = req
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks; unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is None or req.is_finished:
            return
        self._finish(req)
        req.finish("abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns outputs of requests that got tokens or finished.

        Async scheduling: the step after a launched one is scheduled and launched before
        the launched step's tokens are read (its input ids copied on the device from the
        launched step's samples); a request that stops on a token runs one discarded
        extra row.

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

    def _step(self) -> list[RequestOutput]:
        cur, self._inflight = self._inflight, None
        if cur is None or cur.stale:
            batch = self._schedule()
            if not batch:
                return []
            if not self._can_launch(batch):
                return self._run(batch)
            cur = self._launch(batch, scatter=self._fill(batch))
        self._step_reqs = list(cur.reqs)
        # Its KV is queued on the device and every input id of it is on the host now (a
        # speculative step counts one token each here; its commit brings the rest).
        self.scheduler.after_step(cur.batch.unfinished(), cur.advance)
        try:
            self._inflight = self._launch_next(cur)
        except BaseException:
            self._collect(cur)  # its tokens are real: the failed requests' outputs carry them
            raise
        return self._collect(cur)

    def _schedule(self) -> ScheduledBatch:
        """Draft plans for the requests that speculate now, then the scheduler's batch."""
        if self.spec_worker is not None:
            running = list(self.scheduler.running)
            self._gate(running)
            self.spec_worker.propose_all(running, self.fail_request)
        batch = self.scheduler.schedule()
        self._step_reqs = [r for r, _ in batch.items]
        if not batch and self.scheduler.waiting and not self.scheduler.running:
            req = self.scheduler.waiting[0]
            self.fail_request(req, "scheduling", f"its {req.num_tokens} tokens do not fit the "
                              f"KV cache even alone ({self.blocks.num_blocks} blocks of "
                              f"{self.blocks.block_size} tokens); give the engine more KV blocks")
        return batch

    def _gate(self, running: list[Request]) -> None:
        """Pacing at the batch running now: which speculating requests may speculate in
        the next step (``gate_batch``; requests of device slots ride along)."""
        if self.spec_break_even is None:
            return
        self.spec_break_even.batch = max(len(running), 1)
        paced = [r for r in running if r.spec_state is not None]
        gate_batch([r.spec_pace for r in paced], len(running), self.spec_break_even,
                   [on_device(r) for r in paced])

    def _fill(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The worker completes the step's plans (a draft model draws its drafts):
        token ids for the step's input rows, or None."""
        return (self.spec_worker.fill(batch, self.fail_request)
                if self.spec_worker is not None else None)

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """A step that needs the host between forward and commit (drafts to verify, a
        grammar, penalties, logprobs, seeds): forward, sample, verify, commit."""
        result = self.forward_and_sample(batch, self._fill(batch))
        if self.spec_worker is not None and any(r.draft is not None for r, _ in batch.items):
            self.spec_stats["sync_engine_steps"] += 1
            self.spec_worker.step(batch, result, self.cache, self.fail_request)
        live = batch.unfinished()
        committed = self._commit_all(result)
        # requests that failed while committing have no blocks left
        self.scheduler.after_step(ScheduledBatch([(r, n) for r, n in live.items
                                                  if r.error is None]), result.advance)
        return self._outputs(committed, result)

    def _can_launch(self, batch: ScheduledBatch) -> bool:
        """Whether the step's tokens can be chosen on the device alone (plain decode rows,
        no grammar, no penalties / logprobs / seeds; or device speculative plans, with
        such plain rows beside them). A step scoring prompt tokens runs synchronously
        (``_run``: the scores are read with its tokens)."""
        if not self.async_scheduling or batch.num_prompt_rows():
            return False
        if self._device_spec_step(batch):
            return True
        reqs = [r for r, _ in batch.items]
        return all(r.draft is None for r in reqs) and self._device_samples(reqs)

    def _device_samples(self, reqs: list[Request]) -> bool:
        """Whether the device alone picks these requests' next tokens (no grammar, and
        ``Sampler.device_only``)."""
        return (all(r.matcher is None for r in reqs)
                and self.sampler.device_only([r.params for r in reqs],
                                             [r.generator for r in reqs],
                                             kernels=self.device.type == "cuda"
                                             and kernels_enabled()))

    def _device_spec_step(self, batch: ScheduledBatch) -> bool:
        """A step of plans proposed and verified on the device (DeviceSpecStep), and
        beside them only plain decode rows whose tokens the device samples alone (one
        token each, at the end of what the request has; ``batch.in_flight`` counts a
        token in flight)."""
        if self.runner.spec_step is None or not batch.items:
            return False
        plain = []
        for r, n in batch.items:
            if r.draft is None:
                if n != 1 or r.num_computed_tokens + 1 != r.num_tokens + batch.in_flight:
                    return False
                plain.append(r)
            elif r.draft.device_slot is None or n != r.draft.num_tokens:
                return False
        return len(plain) < len(batch.items) and (not plain or self._device_samples(plain))

    def _launch(self, batch: ScheduledBatch, inputs: torch.Tensor | None = None,
                scatter: tuple[torch.Tensor, torch.Tensor] | None = None) -> LaunchedStep:
        """Queue the forward and the sampling of ``batch`` on the device (``inputs``: the
        device token ids of a batch scheduled ahead; ``scatter``: ``_fill``'s). A batch of
        device speculative plans is verified and committed on the device; its commits are
        copied back instead."""
        fwd = (self.runner.execute(batch, inputs) if scatter is None
               else self.runner.execute(batch, inputs, scatter))
        if fwd.spec_entries:
            self.spec_worker.after_forward(fwd)
            reqs = [r for r, _ in batch.items]
            for r in reqs:
                r.draft = None  # a plan is one step's
            packed = fwd.spec.packed()
            plain, tokens = [], None
            if fwd.sample_rows:  # plain rows beside the plans: sampled here, read together
                plain, logits = sample_logits(fwd)
                tokens = self.sampler.choose(logits, [r.params for r in plain],
                                             [r.generator for r in plain])
                host, ready = self._readback.start(torch.cat([packed.reshape(-1), tokens]))
            else:
                host, ready = self._readback.start(packed)
            return LaunchedStep(batch, reqs, tokens, host, ready, fwd.spec_entries,
                                {r: 1 for r in reqs}, plain=plain,
                                spec_shape=tuple(packed.shape))
        reqs, logits = sample_logits(fwd)
        tokens = self.sampler.choose(logits, [r.params for r in reqs],
                                     [r.generator for r in reqs])
        return LaunchedStep(batch, reqs, tokens, *self._readback.start(tokens))

    def _launch_next(self, cur: LaunchedStep) -> LaunchedStep | None:
        """Launch the step after ``cur`` before its tokens are known, or None when the next
        step needs the host (the plain scheduler then runs after it). Without speculation
        the step may carry prompt chunks and admissions beside the decodes
        (``Scheduler.schedule_ahead``): the host schedules, stages and launches the next
        step while the GPU runs this one, also while prompts keep arriving."""
        if not self.async_scheduling:
            return None
        if cur.spec_entries is not None:
            return self._launch_spec_ahead(cur)
        if any(_may_speculate_next(r) for r in cur.reqs):
            return None  # a draft needs the in-flight token
        admit = self._joins_ahead if self.spec_worker is None else None
        batch = self.scheduler.schedule_ahead(cur.batch, self.limits.max_seq_len, admit)
        return None if batch is None else self._launch(batch, cur.inputs_for(batch))

    def _joins_ahead(self, req: Request) -> bool:
        """Whether ``req`` may run a prompt chunk in a step launched ahead: the device alone
        picks its tokens and it scores no prompt positions (those are read with the
        step's tokens, ``_run``)."""
        return not req.scores_prompt and self._device_samples([req])

    def _launch_spec_ahead(self, cur: LaunchedStep) -> LaunchedStep | None:
        """The next device speculative step of ``cur``'s requests, launched before ``cur``'s
        commits are read: the device state already holds them (the next x is its bonus
        token), and the device moves the step's positions and slots on by what ``cur``
        committed. None when the chain stops (a request finished or pauses, requests wait,
        a length limit or the KV blocks are near): the plain scheduler runs next."""
        reqs = cur.reqs
        if any(r.is_finished for r in reqs):
            return None
        self._gate(reqs)  # every request of a device slot here: all ride along, or none
        dev = [r for r in reqs if r not in cur.plain]
        if not any(r.spec_pace is None or r.spec_pace.active for r in dev):
            return None
        if not all(self.spec_worker.chainable(r) for r in dev):
            return None
        self.spec_worker.propose_batch(dev, self.fail_request)
        batch = self.scheduler.schedule_spec_ahead(cur.batch, self._spec_width,
                                                   self.limits.max_seq_len, cur.plain)
        scatter = None
        try:
            if batch is not None and self._device_spec_step(batch):
                scatter = self._fill(batch)
            else:
                batch = None
        except Exception as e:  # the plain scheduler's step retries request by request
            print(f"warning: a speculative step launched ahead could not draft "
                  f"({type(e).__name__}: {e}); the next step runs after this one",
                  file=sys.stderr, flush=True)
            batch = None
        if batch is None:
            for r in dev:
                r.draft = None
            return None
        # the plain rows come first: their inputs are their samples in flight
        return self._launch(batch, cur.inputs_for_plain(batch) if cur.plain else None,
                            scatter)

    def _collect(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens (the step's one host sync) and commit them."""
        if launched.spec_entries is not None:
            return self._collect_spec(launched)
        result = StepResult()
        for req, tok in zip(launched.reqs, self._readback.read(launched)):
            if tok == INVALID_TOKEN:
                self.fail_request(req, "sampling", "its logits row is not finite (NaN or inf "
                                  "in the model's output)")
            elif not req.is_finished:  # aborted while in flight: its token is dropped
                result.tokens[req] = [tok]
        return self._outputs(self._commit_all(result), result)

    def _collect_spec(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched device speculative step's commits (one host sync) and commit
        them; each request's computed count, one at launch, moves on by the rest. Plain
        rows beside the plans commit their sample."""
        rows = self._readback.read(launched)
        result = StepResult()
        if launched.plain:
            n, w = launched.spec_shape
            flat, rows = rows, [rows[i * w : (i + 1) * w] for i in range(n)]
            for req, tok in zip(launched.plain, flat[n * w :]):
                if tok == INVALID_TOKEN:
                    self.fail_request(req, "sampling", "its logits row is not finite (NaN "
                                      "or inf in the model's output)")
                elif not req.is_finished:
                    result.tokens[req] = [tok]
        plain = set(launched.plain)
        for req in launched.reqs:
            if req.is_finished or req in plain:
                continue  # aborted or stopped in the step before (dropped), or a plain row
            row = rows[launched.spec_entries[req]]
            if row[-1] < 1:
                self.fail_request(req, "speculative verification", "the device step "
                                  "committed no token")
                continue
            result.add_verified(req, row[: row[-1]])
        committed = self._commit_all(result)
        for req, n in result.advance.items():
            req.num_computed_tokens += n - 1
        return self._outputs(committed, result)

    def _commit_all(self, result: StepResult) -> dict[Request, int]:
        """Append each request's tokens (a failure fails that request); how many each
        appended. A speculative request's KV advance is capped at what it committed."""
        self.num_steps += 1
        now = time.perf_counter()
        committed: dict[Request, int] = {}
        for req, toks in result.tokens.items():
            try:
                committed[req] = req.commit(toks, result.logprobs.get(req),
                                            self.limits.max_seq_len, now)
            except Exception as e:
                self.fail_request(req, "committing its tokens", e)
                continue
            if req in result.advance:
                result.advance[req] = min(result.advance[req], committed[req])
        return committed

    def _outputs(self, committed: dict[Request, int], result: StepResult
                 ) -> list[RequestOutput]:
        """Speculation statistics, worker state and detokenization after the commit; the
        outputs of the requests that committed tokens (finished ones leave the engine)."""
        outputs = []
        if result.verified:
            self.spec_stats["engine_steps"] += 1
        for req, n in committed.items():
            verified = req in result.verified
            try:
                if verified:
                    req.metrics.spec_steps += 1
                    req.metrics.spec_tokens += n
                    self.spec_stats["steps"] += 1
                    self.spec_stats["accepted_tokens"] += n
                if self.spec_worker is not None:
                    self.spec_worker.after_commit(req, n, verified)
                self.detokenizer.update(req, final=req.is_finished)
            except Exception as e:
                self.fail_request(req, "updating its state after the step", e)
                continue
            if req.is_finished:
                self._finish(req)
                self._requests.pop(req.request_id, None)
            outputs.append(request_output(req))
        return outputs

    def forward_and_sample(self, batch: ScheduledBatch,
                           scatter: tuple[torch.Tensor, torch.Tensor] | None = None
                           ) -> StepResult:
        """Run the model; sample one token for each request that reached its last token.

        Draft plans' logits are returned untouched in ``draft_logits`` for the worker.
        ``scatter``: token ids on the device for input rows (``ModelRunner.execute``).
        """
        fwd = self.runner.execute(batch) if scatter is None else self.runner.execute(
            batch, None, scatter)
        if fwd.spec_entries:
            self.spec_worker.after_forward(fwd)
        if fwd.prompt_rows:
            self._score_prompts(fwd.logits, fwd.prompt_rows)
        result = StepResult()
        reqs, logits = sample_logits(fwd)
        if reqs:
            logits = mask_logits(logits, [r.matcher for r in reqs], lambda i, e: self.fail_request(
                reqs[i], "structured output (the grammar's token mask)", e))
            tokens, logprobs = self.sampler.sample_requests(
                logits, reqs, lambda i, e: self.fail_request(reqs[i], "sampling", e))
            for i, (req, tok, lp) in enumerate(zip(reqs, tokens, logprobs)):
                if tok == INVALID_TOKEN:
                    self.fail_request(req, "sampling", describe_bad_row(logits[i]))
                if req.is_finished:  # failed here or in its grammar mask
                    continue
                result.tokens[req] = [tok]
                if lp is not None:
                    result.logprobs[req] = [lp]
        for req, (first, count) in fwd.draft_rows.items():
            if not req.is_finished and req not in fwd.spec_entries:
                result.draft_logits[req] = fwd.logits[first : first + count]
        result.spec_entries, result.spec = fwd.spec_entries, fwd.spec
        return result

    def _score_prompts(self, logits: torch.Tensor,
                       prompt_rows: dict[Request, tuple[int, int, int]]) -> None:
        """Append the prompt logprobs this step scored to their requests (a request whose
        scores fail or are not finite fails alone)."""
        try:
            scored = score_prompt_rows(logits, prompt_rows)
        except Exception as e:
            for req in prompt_rows:
                self.fail_request(req, "scoring its prompt (prompt_logprobs)", e)
            return
        for req, lps in scored.items():
            if lps is None:
                self.fail_request(req, "scoring its prompt (prompt_logprobs)", "its logits "
                                  "are not finite (NaN or inf in the model's output)")
            elif not req.is_finished:
                req.prompt_logprobs.extend(lps)

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
        self._finish(req)
        req.finish("error")
        self._requests.pop(req.request_id, None)
        self._failed.append(req)
        print(f"warning: request {req.request_id} failed ({req.error}); the engine goes on",
              file=sys.stderr, flush=True)

    def _finish(self, req: Request) -> None:
        """A request leaves the engine: its KV blocks and its speculative state go."""
        self.scheduler.finish(req)
        if self.spec_worker is not None and req.spec_state is not None:
            self.spec_worker.release(req)

    def _device_broken(self) -> bool:
        """Whether the device still runs work after an exception (a CUDA fault is sticky:
        every later call fails, so the engine cannot go on; a tensor-parallel rank that
        failed ended them all)."""
        if self.tp is not None and self.tp.failed is not None:
            return True
        if self.device.type != "cuda":
            return False
        try:
            torch.cuda.synchronize(self.device)
        except Exception:
            return True
        return False

    @property
    def guided_compiler(self):
        """The structured-output compiler for this engine's tokenizer (built on first use)."""
        if self._guided_compiler is None:
            from kiln.runtime.guided.xgrammar_backend import XGrammarCompiler

            self._guided_compiler = XGrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self._guided_compiler

    def memory_by_rank(self) -> list[dict]:
        """Each rank's peak memory (kiln.runtime.memory), in rank order: one entry for a
        tp-1 engine; a tensor-parallel one asks its followers over the control channel."""
        if self.tp is not None:
            return self.tp.memory(self.device)
        from kiln.runtime.memory import peak_memory

        return [peak_memory(self.device)]

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)``, from another thread, when the engine fails outside a
        step too: a tensor-parallel rank that died or hung while the engine idles or waits
        on it (kiln.runtime.parallel.supervisor); the next step then raises the same error.
        A tp-1 engine has no such failure and never calls it."""
        if self.tp is not None:
            self.tp.on_failure(callback)

    def close(self) -> None:
        """Release what outlives the object: a tensor-parallel engine's other ranks (their
        processes end). Idempotent; the engine runs no step after it."""
        if self.tp is not None:
            self.tp.close()

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


def _may_speculate_next(req: Request) -> bool:
    """Whether the step after the one in flight may speculate for ``req`` (then it cannot be
    launched ahead: its draft needs the in-flight token). A paced request
    that is not speculating now decodes plainly next (its pacing decides again when the
    in-flight token is committed; a start then waits for the step after)."""
    if req.spec_state is None:
        return False
    return req.spec_pace is None or req.spec_pace.active
