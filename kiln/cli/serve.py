"""`kiln serve ENGINE_OR_SOURCE`: an OpenAI-compatible HTTP server over one engine.

A model source (``smollm2-135m``, a HF directory, ``random:tiny-llama`` ...) instead of an
engine directory is built once into ``$KILN_CACHE/engines/<name>`` and reused.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from pathlib import Path

import typer

from kiln.cli.engine_source import engine_dir_for
from kiln.cli.generate import ADAPTIVE_SPEC_HELP, ENFORCE_EAGER_HELP, NO_ASYNC_HELP
from kiln.errors import KilnError


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, made before the engine loads (seconds to minutes)
    so that a busy port fails at once; uvicorn then serves on it (``sockets=[sock]``)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise KilnError(f"--host {host} does not resolve ({e.strerror}); give an address "
                        "such as 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    # As asyncio does: a restart need not wait out the old socket's TIME_WAIT (a socket still
    # listening on the port makes bind fail all the same).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise KilnError(f"port {port} on {host} is in use; pick another with --port"
                            ) from None
        raise KilnError(f"cannot listen on {host} port {port}: {e.strerror}; pick another "
                        "--host or --port") from None
    return sock


_WORDS = {"kv": "KV", "cuda": "CUDA", "gpu": "GPU"}


def startup_phases(engine_times: dict[str, float] | None, engine_s: float,
                   server_s: float) -> dict[str, float]:
    """Start-up seconds by phase: the engine's own ``startup_times`` parts (load_weights_s,
    kv_cache_s, cuda_graphs_s, ...; its total_s left out) or, when it reports none, the
    whole ``engine_s``; then ``server_s`` (app, engine thread, socket)."""
    parts = {k: float(v) for k, v in (engine_times or {}).items()
             if k.endswith("_s") and k != "total_s" and isinstance(v, (int, float))}
    if not parts:
        parts = {"engine_s": engine_s}
    parts["server_s"] = server_s
    return parts


def startup_line(total_s: float, phases: dict[str, float]) -> str:
    """``kiln serve: ready in 4.2 s (load weights 1.1 s, KV cache 0.3 s, ...)``."""
    def label(key: str) -> str:
        return " ".join(_WORDS.get(w, w) for w in key.removesuffix("_s").split("_"))

    parts = ", ".join(f"{label(k)} {v:.1f} s" for k, v in phases.items())
    return f"kiln serve: ready in {total_s:.1f} s ({parts})"


def _check_cache_scope(engine_dir: Path, scope: str, header: str | None) -> None:
    """--suffix-cache-scope tenant names the caches of a suffix engine: on another engine it
    is one clear error before loading."""
    if scope == "server":
        return
    spec = json.loads((engine_dir / "engine.json").read_text()).get("speculative") or {}
    mode = spec.get("mode", "none")
    if mode != "suffix":
        raise KilnError(f"--suffix-cache-scope {scope}: engine {engine_dir} was built with "
                        f"speculative decoding mode {mode!r}, and only suffix engines keep a "
                        "cache of earlier responses; drop the flag, or serve an engine built "
                        "with --speculative-decoding-mode suffix")
    named_by = f"header {header}" if header else "the body's user field"
    print(f"kiln serve: suffix decoding keeps one cache of earlier responses per tenant "
          f"(named by {named_by})", file=sys.stderr, flush=True)


def serve(
    engine_or_source: str = typer.Argument(
        ..., metavar="ENGINE_OR_SOURCE",
        help="Engine directory from `kiln build`, or a model source to build first (cached "
        "in $KILN_CACHE/engines): smollm2-135m, a HF directory, random:tiny-llama, ..."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    port: int = typer.Option(8000, "--port", help="Port to bind; 0 picks a free one."),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="KILN_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1/completions, /v1/chat/completions, "
        "/v1/models, /tokenize, /detokenize and /debug/kv; /health, /version, /metrics, "
        "/openapi.json and /docs stay open (env KILN_API_KEY)."),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="Model name clients send (default: the engine "
        "directory's name)."),
    max_queue: int = typer.Option(1024, "--max-queue",
                                  help="Most engine requests (an HTTP request makes prompts "
                                  "x n) waiting beyond the batch's slots; more get 429 (400 when "
                                  "one request alone needs more than the slots + this)."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes",
                                       help="Largest request body; larger ones get 413."),
    shutdown_timeout: float = typer.Option(
        30.0, "--shutdown-timeout", help="On SIGTERM or Ctrl-C: seconds the requests in flight "
        "get to finish (new ones get 503) before the rest are ended; then exit 0."),
    header_timeout: float = typer.Option(
        10.0, "--header-timeout", help="Seconds a client gets to send a request's headers; "
        "a slower one gets 408 and is disconnected."),
    body_timeout: float = typer.Option(
        20.0, "--body-timeout", help="Seconds a client gets to send a request's body after "
        "its headers; a slower one gets 408 and is disconnected."),
    device: str | None = typer.Option(None, "--device", help="Device (cuda, cuda:1, cpu); "
                                      "default cuda when available."),
    as_json: bool = typer.Option(False, "--json",
                                 help="Print the ready line as one JSON object."),
    log_level: str = typer.Option(
        "warning", "--log-level", help="Log level: critical, error, warning, info, debug or "
        "trace; info and below log one line per request (id, route, status, prompt and "
        "output tokens, seconds)."),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help=ENFORCE_EAGER_HELP),
    no_async: bool = typer.Option(False, "--no-async-scheduling", help=NO_ASYNC_HELP),
    adaptive_spec: bool | None = typer.Option(
        None, "--adaptive-speculation/--always-speculate", help=ADAPTIVE_SPEC_HELP),
    tool_parser: str | None = typer.Option(
        None, "--tool-parser",
        help="How tool calls are read from the model's output: hermes (Qwen2.5 / Qwen3 "
        "<tool_call> blocks), llama3_json (Llama 3.1+), mistral ([TOOL_CALLS]) or none (tools "
        "answered with a 400). Default: the one the engine recorded at build (`kiln inspect` "
        "shows it).",
    ),
    suffix_cache_scope: str = typer.Option(
        "server", "--suffix-cache-scope",
        help="Suffix engines: whose earlier responses a request drafts from. server (the "
        "default): one cache for every request; tenant: one per tenant, named by "
        "--tenant-header or else by the body's `user` field (requests naming none share an "
        "anonymous one), so acceptance timing cannot tell one tenant what another was "
        "answered. The caches live in memory only, bounded together by the engine's "
        "suffix_cache_requests."),
    tenant_header: str | None = typer.Option(
        None, "--tenant-header",
        help="With --suffix-cache-scope tenant: the request header that names the tenant "
        "(e.g. X-Tenant-Id, set by your gateway) instead of the body's `user` field."),
) -> None:
    """Serve an engine over HTTP: /v1/completions, /v1/chat/completions (SSE), /metrics."""
    if max_queue < 1:
        raise KilnError(f"--max-queue {max_queue} must be >= 1")
    _log_requests(log_level)
    # Before torch and the engine are even imported (seconds) or loaded (minutes): a busy port
    # fails at once. A follower rank torchrun started serves nothing (launched() below reads
    # the same variables, and checks them).
    follower = "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("RANK", "0") != "0"
    sock = None if follower else bind(host, port)

    import uvicorn

    from kiln.cli.generate import exit_on_rank_failure, runtime_config
    from kiln.runtime.engine import LLMEngine
    from kiln.runtime.parallel.launch import launched
    from kiln.server.app import ServerConfig, create_app, record_startup
    from kiln.server.lifecycle import END_GRACE_S, DrainingServer, Timeouts, http_protocol

    try:  # before loading: a bad value fails now
        ServerConfig("check", tool_parser=tool_parser, suffix_cache_scope=suffix_cache_scope,
                     tenant_header=tenant_header)
    except ValueError as e:
        raise KilnError(str(e)) from None
    timeouts = Timeouts(header_timeout, body_timeout, shutdown_timeout)
    launched()  # under torchrun: its variables are complete (a follower leaves in the load)
    engine_dir, _ = engine_dir_for(engine_or_source, device)
    _check_cache_scope(engine_dir, suffix_cache_scope, tenant_header)
    t0 = time.perf_counter()  # start-up: from engine loading to accepting requests
    engine = LLMEngine.from_engine_dir(
        engine_dir, runtime_config(device, enforce_eager, no_async, adaptive_spec))
    exit_on_rank_failure(engine)  # after a rank's failure: 503s, then exit 1, whatever blocks
    t_engine = time.perf_counter()
    print(f"kiln serve: {engine.sizing.line()}", file=sys.stderr, flush=True)
    # A source (smollm2-135m, a HF dir) is served under its own name, an engine under its dir's.
    from_source = engine_dir != Path(engine_or_source).expanduser()
    name = served_model_name or (Path(engine_or_source).name if from_source else engine_dir.name)
    aliases = tuple({engine_or_source, str(engine_dir), str(engine_dir.resolve())} - {name})
    config = ServerConfig(name, aliases, api_key or None, max_queue, max_body_bytes,
                          tool_parser, suffix_cache_scope, tenant_header)
    holder: dict[str, uvicorn.Server] = {}

    def on_dead(exc: BaseException) -> None:
        print(f"error: the engine stopped: {type(exc).__name__}: {exc}; shutting down",
              file=sys.stderr)
        holder["server"].should_exit = True

    app = create_app(engine, config, on_dead=on_dead, timeouts=timeouts)

    class _Server(DrainingServer):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if not self.started:
                return
            now = time.perf_counter()
            phases = startup_phases(getattr(engine, "startup_times", None), t_engine - t0,
                                    now - t_engine)
            record_startup(app, now - t0, phases)
            print(startup_line(now - t0, phases), file=sys.stderr, flush=True)
            bound = self.servers[0].sockets[0].getsockname()
            url = f"http://{bound[0]}:{bound[1]}"
            ready = {"event": "ready", "url": url, "model": name, "engine": str(engine_dir),
                     "device": str(engine.device), "startup_s": round(now - t0, 3),
                     "startup": {k: round(v, 3) for k, v in phases.items()}}
            if as_json:
                print(json.dumps(ready), flush=True)
            else:
                print(f"kiln serve: {name} ready at {url} (device {engine.device}, started in "
                      f"{ready['startup_s']:.1f}s)", flush=True)

    # The drain (SIGTERM) is DrainingServer's; timeout_graceful_shutdown only bounds what is
    # left after it, or after the engine died (requests already answered with an error).
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                    timeout_graceful_shutdown=END_GRACE_S, access_log=False,
                                    http=http_protocol(timeouts.header_s)),
                     app.state.lifecycle)
    holder["server"] = server
    server.run(sockets=[sock])
    et = app.state.engine_thread
    if et.dead is not None:
        raise KilnError(f"the engine stopped: {type(et.dead).__name__}: {et.dead}")
    if not server.started:
        raise KilnError(f"could not start the server on {host}:{port}")


def _log_requests(log_level: str) -> None:
    """Send the server's request log (kiln.server, one line per request at INFO) to stderr
    at ``log_level``, formatted as uvicorn's own lines are."""
    import logging

    from uvicorn.config import LOG_LEVELS
    from uvicorn.logging import DefaultFormatter

    if log_level not in LOG_LEVELS:
        raise KilnError(f"--log-level {log_level!r} is not a log level; use one of "
                        f"{', '.join(LOG_LEVELS)}")
    log = logging.getLogger("kiln.server")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    log.handlers = [handler]
    log.setLevel(LOG_LEVELS[log_level])
    log.propagate = False


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
