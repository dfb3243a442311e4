"""`kiln generate ENGINE_OR_SOURCE PROMPT`: run one prompt on an engine and stream the answer.

A model source instead of an engine directory is built once into $KILN_CACHE/engines (see
kiln.cli.engine_source). Sampling options the user leaves out take the engine's generation
defaults (`kiln inspect`), then FALLBACK_SAMPLING.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import typer

from kiln.errors import KilnError

ENFORCE_EAGER_HELP = ("Run the CUDA kernels without CUDA graphs (no capture at start-up; "
                      "same results). Also KILN_CUDA_GRAPHS=0.")


NO_ASYNC_HELP = ("Read each decode step's tokens before scheduling the next (no host/GPU "
                 "overlap; same results, for A/B timing). Also KILN_ASYNC_SCHEDULING=0.")

ADAPTIVE_SPEC_HELP = ("Speculative engines: --adaptive-speculation (the default) lets a "
                      "request speculate only while its speculative steps are expected to "
                      "commit more tokens than a step costs (timed on whole engine steps at "
                      "start-up, estimated on the host from what it commits, without "
                      "probes); --always-speculate always does. The output is the same "
                      "either way. Also KILN_ADAPTIVE_SPECULATION=0/1.")


def runtime_config(device: str | None, enforce_eager: bool = False,
                   no_async: bool = False, adaptive_spec: bool | None = None) -> Any:
    """The RuntimeConfig the CLI commands load engines with (``adaptive_spec`` None: the
    RuntimeConfig default, which KILN_ADAPTIVE_SPECULATION sets)."""
    from kiln.runtime.engine import RuntimeConfig

    kw: dict[str, Any] = {"cuda_graphs": False} if enforce_eager else {}
    if no_async:
        kw["async_scheduling"] = False
    if adaptive_spec is not None:
        kw["adaptive_speculation"] = adaptive_spec
    return RuntimeConfig(device=device, **kw)


def load_engine(engine_dir: Path, device: str | None = None, enforce_eager: bool = False,
                no_async: bool = False,
                adaptive_spec: bool | None = None) -> tuple[Any, float]:
    """Load an engine directory (one that ``engine_dir_for`` resolved); returns (engine, load
    seconds). Shows a spinner on stderr."""
    from rich.console import Console

    console = Console(stderr=True)
    t0 = time.perf_counter()
    with console.status(f"loading engine {engine_dir}", spinner="dots"):
        from kiln.runtime.engine import LLMEngine

        engine = LLMEngine.from_engine_dir(
            engine_dir, runtime_config(device, enforce_eager, no_async, adaptive_spec))
    exit_on_rank_failure(engine)
    return engine, time.perf_counter() - t0


def exit_on_rank_failure(engine: Any) -> None:
    """A command's process must not outlive a tensor-parallel engine's failure: if it
    cannot stop by itself (rank 0 blocked in a collective), the supervisor ends it with
    exit code 1 (kiln.runtime.parallel.ranks). Nothing for a tp-1 engine."""
    if getattr(engine, "tp", None) is not None:
        engine.tp.exit_on_failure()


# What an omitted sampling option is when the engine records no default for it.
FALLBACK_SAMPLING = {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                     "repetition_penalty": 1.0}
ENGINE_OR_SOURCE_HELP = ("Engine directory from `kiln build`, or a model source to build first "
                         "(cached in $KILN_CACHE/engines): smollm2-135m, a HF directory, a "
                         ".gguf file, random:tiny-llama, ...")


def sampling_values(given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The sampling options of one request: what the user gave (not None), else the engine's
    generation default, else FALLBACK_SAMPLING."""
    return {k: given[k] if given.get(k) is not None else defaults.get(k, fallback)
            for k, fallback in FALLBACK_SAMPLING.items()}


def _read_prompt(prompt: str) -> str:
    if prompt == "-":
        text = sys.stdin.read()
        return text.removesuffix("\n")
    return prompt


def generate(
    engine_or_source: str = typer.Argument(..., metavar="ENGINE_OR_SOURCE",
                                           help=ENGINE_OR_SOURCE_HELP),
    prompt: str = typer.Argument(..., metavar="PROMPT",
                                 help="The prompt; `-` reads it from stdin."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Most tokens to generate."),
    temperature: float | None = typer.Option(
        None, "--temperature", help="Sampling temperature; 0 is greedy. Default: the "
        "engine's generation default (`kiln inspect`), else 0.7."),
    top_k: int | None = typer.Option(
        None, "--top-k", help="Keep the k most likely tokens; 0 disables. Default: the "
        "engine's, else 0."),
    top_p: float | None = typer.Option(
        None, "--top-p", help="Nucleus sampling mass in (0, 1]. Default: the engine's, else 1."),
    min_p: float | None = typer.Option(
        None, "--min-p", help="Drop tokens below min-p x the top probability. Default: the "
        "engine's, else 0."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    repetition_penalty: float | None = typer.Option(
        None, "--repetition-penalty", help="Penalty > 1 discourages repeats; 1 is off. "
        "Default: the engine's, else 1."),
    stop: list[str] | None = typer.Option(None, "--stop",
                                          help="Stop at this string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos",
                                    help="Keep going past end-of-sequence tokens."),
    raw: bool = typer.Option(False, "--raw",
                             help="Send the prompt as plain text, without the chat template."),
    as_json: bool = typer.Option(False, "--json",
                                 help="Print one JSON object (text, token ids, timings)."),
    device: str | None = typer.Option(None, "--device",
                                      help="Device to run on (cuda, cuda:1, cpu); default "
                                      "cuda when available."),
    lookahead: str | None = typer.Option(
        None, "--lookahead",
        help="Lookahead window W,N,G for this request, within the engine's (see `kiln "
        "inspect`); 1,1,0 is plain decoding. Default: the engine's.",
    ),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help=ENFORCE_EAGER_HELP),
    no_async: bool = typer.Option(False, "--no-async-scheduling", help=NO_ASYNC_HELP),
    adaptive_spec: bool | None = typer.Option(
        None, "--adaptive-speculation/--always-speculate", help=ADAPTIVE_SPEC_HELP),
) -> None:
    """Generate a reply to PROMPT, streamed to the terminal as tokens arrive."""
    import dataclasses

    from kiln.artifact.speculative import parse_window, validate_request_window
    from kiln.cli.engine_source import check_engine_or_source, engine_dir_for
    from kiln.runtime.sampling_params import SamplingParams

    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
             "repetition_penalty": repetition_penalty}
    # Validate the flags before the (slow) engine build / load: a bad value is one line.
    params = SamplingParams(
        max_tokens=max_tokens, seed=seed, stop=tuple(stop or ()), ignore_eos=ignore_eos,
        lookahead=parse_window(lookahead, "--lookahead") if lookahead else None,
        **sampling_values(given, {}),
    )
    check_engine_or_source(engine_or_source)
    text = _read_prompt(prompt)
    engine_dir, _ = engine_dir_for(engine_or_source, device)
    if params.lookahead is not None:
        from kiln.artifact.loader import load_engine as read_engine

        spec = read_engine(engine_dir, verify_checksums=False).spec.speculative
        validate_request_window(spec, *params.lookahead, flag="--lookahead")
    engine, load_s = load_engine(engine_dir, device, enforce_eager, no_async, adaptive_spec)
    params = dataclasses.replace(params, **sampling_values(given, engine.generation_defaults))
    request: str | list[int] = text
    if not raw:
        if not getattr(engine.tokenizer, "chat_template", None):
            raise KilnError(f"engine {engine_dir} has no chat template; pass --raw to send "
                            "the prompt as plain text")
        request = engine.apply_chat_template([{"role": "user", "content": text}])

    out = None
    ttft = None
    t0 = time.perf_counter()
    stream = engine.stream(request, params)
    try:
        for out in stream:
            if ttft is None and out.token_ids:
                ttft = time.perf_counter() - t0
            if not as_json and out.new_text:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        if out is not None:
            engine.abort(out.request_id)
        raise
    except Exception as e:
        tp = getattr(engine, "tp", None)
        if tp is not None and tp.failed is not None:  # a rank died or hung: say which, briefly
            raise KilnError(str(e)) from e
        raise
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
        engine.close()  # a tensor-parallel engine's other ranks end here
    total = time.perf_counter() - t0
    if out is None:
        raise KilnError("the engine returned no output for the request")
    n = len(out.token_ids)
    tps = n / total if total > 0 else 0.0
    if as_json:
        result = {
            "text": out.text,
            "token_ids": list(out.token_ids),
            "prompt_tokens": len(out.prompt_token_ids),
            "finish_reason": out.finish_reason,
            "sampling": {k: getattr(params, k) for k in (*FALLBACK_SAMPLING, "seed")},
            "timings": {"ttft_s": ttft, "total_s": total, "tokens_per_s": tps,
                        "load_s": load_s},
            "speculative": {
                "mode": engine.speculative.mode,
                "steps": out.metrics.num_steps,
                "spec_steps": out.metrics.spec_steps,
                "spec_tokens": out.metrics.spec_tokens,
                "tokens_per_step": n / out.metrics.num_steps if out.metrics.num_steps else None,
            },
        }
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        return
    if not out.text.endswith("\n"):
        sys.stdout.write("\n")
        sys.stdout.flush()
    from rich.console import Console

    ttft_ms = f"{ttft * 1000:.0f} ms" if ttft is not None else "-"
    per_step = ""
    if out.metrics.spec_steps:
        per_step = f", {n / out.metrics.num_steps:.2f} tokens/step ({engine.speculative.mode})"
    Console(stderr=True).print(
        f"{n} tokens in {total:.2f} s, {tps:.1f} tokens/s, TTFT {ttft_ms}, "
        f"load {load_s:.1f} s, finish: {out.finish_reason}{per_step}",
        style="dim", highlight=False,
    )


def register(app: typer.Typer) -> None:
    """Add `generate` to the root app."""
    app.command("generate")(generate)
