"""/v1/completions and /v1/chat/completions: requests in, engine requests out, OpenAI JSON back.

One HTTP request becomes ``len(prompts) x n`` engine requests sharing one asyncio queue;
choice ``i`` gets seed ``(seed + i) mod 2**64`` (``protocol.choice_seed``). Streaming answers
are SSE chunks ending ``data: [DONE]``. A client that goes away (streaming or not) gets its
engine requests aborted. Responses never hold a non-finite number (not JSON): a logprob of
-inf (a token masked out by a grammar or top-k) or NaN is reported as ``MIN_LOGPROB``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from kiln.errors import RequestError
from kiln.runtime.outputs import TokenLogprob
from kiln.runtime.sampling_params import DEFAULT_MAX_TOKENS
from kiln.server import tool_calls
from kiln.server.echo import MIN_LOGPROB, PromptPart, prompt_logprobs_json, prompt_only
from kiln.server.engine_thread import (
    EngineThread,
    OverCapacityError,
    RequestEndedError,
    RequestFailedError,
    ShuttingDownError,
    StreamItem,
)
from kiln.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    chat_dicts,
    choice_seed,
    sampling_params,
)
from kiln.server.tool_calls import StreamedCalls, ToolPlan


def _logprob(v: float) -> float:
    return v if math.isfinite(v) else MIN_LOGPROB


@dataclass
class Choice:
    """What one engine request has produced so far."""

    index: int
    prompt_len: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_text: dict[int, str] = field(default_factory=dict)
    finish_reason: str | None = None
    calls: StreamedCalls | None = None  # a streamed chat choice whose tool calls are parsed
    # /v1/completions' prompt part (PromptPart): the prompt's ids and the engine's scores of
    # them, and whether a body of this choice carried them yet
    prompt_ids: list[int] = field(default_factory=list)
    prompt_scores: list[TokenLogprob | None] | None = None
    prompt_sent: bool = False


class AbortingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs ``on_close`` however the stream ends (disconnects too)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _add_param(e: RequestError, prompt_param: str, guided_param: str | None) -> str | None:
    """The request field an ``add_request`` RequestError is about: the runtime's ``prompt``
    is this endpoint's ``prompt_param``; the server picks the request ids; an error naming
    no field comes from the grammar compiler, so it is the field that held the grammar."""
    if e.param == "prompt":
        return prompt_param
    if e.param == "request_id":
        return None
    return e.param or guided_param


class Generation:
    """The engine requests behind one HTTP request."""

    prompt_part: PromptPart | None = None  # /v1/completions: echo, prompt logprobs

    def __init__(self, et: EngineThread, model: str, chat: bool, include_usage: bool,
                 tools: ToolPlan | None = None):
        self.et = et
        self.tools = tools  # chat with tools: each choice's output is parsed for calls
        self.model = model
        self.chat = chat
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: dict[str, Choice] = {}
        self.prompt_tokens = 0

    async def start(self, prompts: list[list[int]], params_for: Callable[[int], Any],
                    n: int, want_text: bool, prompt_param: str,
                    guided_param: str | None) -> None:
        """Add the ``len(prompts) x n`` engine requests at once, all or none: a request that
        would overfill the queue now gets ``QueueFullError`` (429) with nothing added, one
        that could never fit a 400 naming ``n`` (or the prompt list when n is 1)."""
        requests, choices = [], {}
        for p, ids in enumerate(prompts):
            self.prompt_tokens += len(ids)
            for j in range(n):
                idx = p * n + j
                rid = f"{self.id}-{idx}"
                requests.append((rid, ids, params_for(idx)))
                choices[rid] = Choice(idx, len(ids))
        try:
            await self.et.add_many(requests, want_text, self.queue)
        except OverCapacityError as e:
            raise BadRequest(str(e), "n" if n > 1 else prompt_param,
                             code="over_capacity") from None
        except RequestError as e:
            raise BadRequest(str(e), _add_param(e, prompt_param, guided_param)) from None
        except ValueError as e:  # untyped: still this request's alone, naming no field
            raise BadRequest(str(e), None) from None
        except ShuttingDownError as e:
            raise BadRequest(str(e), None, status=e.status, type_=e.type, code=e.code,
                             headers=e.headers()) from None
        self.choices.update(choices)

    def abort(self) -> None:
        """Abort every unfinished choice (called however the HTTP request ends)."""
        for rid, c in self.choices.items():
            if c.finish_reason is None:
                c.finish_reason = "abort"
                self.et.abort(rid)
                if self.et.metrics is not None:
                    self.et.metrics.aborted.inc()

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices.values())

    async def next(self) -> tuple[Choice, StreamItem, list[TokenLogprob]]:
        """The next step output of any choice. Raises a ``RequestEndedError`` when the
        request cannot finish: the engine died, it failed one choice (``RequestFailedError``:
        the whole request fails), or the server is shutting down."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        out = item.output
        c = self.choices[out.request_id]
        if self.prompt_part is not None:
            if self.prompt_part.prompt_only:  # max_tokens 0: the token drawn is dropped
                item = StreamItem(prompt_only(out), item.token_text)
                out = item.output
            c.prompt_ids = out.prompt_token_ids
            if c.prompt_scores is None:
                c.prompt_scores = out.prompt_logprobs
        c.text += out.new_text
        c.num_tokens = len(out.token_ids)
        c.token_text.update(item.token_text)
        new_lps = []
        if out.logprobs is not None and out.new_token_ids:
            new_lps = out.logprobs[-len(out.new_token_ids):]
            c.logprobs.extend(new_lps)
        if out.finished and out.finish_reason == "error":
            c.finish_reason = "error"
            # RequestOutput.error: the engine's message for the one request it failed
            raise RequestFailedError(getattr(out, "error", None)
                                     or "the engine failed this request")
        if out.finished:
            c.finish_reason = "stop" if out.finish_reason == "abort" else out.finish_reason
            m = self.et.metrics
            if m is not None:
                end = out.metrics.finished_time
                rm = out.metrics
                m.observe_finished(c.prompt_len, c.num_tokens, rm.num_steps,
                                   end - rm.arrival_time if end else None,
                                   getattr(rm, "spec_steps", 0), getattr(rm, "spec_tokens", 0))
        return c, item, new_lps

    # -- formatting ----------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        completion = sum(c.num_tokens for c in self.choices.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def logprobs_json(self, c: Choice, lps: list[TokenLogprob], offset: int) -> dict | None:
        if not lps:
            return None
        txt = c.token_text.get
        if self.chat:
            def entry(t: int, lp: float) -> dict:
                s = txt(t, "")
                return {"token": s, "logprob": _logprob(lp), "bytes": list(s.encode())}

            return {"content": [{**entry(lp.token_id, lp.logprob),
                                 "top_logprobs": [entry(t, v) for t, v in lp.top.items()]}
                                for lp in lps]}
        tokens = [txt(lp.token_id, "") for lp in lps]
        offsets, pos = [], offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": [_logprob(lp.logprob) for lp in lps],
                "top_logprobs": [{txt(t, ""): _logprob(v) for t, v in lp.top.items()}
                                 for lp in lps],
                "text_offset": offsets}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        obj: dict[str, Any] = {
            "id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created, "model": self.model, "choices": choices,
        }
        if self.include_usage:
            obj["usage"] = usage
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def chat_delta(self, c: Choice, piece: str, logprobs: dict | None) -> dict | None:
        """A streamed chat choice's next body, None when there is nothing to send yet (its
        tool-call parser holds the piece back)."""
        if c.calls is None:
            delta = {"content": piece} if piece else {}
            reason = c.finish_reason
        else:
            delta = c.calls.feed(piece)
            if c.finish_reason is not None:  # the last piece: flush what was held back
                end = c.calls.finish()
                if "content" in end:
                    delta["content"] = delta.get("content", "") + end["content"]
                delta["tool_calls"] = delta.get("tool_calls", []) + end.get("tool_calls", [])
                if not delta["tool_calls"]:
                    del delta["tool_calls"]
            reason = tool_calls.finish_reason(c.finish_reason, c.calls.called)
            if not delta and reason is None and logprobs is None:
                return None
        return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def completion_choice(self, c: Choice, body: dict) -> dict:
        """A /v1/completions choice ``body`` with the prompt's part (PromptPart.add: first in
        the first body of ``c``, streaming its first chunk)."""
        if self.prompt_part is None:
            return body
        first, c.prompt_sent = not c.prompt_sent, True
        return self.prompt_part.add(body, c.index, first, c.prompt_ids, c.prompt_scores,
                                    c.token_text)

    async def sse(self) -> AsyncIterator[str]:
        try:
            if self.chat:
                for c in sorted(self.choices.values(), key=lambda c: c.index):
                    if self.tools is not None:
                        c.calls = StreamedCalls(self.tools.new_parser())
                    yield self.chunk([{"index": c.index, "delta": {"role": "assistant",
                                                                   "content": ""},
                                       "logprobs": None, "finish_reason": None}])
            while not self.done:
                before = {rid: len(c.text) for rid, c in self.choices.items()}
                c, item, lps = await self.next()
                piece = item.output.new_text
                if not piece and c.finish_reason is None and not lps:
                    continue
                start = before[item.output.request_id]
                logprobs = self.logprobs_json(c, lps, start)
                if self.chat:
                    body = self.chat_delta(c, piece, logprobs)
                    if body is None:
                        continue
                else:
                    body = self.completion_choice(c, {
                        "index": c.index, "text": piece, "logprobs": logprobs,
                        "finish_reason": c.finish_reason})
                yield self.chunk([body])
            if self.include_usage:
                yield self.chunk([], self.usage())
        except RequestEndedError as e:  # engine dead, a choice failed, shutting down
            yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"

    async def collect(self) -> dict:
        while not self.done:
            await self.next()
        choices = []
        for c in sorted(self.choices.values(), key=lambda c: c.index):
            logprobs = self.logprobs_json(c, c.logprobs, 0)
            if self.chat:
                msg, reason = {"role": "assistant", "content": c.text}, c.finish_reason
                if self.tools is not None:
                    msg = tool_calls.message(self.tools.new_parser(), c.text)
                    reason = tool_calls.finish_reason(reason, "tool_calls" in msg)
                choices.append({"index": c.index, "message": msg, "logprobs": logprobs,
                                "finish_reason": reason})
            else:
                choices.append(self.completion_choice(c, {
                    "index": c.index, "text": c.text, "logprobs": logprobs,
                    "finish_reason": c.finish_reason}))
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices,
               "usage": self.usage()}
        part = self.prompt_part
        if self.chat and part is not None and part.prompt_logprobs is not None:
            first = min(self.choices.values(), key=lambda c: c.index)  # one prompt
            out["prompt_logprobs"] = prompt_logprobs_json(first.prompt_scores,
                                                          part.prompt_logprobs, first.token_text)
        return out


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def respond(request: Request, gen: Generation, stream: bool):
    """Stream or collect ``gen``; abort its engine requests if the client leaves. ``gen``
    goes into the request's scope for the request log (app._CountRequests)."""
    request.scope["kiln.generation"] = gen
    if stream:
        return AbortingStreamingResponse(gen.sse(), gen.abort)
    collect = asyncio.ensure_future(gen.collect())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()
            gen.abort()
    if not collect.done():  # the client left first (cancel() takes effect later)
        return JSONResponse({"error": {"message": "client disconnected", "type": "aborted",
                                       "param": None, "code": "client_disconnected"}},
                            status_code=499)
    try:
        return JSONResponse(collect.result())
    except RequestEndedError as e:  # engine dead (503), a choice failed (500), shutdown (503)
        gen.abort()  # a failed choice fails the request: its other choices stop too
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers())


async def _prepare(et: EngineThread, body: CompletionRequest | ChatCompletionRequest,
                   compile_guided: Callable[[Any], Any] | None):
    guided, guided_param = body.guided()
    return await _compile(guided, guided_param, compile_guided)


async def _compile(guided: Any, guided_param: str | None,
                   compile_guided: Callable[[Any], Any] | None):
    if guided is not None:
        if compile_guided is None:
            raise BadRequest("structured output needs xgrammar (pip install xgrammar)",
                             guided_param)
        try:  # warm the compiler's cache off the engine thread; errors fail this request
            await asyncio.to_thread(compile_guided, guided)
        except ValueError as e:
            raise BadRequest(str(e), guided_param) from None
    return guided, guided_param


def _max_tokens(et: EngineThread, prompt_lens: list[int], asked: int | None, param: str,
                chat: bool) -> list[int]:
    """Each prompt's max_tokens. An explicit one must fit the context with its prompt (else a
    400 naming ``param``, in vLLM's words); an omitted one is the rest of the context (chat)
    or DEFAULT_MAX_TOKENS capped to it (completions). A prompt longer than max_input_len is left to the
    engine, which rejects it naming the prompt."""
    limits = et.engine.limits
    ctx = limits.max_seq_len
    if asked is None:
        cap = ctx if chat else DEFAULT_MAX_TOKENS
        return [max(min(cap, ctx - n), 1) for n in prompt_lens]
    fitting = [n for n in prompt_lens if n <= limits.max_input_len]
    longest = max(fitting, default=0)
    if fitting and longest + asked > ctx:
        what = "messages" if chat else "prompt"
        raise BadRequest(
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{longest + asked} tokens ({longest} in the {what}, {asked} in the completion). "
            f"Please reduce the length of the {what} or set {param} to at most "
            f"{ctx - longest}.", param)
    return [asked] * len(prompt_lens)


def _params_for(et: EngineThread, body: CompletionRequest | ChatCompletionRequest,
                max_tokens: list[int], logprobs: int | None, guided: Any,
                prompt_logprobs: int | None = None,
                tenant: str | None = None) -> Callable[[int], Any]:
    """Choice ``idx`` -> its SamplingParams (prompt ``idx // n``, ``choice_seed``)."""
    vocab = et.engine.model_config.vocab_size
    defaults = getattr(et.engine, "generation_defaults", None) or {}

    def params_for(idx: int):
        return sampling_params(body, max_tokens=max_tokens[idx // body.n], logprobs=logprobs,
                               seed=choice_seed(body.seed, idx), guided=guided, vocab=vocab,
                               defaults=defaults, prompt_logprobs=prompt_logprobs,
                               tenant=tenant)

    params_for(0)  # validate once before anything reaches the engine
    return params_for


async def completions(request: Request, et: EngineThread, body: CompletionRequest,
                      model: str, compile_guided, tenant: str | None = None) -> Any:
    """``echo``, ``prompt_logprobs`` and ``max_tokens: 0`` (with echo) add the prompt's part
    to each choice (kiln/server/echo.py); max_tokens 0 runs the prompt with max_tokens 1
    (the scores come with its prefill) and drops the token drawn, as vLLM does. ``tenant``:
    whose cache of earlier responses the request uses (None: the server's)."""
    guided, guided_param = await _prepare(et, body, compile_guided)
    given = body.prompts()
    prompts = []
    for p in given:
        if isinstance(p, str):
            p = await et.call(lambda e, p=p: e.tokenizer.encode(p))
        prompts.append(p)
    max_tokens = _max_tokens(et, [len(p) for p in prompts], body.max_tokens, "max_tokens",
                             chat=False)
    part = PromptPart(body.n, body.echo, body.logprobs, body.prompt_logprobs,
                      prompt_only=body.max_tokens == 0)
    params_for = _params_for(et, body, [max(m, 1) for m in max_tokens], body.logprobs, guided,
                             part.engine_k, tenant)
    include_usage = bool(body.stream and body.stream_options and
                         body.stream_options.include_usage)
    gen = Generation(et, model, chat=False, include_usage=include_usage)
    if part.echo or part.prompt_logprobs is not None:
        gen.prompt_part = part
    await gen.start(prompts, params_for, body.n,
                    body.logprobs is not None or part.engine_k is not None, "prompt",
                    guided_param)
    if part.echo:  # a token-id prompt echoes its text (decoded once the engine took it)
        try:
            for p, ids in zip(given, prompts):
                part.texts.append(p if isinstance(p, str) else await et.call(
                    lambda e, ids=ids: e.tokenizer.decode(ids)))
        except BaseException:
            gen.abort()
            raise
    return await respond(request, gen, body.stream)


async def chat_completions(request: Request, et: EngineThread, body: ChatCompletionRequest,
                           model: str, compile_guided, tool_parser: str | None = None,
                           tenant: str | None = None) -> Any:
    """``tool_parser``: the tool-call family this server reads calls in (None: no tools);
    ``tenant``: as for ``completions``."""
    tools = tool_calls.plan_tools(body, tool_parser)
    if tools is not None:
        guided_param = "tools" if tools.mode == "auto" else "tool_choice"
        guided = await tool_calls.compile_tools(tools, guided_param, compile_guided)
    else:
        guided, guided_param = await _prepare(et, body, compile_guided)
    if tools is not None and tools.parser.keeps_special_tokens:
        body = body.model_copy(update={"skip_special_tokens": False})
    messages = chat_dicts(body.messages)
    template_tools = tools.tools if tools is not None else None
    try:
        ids = await et.call(lambda e: e.apply_chat_template(messages, template_tools))
    except ValueError as e:
        raise BadRequest(str(e), "messages") from None
    param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    max_tokens = _max_tokens(et, [len(ids)], getattr(body, param), param, chat=True)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params_for = _params_for(et, body, max_tokens, logprobs, guided, body.prompt_logprobs,
                             tenant)
    include_usage = bool(body.stream and body.stream_options and
                         body.stream_options.include_usage)
    gen = Generation(et, model, chat=True, include_usage=include_usage, tools=tools)
    if body.prompt_logprobs is not None:  # vLLM's: on the response, not on a choice
        gen.prompt_part = PromptPart(body.n, prompt_logprobs=body.prompt_logprobs)
    await gen.start([ids], params_for, body.n,
                    logprobs is not None or body.prompt_logprobs is not None, "messages",
                    guided_param)
    return await respond(request, gen, body.stream)
