"""LLMEngine: add_request / step / abort. The only entry point serve and bench use.

Every step is schedule -> launch -> collect. The scheduler decides what runs (token budget,
blocks, admission, preemption); the model runner runs it; the sampler picks tokens (on the
device where it can); collecting commits them and builds the step's outputs. Speculation is
the ``StepProposer``'s (a plain step is one whose proposer proposes nothing). With async
scheduling, before a launched step's tokens are read, the step after it is scheduled
(``schedule_ahead``) and launched on top: the host's work overlaps the GPU's.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.artifact.speculative import SpeculativeConfig
from kiln.config import ModelConfig
from kiln.errors import RequestError
from kiln.runtime.config import EngineLimits, RuntimeConfig
from kiln.runtime.detokenizer import Detokenizer
from kiln.runtime.layers.sampler import kernels_enabled
from kiln.runtime.loading import load_engine_dir
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.request import Request, check_prompt, request_output
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import ScheduledBatch
from kiln.runtime.speculative.step_proposer import make_proposer
from kiln.runtime.startup import assemble
from kiln.runtime.step import (LaunchedStep, StepResult, TokenReadback, read_result,
                               sample_on_device, sample_on_host)

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
        # the one speculative seam: what the step asks of speculation (plain: nothing)
        self.proposer = make_proposer(self.speculative, parts.device_state, parts.draft,
                                      self.scheduler, self.runner, self._device_samples,
                                      self.limits.max_seq_len)
        self.spec_worker = self.proposer.worker
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
        # compiled kernels the engine directory shipped for this machine (from_engine_dir)
        self.kernels_installed: dict[str, int] = {}
        self.async_scheduling = config.async_scheduling  # may be switched between steps
        self._inflight: LaunchedStep | None = None
        # the host copies of a step's samples, or of a device speculative step's commits
        # ([B, N + 1]: tokens and their count; N: the most one commits) and plain samples
        width = parts.device_state.commit_width if parts.device_state else 0
        seqs = self.scheduler.max_num_seqs
        self._readback = TokenReadback((seqs + 1) * (width + 1) + seqs, self.device)
        self.proposer.start(self)  # once the engine can run steps

    @classmethod
    def from_engine_dir(cls, path: str | Path, config: RuntimeConfig | None = None) -> LLMEngine:
        """Load a directory written by ``kiln build`` (kiln.runtime.loading)."""
        return load_engine_dir(cls, path, config)

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
        self.proposer.add_request(req, params)
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
            on_host = not self._can_launch(batch)
            cur = self._launch(batch, None, self.proposer.fill(batch, self.fail_request), on_host)
        self._step_reqs = list(cur.reqs)
        # Its KV is queued on the device and every input id of it is on the host now (a
        # verified request counts one token here; its commit brings the rest).
        self.scheduler.after_step(cur.batch.unfinished(), cur.advance)
        try:
            self._inflight = self._launch_next(cur)
        except BaseException:
            self._collect(cur)  # its tokens are real: the failed requests' outputs carry them
            raise
        return self._collect(cur)

    def _schedule(self) -> ScheduledBatch:
        """The proposer's plans for the requests that speculate now, then the batch."""
        self.proposer.propose(self.scheduler.running, self.fail_request)
        batch = self.scheduler.schedule()
        self._step_reqs = [r for r, _ in batch.items]
        if not batch and self.scheduler.waiting and not self.scheduler.running:
            req = self.scheduler.waiting[0]
            self.fail_request(req, "scheduling", f"its {req.num_tokens} tokens do not fit the "
                              f"KV cache even alone ({self.blocks.num_blocks} blocks of "
                              f"{self.blocks.block_size} tokens); give the engine more KV blocks")
        return batch

    def _can_launch(self, batch: ScheduledBatch) -> bool:
        """Whether the step's tokens can be chosen on the device alone (no grammar, no
        penalties / logprobs / seeds, no plans to verify on the host; ``proposer.launchable``).
        A step scoring prompt tokens needs the host (the scores are read with its tokens)."""
        if not self.async_scheduling or batch.num_prompt_rows():
            return False
        return self.proposer.launchable(batch, self._device_samples)

    def _device_samples(self, reqs: list[Request]) -> bool:
        """Whether the device alone picks these requests' next tokens (no grammar, and
        ``Sampler.device_only``)."""
        return (all(r.matcher is None for r in reqs)
                and self.sampler.device_only([r.params for r in reqs],
                                             [r.generator for r in reqs],
                                             kernels=self.device.type == "cuda"
                                             and kernels_enabled()))

    def _launch(self, batch: ScheduledBatch, inputs: torch.Tensor | None = None,
                scatter: tuple[torch.Tensor, torch.Tensor] | None = None,
                on_host: bool = False) -> LaunchedStep:
        """Queue the forward of ``batch`` on the device (``inputs``: the device token ids of
        a batch scheduled ahead; ``scatter``: the proposer's ``fill``) and choose its tokens:
        samples, and the commits of plans verified on the device, copied back without a
        sync; or, ``on_host``, sampled and verified on the host now."""
        fwd = (self.runner.execute(batch, inputs) if scatter is None
               else self.runner.execute(batch, inputs, scatter))
        self.proposer.after_forward(fwd)
        if not on_host:
            return sample_on_device(batch, fwd, self.proposer.verdict(fwd, batch),
                                    self.sampler, self._readback)
        result = sample_on_host(fwd, self.sampler, self.fail_request)
        if self.proposer.verify(batch, fwd, result, self.cache, self.fail_request):
            self.spec_stats["sync_engine_steps"] += 1
        return LaunchedStep(batch, [r for r, _ in batch.items], result=result,
                            advance={r: 1 for r in result.verified})

    def _launch_next(self, cur: LaunchedStep) -> LaunchedStep | None:
        """Launch the step after ``cur`` before its tokens are read, or None when the next
        step needs the host (the scheduler then runs after it): the proposer's next device
        plans after ``cur``'s, else, when no request may speculate next, the scheduler's
        ``schedule_ahead``, which may add prompt chunks and admissions beside the decodes:
        the host schedules, stages and launches the next step while the GPU runs this one."""
        if not self.async_scheduling or cur.result is not None:
            return None
        if cur.spec_entries:
            batch, scatter = self.proposer.schedule_chain(cur, self.fail_request)
        elif self.proposer.may_speculate(cur.reqs):
            return None  # a draft needs the in-flight token
        else:
            admit = self._joins_ahead if self.proposer.admits_ahead else None
            batch, scatter = self.scheduler.schedule_ahead(cur.batch, self.limits.max_seq_len,
                                                           admit), None
        if batch is None:
            return None
        return self._launch(batch, cur.inputs_for(batch) if cur.plain else None, scatter)

    def _joins_ahead(self, req: Request) -> bool:
        """Whether ``req`` may run a prompt chunk in a step launched ahead: the device alone
        picks its tokens and it scores no prompt positions (those need the host)."""
        return not req.scores_prompt and self._device_samples([req])

    def _collect(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens (its one host sync; a step chosen on the host has
        them) and append them to their requests (a failure fails that request). A verified
        request's computed count, one at launch, moves on by the rest it committed."""
        result = (launched.result if launched.result is not None
                  else read_result(launched, self._readback.read(launched), self.fail_request))
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
                req.num_computed_tokens += min(result.advance[req], committed[req]) - 1
        return self._outputs(committed, result)

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
                self.proposer.after_commit(req, n, verified)
                self.detokenizer.update(req, final=req.is_finished)
            except Exception as e:
                self.fail_request(req, "updating its state after the step", e)
                continue
            if req.is_finished:
                self._finish(req)
                self._requests.pop(req.request_id, None)
            outputs.append(request_output(req))
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
        self._finish(req)
        req.finish("error")
        self._requests.pop(req.request_id, None)
        self._failed.append(req)
        print(f"warning: request {req.request_id} failed ({req.error}); the engine goes on",
              file=sys.stderr, flush=True)

    def _finish(self, req: Request) -> None:
        """A request leaves the engine: its KV blocks and its speculative state go."""
        self.scheduler.finish(req)
        if req.spec_state is not None:
            self.proposer.release(req)

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
    def spec_break_even(self):
        """What a speculative step must commit to pay for itself (pacing), or None."""
        return self.proposer.break_even

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

