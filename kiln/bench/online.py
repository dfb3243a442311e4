"""`kiln bench serve`: an async streaming client against any OpenAI-compatible server.

Each request streams (SSE) from ``/v1/completions`` (or ``/v1/chat/completions``); the client
timestamps every chunk that carries text. Per request: TTFT (send to first text chunk), ITL
(gaps between text chunks), E2E, and TPOT = (E2E - TTFT) / (n - 1) with n the completion tokens
(from the server's usage report when it sends one, else the number of text chunks).
Requests arrive as a Poisson process at ``request_rate`` per second (``inf``: all at once),
with at most ``max_concurrency`` in flight (0: unlimited).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kiln.bench.stats import rate, summarize, tpot


@dataclass(frozen=True)
class ServePrompt:
    """One request: prompt text and the number of tokens to ask for."""

    text: str
    output_len: int
    prompt_len: int | None = None  # tokens, when known on the client side


@dataclass
class RequestResult:
    """What the client saw of one request."""

    ok: bool
    prompt_len: int | None = None
    output_tokens: int = 0
    num_chunks: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None


def _payload(endpoint: str, model: str, prompt: ServePrompt, temperature: float,
             ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": prompt.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # a vLLM/kiln extension; OpenAI itself ignores it
    if endpoint.rstrip("/").endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    return body


def _chunk_text(obj: dict[str, Any]) -> str:
    parts = []
    for choice in obj.get("choices") or []:
        piece = choice.get("text")
        if piece is None:
            piece = (choice.get("delta") or {}).get("content")
        if piece:
            parts.append(piece)
    return "".join(parts)


async def send_request(client: Any, url: str, body: dict[str, Any],
                       headers: dict[str, str]) -> RequestResult:
    """Stream one request and time its chunks; failures are results, not exceptions."""
    start = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    usage = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode("utf-8", "replace")
                try:
                    msg = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = raw[:200]
                res.error = f"HTTP {resp.status_code}: {msg}"
                res.e2e_s = time.perf_counter() - start
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"]
                if _chunk_text(obj):
                    now = time.perf_counter()
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    res.num_chunks += 1
    except Exception as e:
        res.error = f"{type(e).__name__}: {e}"
        res.e2e_s = time.perf_counter() - start
        return res
    res.e2e_s = time.perf_counter() - start
    res.ok = True
    if usage:
        res.output_tokens = int(usage.get("completion_tokens") or res.num_chunks)
        res.prompt_len = usage.get("prompt_tokens")
    else:
        res.output_tokens = res.num_chunks
    return res


async def _run(base_url: str, endpoint: str, model: str, prompts: Sequence[ServePrompt],
               request_rate: float, max_concurrency: int, api_key: str | None,
               temperature: float, ignore_eos: bool, seed: int, timeout_s: float,
               progress: Callable[[int], None] | None) -> tuple[list[RequestResult], float]:
    import httpx

    url = base_url.rstrip("/") + "/" + endpoint.lstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    limits = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=None)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:

        async def one(p: ServePrompt) -> RequestResult:
            body = _payload(endpoint, model, p, temperature, ignore_eos)
            if sem is None:
                r = await send_request(client, url, body, headers)
            else:
                async with sem:
                    r = await send_request(client, url, body, headers)
            if r.prompt_len is None:
                r.prompt_len = p.prompt_len
            if progress is not None:
                progress(1)
            return r

        start = time.perf_counter()
        tasks = []
        for i, p in enumerate(prompts):
            if i and math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(one(p)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def fetch_model_name(base_url: str, api_key: str | None = None, timeout_s: float = 10) -> str:
    """The first model id the server lists at /v1/models."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout_s)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"cannot get a model name from {url} ({type(e).__name__}: {e}); is the server "
            "running? pass --model NAME to skip this lookup"
        ) from e


def run_serve(
    base_url: str,
    prompts: Sequence[ServePrompt],
    *,
    model: str | None = None,
    endpoint: str = "/v1/completions",
    request_rate: float = math.inf,
    max_concurrency: int = 0,
    api_key: str | None = None,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    seed: int = 0,
    timeout_s: float = 600.0,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Send ``prompts`` to the server and summarize what the client saw."""
    if not prompts:
        raise ValueError("no prompts to send; use --num-prompts 1 or more")
    if request_rate <= 0:
        raise ValueError(f"request_rate={request_rate} must be > 0 (inf sends all at once)")
    if max_concurrency < 0:
        raise ValueError(f"max_concurrency={max_concurrency} must be >= 0 (0: unlimited)")
    model = model or fetch_model_name(base_url, api_key)
    results, duration = asyncio.run(_run(
        base_url, endpoint, model, prompts, request_rate, max_concurrency, api_key,
        temperature, ignore_eos, seed, timeout_s, progress,
    ))
    good = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    in_tokens = sum(r.prompt_len or 0 for r in good)
    chunks = sum(r.num_chunks for r in good)
    tpots = [t for r in good if r.ttft_s is not None
             and (t := tpot(r.e2e_s, r.ttft_s, r.output_tokens)) is not None]
    return {
        "benchmark": "serve",
        "config": {
            "base_url": base_url,
            "endpoint": endpoint,
            "model": model,
            "num_prompts": len(prompts),
            "request_rate": request_rate if math.isfinite(request_rate) else "inf",
            "max_concurrency": max_concurrency,
            "temperature": temperature,
            "ignore_eos": ignore_eos,
            "seed": seed,
        },
        "completed": len(good),
        "failed": len(errors),
        "errors": errors[:10],
        "duration_s": duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "requests_per_s": rate(len(good), duration),
        "output_tokens_per_s": rate(out_tokens, duration),
        "total_tokens_per_s": rate(in_tokens + out_tokens, duration),
        # > 1 when the server streams several tokens per chunk (e.g. speculative decoding)
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
        "ttft_s": summarize([r.ttft_s for r in good if r.ttft_s is not None]),
        "tpot_s": summarize(tpots),
        "itl_s": summarize([x for r in good for x in r.itl_s]),
        "e2e_s": summarize([r.e2e_s for r in good]),
    }


def synthetic_prompts(tokenizer: Any, num_prompts: int, input_len: int, output_len: int,
                      seed: int = 0) -> list[ServePrompt]:
    """Prompts decoded from ``input_len`` random non-special token ids (vLLM's random dataset).

    Re-tokenizing the text on the server can give a slightly different length.
    """
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError(
            f"num_prompts={num_prompts}, input_len={input_len} and output_len={output_len} "
            "must all be >= 1"
        )
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    allowed = [t for t in range(len(tokenizer)) if t not in special]
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        ids = [allowed[rng.randrange(len(allowed))] for _ in range(input_len)]
        prompts.append(ServePrompt(tokenizer.decode(ids), output_len, input_len))
    return prompts
