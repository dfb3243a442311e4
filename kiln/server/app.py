"""The FastAPI app of `kiln serve`: routes, auth, body limit, OpenAI error bodies, metrics.

``create_app(engine, config)`` returns an app whose lifespan starts the engine thread. Every
error is ``{"error": {"message", "type", "param", "code"}}``: 400 bad input (validation errors
name the field), 401 bad key, 404 unknown model or route, 413 oversize body, 429 queue full,
503 engine dead. A client that leaves a non-streaming request before its answer is counted
as 499 in /metrics (its engine requests are aborted); nothing is sent to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kiln import __version__
from kiln.server import openai_api, openapi
from kiln.server.body import parse_body
from kiln.server.engine_thread import EngineDeadError, EngineThread, QueueFullError
from kiln.server.lifecycle import Lifecycle, LifecycleMiddleware, Timeouts
from kiln.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from kiln.server.protocol import (
    BadRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_dicts,
)

_PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/debug/")
# the error statuses /openapi.json documents (503 everywhere but /metrics: engine dead or
# draining; 408: the lifecycle middleware's body-read timeout)
_GENERATE_ERRORS = (400, 404, 408, 413, 429, 500, 503)
_BODY_ERRORS = (400, 404, 408, 413, 503)
_KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                "/tokenize", "/detokenize", "/version", "/debug/kv", "/openapi.json", "/docs")


@dataclass(frozen=True)
class ServerConfig:
    """How one server behaves. ``model_aliases``: other names accepted as ``model``."""

    served_model_name: str
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_queue: int = 1024
    max_body_bytes: int = 1 << 20
    tool_parser: str | None = None  # None: the engine's (engine.json); "none": no tools
    # Suffix decoding's cache of earlier responses: one for the server ("server"), or one per
    # tenant ("tenant"): the header ``tenant_header`` names it, else the body's ``user``;
    # requests that name none share the anonymous tenant's.
    suffix_cache_scope: str = "server"
    tenant_header: str | None = None

    def __post_init__(self) -> None:
        if self.tool_parser not in (None, "none"):
            from kiln.tools import get_parser

            try:
                get_parser(self.tool_parser)
            except ValueError as e:
                raise ValueError(f"--tool-parser: {e}, or none") from None
        if self.max_queue < 1:
            raise ValueError(f"max_queue={self.max_queue} must be >= 1")
        if self.suffix_cache_scope not in ("server", "tenant"):
            raise ValueError(f"--suffix-cache-scope {self.suffix_cache_scope!r} is not one of "
                             "server, tenant")
        if self.tenant_header is not None and self.suffix_cache_scope != "tenant":
            raise ValueError(f"--tenant-header {self.tenant_header} needs "
                             "--suffix-cache-scope tenant (the header names a request's tenant)")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} must be >= 1024")


def error_response(status: int, message: str, param: str | None = None,
                   type_: str = "invalid_request_error", code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class _CountRequests:
    """ASGI middleware: count responses by path and status (streams too, no buffering), and
    log one line per request at INFO on ``kiln.server`` (``kiln serve --log-level info``): its
    id, method and path, status, prompt and output tokens (completions), and seconds. A
    generation route puts its ``Generation`` in ``scope["kiln.generation"]``; its id (the
    response's ``id``) and token counts are read once the response is done."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]
        t0 = time.perf_counter()

        async def send_status(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope["path"] if scope["path"] in _KNOWN_PATHS else "other"
            self.metrics.requests.labels(endpoint=path, status=str(status[0])).inc()
            if request_log.isEnabledFor(logging.INFO):
                request_log.info(_log_line(scope, status[0], time.perf_counter() - t0))


request_log = logging.getLogger("kiln.server")


def _log_line(scope: dict, status: int, seconds: float) -> str:
    gen = scope.get("kiln.generation")
    if gen is not None:
        usage = gen.usage()
        rid, tokens = gen.id, (f"prompt_tokens={usage['prompt_tokens']} "
                               f"output_tokens={usage['completion_tokens']} ")
    else:
        rid, tokens = "req-" + uuid.uuid4().hex[:12], ""
    client = scope.get("client")
    peer = f"{client[0]}:{client[1]} " if client else ""
    return (f"{rid} {peer}{scope['method']} {scope['path']} {status} {tokens}"
            f"{seconds:.3f}s")


def record_startup(app: FastAPI, total_s: float, phases: dict[str, float]) -> None:
    """Publish start-up time (engine loading to accepting requests) in /health
    (``startup_s`` and ``startup`` by phase) and /metrics (kiln_startup_seconds)."""
    app.state.startup = {"startup_s": round(total_s, 3),
                         "startup": {k: round(v, 3) for k, v in phases.items()}}
    app.state.metrics.set_startup(total_s, phases)


def create_app(engine: Any, config: ServerConfig,
               on_dead: Callable[[BaseException], None] | None = None,
               timeouts: Timeouts | None = None) -> FastAPI:
    """The app serving ``engine``; its lifespan runs the engine thread. ``timeouts``: the
    body read limit and the drain (``app.state.lifecycle``, which `kiln serve` drives)."""
    metrics = ServerMetrics(config.served_model_name)
    et = EngineThread(engine, max_queue=config.max_queue, metrics=metrics, on_dead=on_dead)
    try:
        compiler = engine.guided_compiler  # built here, before the engine thread exists
        compile_guided = compiler.compiled
    except ImportError:
        compile_guided = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        et.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            et.stop()

    app = FastAPI(title="kiln", version=__version__, lifespan=lifespan, docs_url="/docs",
                  redoc_url=None, openapi_url="/openapi.json",
                  description=f"kiln serving {config.served_model_name!r}: OpenAI-compatible "
                              "completions and chat completions, plus tokenize and health.")

    def schema() -> dict:  # /openapi.json, built once
        if app.openapi_schema is None:
            spec = engine.speculative
            w, n, g = spec.lookahead if spec.mode == "lookahead" else (1, 1, 0)
            maxima = {"token_id": engine.model_config.vocab_size - 1, "w": w, "n": n, "g": g,
                      "k": spec.max_draft_len if spec.request_draft_len else 0,
                      # a prompt has >= 1 token: max_tokens <= the context minus one
                      "max_tokens": engine.limits.max_seq_len - 1}
            app.openapi_schema = openapi.openapi(
                app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                      DetokenizeRequest], maxima=maxima, protected=_PROTECTED,
                api_key=config.api_key is not None)
            if tool_parser is None:  # this server reads no tool calls: no tools to send
                props = app.openapi_schema["components"]["schemas"]["ChatCompletionRequest"][
                    "properties"]
                props["tools"] = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}],
                                  "description": "none: this server reads no tool calls "
                                  "(kiln serve --tool-parser)"}
        return app.openapi_schema

    app.openapi = schema
    tool_parser = engine.tool_parser if config.tool_parser is None else config.tool_parser
    tool_parser = None if tool_parser == "none" else tool_parser
    app.state.engine_thread = et
    app.state.metrics = metrics
    app.state.startup = None  # set by record_startup once the server accepts requests
    app.state.lifecycle = Lifecycle(et, timeouts or Timeouts())
    # Added before _CountRequests, so it runs inside it: its 503s and 408s are counted.
    app.add_middleware(LifecycleMiddleware, lifecycle=app.state.lifecycle)
    app.add_middleware(_CountRequests, metrics=metrics)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, e: BadRequest):
        return error_response(e.status, e.message, e.param, e.type, e.code, e.headers)

    @app.exception_handler(QueueFullError)
    async def _full(request: Request, e: QueueFullError):
        return error_response(429, str(e), None, "rate_limit_error", "queue_full",
                              {"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, e: EngineDeadError):
        return error_response(503, str(e), None, "server_error", "engine_dead")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = str(e.detail)
        allow = (e.headers or {}).get("Allow")
        if e.status_code == 405 and allow:
            message = f"{request.method} is not allowed on {request.url.path}; use {allow}"
        return error_response(e.status_code, message, None, "invalid_request_error", code,
                              e.headers)  # 405: Allow lists the methods the route takes

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return error_response(500, f"internal error: {type(e).__name__}: {e}", None,
                              "server_error")

    def check_auth(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").strip().partition(" ")
        # the scheme is case-insensitive (RFC 9110 11.1); the key is compared in constant time
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                key.strip().encode(), config.api_key.encode()):
            raise BadRequest("invalid or missing API key; send 'Authorization: Bearer KEY'",
                             None, status=401, type_="authentication_error",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(model: str | None) -> None:
        if model is not None and model != config.served_model_name \
                and model not in config.model_aliases:
            raise BadRequest(f"model {model!r} does not exist; this server serves "
                             f"{config.served_model_name!r}", "model", status=404,
                             code="model_not_found")

    def check_alive() -> None:
        if not et.alive:
            raise EngineDeadError(f"the engine is not running: {et.dead!r}")

    async def read_body(request: Request, model: type[BaseModel]) -> Any:
        check_auth(request)
        check_alive()
        limit = config.max_body_bytes
        too_big = BadRequest(f"request body is larger than {limit} bytes (--max-body-bytes)",
                             None, status=413, code="body_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > limit:
                raise too_big
        body = parse_body(bytes(raw), model)
        check_model(getattr(body, "model", None))
        return body

    def tenant(request: Request, body: Any) -> str | None:
        """The request's tenant under per-tenant caches (None: the server's one cache)."""
        if config.suffix_cache_scope != "tenant":
            return None
        if config.tenant_header is not None:
            return request.headers.get(config.tenant_header, "")
        return body.user or ""

    @app.post("/v1/completions", openapi_extra=openapi.request_body(CompletionRequest),
              responses=openapi.responses(openapi.CompletionResponse, *_GENERATE_ERRORS,
                                          stream=openapi.CompletionChunk))
    async def completions(request: Request):
        body = await read_body(request, CompletionRequest)
        return await openai_api.completions(request, et, body, config.served_model_name,
                                            compile_guided, tenant(request, body))

    @app.post("/v1/chat/completions",
              openapi_extra=openapi.request_body(ChatCompletionRequest),
              responses=openapi.responses(openapi.ChatCompletionResponse, *_GENERATE_ERRORS,
                                          stream=openapi.ChatCompletionChunk))
    async def chat_completions(request: Request):
        body = await read_body(request, ChatCompletionRequest)
        return await openai_api.chat_completions(request, et, body, config.served_model_name,
                                                 compile_guided, tool_parser,
                                                 tenant(request, body))

    @app.get("/v1/models", responses=openapi.responses(openapi.ModelList, 503))
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "kiln", "max_model_len": engine.limits.max_seq_len,
        }]}

    @app.get("/health", responses=openapi.responses(
        openapi.HealthResponse, (503, openapi.HealthUnavailable)))
    async def health():
        if not et.alive:
            return error_response(503, f"the engine is not running: {et.dead!r}", None,
                                  "server_error", "engine_dead")
        body: dict[str, Any] = {"status": "ok"}
        if app.state.startup is not None:
            body.update(app.state.startup)
        return body

    @app.get("/version", responses=openapi.responses(openapi.VersionResponse, 503))
    async def version():
        return {"version": __version__}

    @app.get("/metrics", responses=openapi.responses(None, content={
        CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}))
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", openapi_extra=openapi.request_body(TokenizeRequest),
              responses=openapi.responses(openapi.TokenizeResponse, *_BODY_ERRORS))
    async def tokenize(request: Request):
        body = await read_body(request, TokenizeRequest)
        if body.messages is not None:
            msgs = chat_dicts(body.messages)
            try:
                ids = await et.call(lambda e: e.apply_chat_template(msgs))
            except ValueError as e:
                raise BadRequest(str(e), "messages") from None
        else:
            ids = await et.call(lambda e: e.tokenizer.encode(body.prompt))
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.limits.max_seq_len}

    @app.post("/detokenize", openapi_extra=openapi.request_body(DetokenizeRequest),
              responses=openapi.responses(openapi.DetokenizeResponse, *_BODY_ERRORS))
    async def detokenize(request: Request):
        body = await read_body(request, DetokenizeRequest)
        vocab = engine.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"tokens {bad[:5]} are outside this model's vocabulary "
                             f"[0, {vocab}); send token ids below {vocab}", "tokens")
        text = await et.call(lambda e: e.tokenizer.decode(body.tokens))
        return {"prompt": text}

    @app.get("/debug/kv", include_in_schema=False)
    async def debug_kv(request: Request):
        check_auth(request)
        check_alive()

        def kv(e: Any) -> dict:
            try:
                e.blocks.check_all_free()
                all_free = True
            except RuntimeError:
                all_free = False
            return {"free_blocks": e.blocks.num_free_blocks, "total_blocks": e.blocks.num_blocks,
                    "all_free": all_free, "has_unfinished": e.has_unfinished_requests()}

        return await et.call(kv)

    return app
