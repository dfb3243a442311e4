"""`kiln bench throughput|latency ENGINE`: in-process benchmarks of a built engine.

Numbers go to stdout as rich tables; ``--json FILE`` also writes them (with the command
line, engine, device and versions) for pipelines. Progress bars go to stderr.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer

from kiln.cli.generate import (
    ADAPTIVE_SPEC_HELP,
    ENFORCE_EAGER_HELP,
    ENGINE_OR_SOURCE_HELP,
    NO_ASYNC_HELP,
)
from kiln.errors import KilnError

_ENGINE = typer.Argument(..., metavar="ENGINE_OR_SOURCE", help=ENGINE_OR_SOURCE_HELP)
_DEVICE_HELP = "Device to run on (cuda, cuda:1, cpu); default cuda when available."
_JSON_HELP = "Also write the results (with command line, device, versions) to this JSON file."
BASELINES = ("none", "hf")
_BASELINE_HELP = (
    "Also run the same workload through plain transformers in this run and print kiln / "
    "transformers (output tokens/s): none or hf. The transformers model is made from the "
    "engine's weights (FP8 dequantized to the engine dtype); the kiln engine is freed first."
)


@contextlib.contextmanager
def _progress(description: str, total: int) -> Iterator:
    """A rich progress bar on stderr; yields ``advance(n)``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as p:
        task = p.add_task(description, total=total)
        yield lambda n: p.advance(task, n)


def _check_baseline(name: str) -> str:
    """Fail before any loading when --baseline names nothing we can run."""
    if name not in BASELINES:
        raise KilnError(f"--baseline {name!r} is not a baseline; use one of: "
                        f"{', '.join(BASELINES)} (hf: the same workload through transformers)")
    return name


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """``--spec-batch-sizes 1,8`` -> (1, 8); anything but integers >= 1 is a BadParameter."""
    from kiln.bench.speculative import check_batch_sizes

    try:
        return check_batch_sizes([int(p) for p in text.split(",")])
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is not a list of batch sizes: give integers >= 1, comma separated "
            "(e.g. 1,8)") from None


def _check_batch_sizes(text: str) -> str:
    """--spec-batch-sizes checked while the command line is parsed (before any loading)."""
    parse_batch_sizes(text)
    return text


def _check_top_p(value: float) -> float:
    """--spec-top-p: a probability mass in (0, 1]."""
    if not 0 < value <= 1:
        raise typer.BadParameter(f"{value!r} is not a top-p: give a value in (0, 1] "
                                 "(e.g. 0.9; 1 keeps the whole distribution)")
    return value


def _load(source: str, device: str | None, enforce_eager: bool = False,
          no_async: bool = False, adaptive_spec: bool | None = None,
          check: Callable[[Path], None] | None = None) -> tuple[Any, dict, Path]:
    """Load the engine (a source is built into the cache first); returns (engine, start-up
    record, engine dir). ``check(engine_dir)`` runs before the engine loads. Imports and the
    build are not start-up time."""
    from kiln.cli.engine_source import engine_dir_for
    from kiln.cli.generate import load_engine

    engine_dir, _ = engine_dir_for(source, device)
    if check is not None:
        check(engine_dir)
    import kiln.runtime.engine

    t0 = time.perf_counter()
    engine, _ = load_engine(engine_dir, device, enforce_eager, no_async, adaptive_spec)
    startup = {"startup_s": time.perf_counter() - t0,
               "startup_times": getattr(engine, "startup_times", None)}
    return engine, startup, engine_dir


def _ranks_record(engine: Any) -> dict:
    """``tp`` (the engine's ranks) and ``memory_by_rank`` (each rank's peak memory after
    the run: kiln.runtime.memory), taken before any baseline frees the engine."""
    spec = getattr(engine, "spec", None)
    return {"tp": getattr(spec, "tp", 1), "memory_by_rank": engine.memory_by_rank()}


def _free_engine_and_build_hf(engine_dir: Path, device: Any) -> tuple[Any, dict]:
    """Build the transformers model on ``device`` once the caller dropped its engine."""
    from rich.console import Console

    from kiln.bench.hf_baseline import build_hf_model, free_cuda_memory

    free_cuda_memory()
    with Console(stderr=True).status("building the transformers baseline", spinner="dots"):
        return build_hf_model(str(engine_dir), device)


def _finish(result: dict, env: dict, json_file: Path | None, render) -> None:
    from rich.console import Console

    from kiln.bench.report import write_json

    result["environment"] = env
    render(result, Console())
    if json_file is not None:
        path = write_json(json_file, result)
        Console(stderr=True).print(f"wrote {path}", style="dim", highlight=False)


_WORKLOAD_HELP = (
    "Run TensorRT-LLM's published workload I/O (input/output tokens) by name (repeat the "
    "flag, or comma separate; 'all' runs every one): 128/128, 128/2048, 128/4096, 500/2000, "
    "1000/1000, 1000/2000, 2048/128, 2048/2048, 5000/500. Each runs TensorRT-LLM's request "
    "count (30000 for 128/128, 3000 or 1500 for the others) unless --num-prompts says "
    "otherwise, with random prompts of exactly I tokens and exactly O tokens generated (EOS "
    "ignored), all queued at once, and prints output tokens/s, mean TTFT and mean TPOT beside "
    "TensorRT-LLM's output tokens/s for Llama-3.1-8B FP8 on one H100 (one H200 when run on an "
    "H200). The ratio kiln / TensorRT-LLM is printed only for an engine of Llama-3-8B's shape "
    "at tp 1; the published number is printed for every engine. Each workload must fit the "
    "engine's max_seq_len ('all' needs 5500). --json writes one record per workload."
)


def throughput(
    engine_or_source: str = _ENGINE,
    num_prompts: int | None = typer.Option(
        None, "--num-prompts", min=1,
        help="Number of requests. Default: 64 random prompts; with --dataset every record of "
        "the file; with --workload TensorRT-LLM's count for each workload. With --workload it "
        "must be at least 4x the engine's max_batch_size (engine.json).",
    ),
    input_len: int | None = typer.Option(
        None, "--input-len", min=1,
        help="Prompt length in tokens (synthetic prompts). Default 128.",
    ),
    output_len: int | None = typer.Option(
        None, "--output-len", min=1,
        help="Tokens to generate per request (EOS ignored). Default 64; with --dataset the "
        "length of each record's reply.",
    ),
    dataset: Path | None = typer.Option(
        None, "--dataset", help="Prompt file (ShareGPT JSON or JSONL) instead of random tokens.",
    ),
    workload: list[str] | None = typer.Option(None, "--workload", metavar="I/O",
                                              help=_WORKLOAD_HELP),
    seed: int = typer.Option(0, "--seed", help="Seed for the synthetic prompts / sampling."),
    json_file: Path | None = typer.Option(None, "--json", help=_JSON_HELP),
    device: str | None = typer.Option(None, "--device", help=_DEVICE_HELP),
    baseline: str = typer.Option("none", "--baseline", help=_BASELINE_HELP),
    baseline_num_prompts: int | None = typer.Option(
        None, "--baseline-num-prompts", min=1,
        help="Run only the first N requests through the baseline (transformers is slow); "
        "the ratio is then of output tokens/s. Default: all.",
    ),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help=ENFORCE_EAGER_HELP),
    no_async: bool = typer.Option(False, "--no-async-scheduling", help=NO_ASYNC_HELP),
    adaptive_spec: bool | None = typer.Option(
        None, "--adaptive-speculation/--always-speculate", help=ADAPTIVE_SPEC_HELP),
) -> None:
    """Offline throughput: all requests queued at once, continuous batching to the end.

    Requests are random prompts of --input-len tokens, every record of a --dataset file, or
    TensorRT-LLM's published workloads by name (--workload 1000/1000, --workload all); the
    number of requests that ran is printed and written to --json.

    With --baseline hf the same requests (prompts, output lengths, EOS ignored) then run
    through transformers' continuous batching (generate_batch), greedy.
    """
    from kiln.bench.offline import _limit, run_throughput, synthetic_requests
    from kiln.bench.report import environment, render_throughput

    _check_baseline(baseline)
    if workload:
        _throughput_workloads(engine_or_source, workload, num_prompts, seed, json_file,
                              device, (enforce_eager, no_async, adaptive_spec),
                              conflicts={"--input-len": input_len, "--output-len": output_len,
                                         "--dataset": dataset,
                                         "--baseline": None if baseline == "none" else baseline,
                                         "--baseline-num-prompts": baseline_num_prompts})
        return
    engine, startup, engine_dir = _load(engine_or_source, device, enforce_eager, no_async,
                                        adaptive_spec)
    input_len = input_len or 128
    if dataset is not None:
        from kiln.bench.datasets import load_dataset

        prompt_file = load_dataset(
            dataset, engine.tokenizer, num_prompts, output_len=output_len, seed=seed,
            max_seq_len=_limit(engine, "max_seq_len"),
            max_input_len=_limit(engine, "max_input_len"),
        )
        requests = prompt_file.requests
    else:
        requests = synthetic_requests(engine, num_prompts or 64, input_len, output_len or 64,
                                      seed)
    total = sum(r.output_len for r in requests)
    with _progress("throughput", total) as advance:
        result = run_throughput(engine, len(requests), input_len, output_len or 64, seed,
                                requests=requests, progress=advance)
    result.update(_ranks_record(engine))
    if dataset is None:
        result["config"]["source"] = "synthetic"
        result["config"]["input_len"] = input_len
        result["config"]["output_len"] = output_len or 64
    else:
        # how many of the file's records ran: all usable ones unless --num-prompts
        result["config"].update(dataset=str(dataset), dataset_records=prompt_file.num_records,
                                dataset_skipped=prompt_file.num_skipped)
    result.update(startup)
    env = environment(engine, engine_dir)
    if baseline == "hf":
        from kiln.bench.hf_baseline import baseline_record, run_hf_throughput

        hf_requests = requests[:baseline_num_prompts] if baseline_num_prompts else requests
        where, batch = engine.device, engine.limits.max_batch_size
        del engine  # free the engine (its KV cache holds most of the GPU) before transformers
        model, info = _free_engine_and_build_hf(engine_dir, where)
        from rich.console import Console

        with Console(stderr=True).status(
                f"transformers throughput: {len(hf_requests)} requests", spinner="dots"):
            run = run_hf_throughput(model, hf_requests, fallback_batch_size=batch)
        result["baseline"] = baseline_record(
            run, info, result["output_tokens_per_s"], kiln_output_tokens=result["output_tokens"],
            kiln_num_requests=result["num_requests"],
            subset=len(hf_requests) < len(requests))
    _finish(result, env, json_file, render_throughput)


def _throughput_workloads(source: str, names: list[str], num_prompts: int | None, seed: int,
                          json_file: Path | None, device: str | None, runtime: tuple,
                          conflicts: dict[str, Any]) -> None:
    """`bench throughput --workload ...`: TensorRT-LLM's workloads, checked against the
    engine's limits before it loads."""
    from kiln.bench.report import environment, render_workloads
    from kiln.bench.workloads import check_engine, engine_limits, parse_workloads, run_workloads

    given = [flag for flag, value in conflicts.items() if value is not None]
    if given:
        raise KilnError(f"--workload runs TensorRT-LLM's fixed random-prompt workloads, so "
                        f"{', '.join(given)} cannot go with it; drop {', '.join(given)}, or "
                        "drop --workload to run your own prompts and lengths")
    workloads = parse_workloads(names)
    engine, startup, engine_dir = _load(
        source, device, *runtime,
        check=lambda d: check_engine(workloads, num_prompts, engine_limits(d)))
    env = environment(engine, engine_dir)
    result = run_workloads(engine, workloads, num_prompts, seed,
                           device_name=env["device_name"], progress=_progress)
    result.update(_ranks_record(engine))
    result.update(startup)
    _finish(result, env, json_file, render_workloads)


def latency(
    engine_or_source: str = _ENGINE,
    batch_size: int = typer.Option(1, "--batch-size", min=1, help="Requests per batch."),
    input_len: int = typer.Option(32, "--input-len", min=1, help="Prompt length in tokens."),
    output_len: int = typer.Option(128, "--output-len", min=1,
                                   help="Tokens to generate per request (EOS ignored)."),
    num_iters: int = typer.Option(3, "--num-iters", min=1, help="Timed iterations."),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Untimed warm-up iterations."),
    seed: int = typer.Option(0, "--seed", help="Seed for the synthetic prompts."),
    json_file: Path | None = typer.Option(None, "--json", help=_JSON_HELP),
    device: str | None = typer.Option(None, "--device", help=_DEVICE_HELP),
    spec_prompts: int = typer.Option(
        3, "--spec-prompts", min=1,
        help="Speculative engines: bundled prompts per set (grounded, code, chat, agentic) "
        "that run "
        "alone at batch 1 in the plain vs speculative comparison (--output-len tokens, "
        "greedy unless --spec-temperature).",
    ),
    lookahead: str | None = typer.Option(
        None, "--lookahead",
        help="Speculative engines: request window W,N,G for the comparison (default: the "
        "engine's).",
    ),
    spec_repeats: int = typer.Option(
        3, "--spec-repeats", min=1,
        help="Speculative engines: plain and speculative runs per batch, alternated; the "
        "comparison uses each one's median time and prints the spread of the ratio.",
    ),
    spec_batch_sizes: str = typer.Option(
        "1,8", "--spec-batch-sizes", callback=_check_batch_sizes,
        help="Speculative engines: batch sizes of the comparison, comma separated; at 1 each "
        "prompt runs alone, at B the set's first B prompts run together.",
    ),
    spec_temperature: float = typer.Option(
        0.0, "--spec-temperature", min=0.0,
        help="Speculative engines: sampling temperature of both runs of the comparison (0, "
        "the default: greedy, and the outputs must match; above 0 the runs draw different "
        "texts and tokens/s compares).",
    ),
    spec_top_p: float = typer.Option(
        1.0, "--spec-top-p", callback=_check_top_p,
        help="Speculative engines, with --spec-temperature above 0: top-p of both runs of "
        "the comparison (1, the default: off).",
    ),
    baseline: str = typer.Option("none", "--baseline", help=_BASELINE_HELP),
    hf_compile: bool | None = typer.Option(
        None, "--hf-compile/--no-hf-compile",
        help="--baseline hf: compile transformers' decode step (torch.compile, mode "
        "reduce-overhead, static cache). Default: on CUDA yes, on CPU no.",
    ),
    enforce_eager: bool = typer.Option(False, "--enforce-eager", help=ENFORCE_EAGER_HELP),
    no_async: bool = typer.Option(False, "--no-async-scheduling", help=NO_ASYNC_HELP),
    adaptive_spec: bool | None = typer.Option(
        None, "--adaptive-speculation/--always-speculate", help=ADAPTIVE_SPEC_HELP),
) -> None:
    """Latency of one batch: E2E, TTFT and TPOT (mean/median/p90/p99) over iterations.

    On an engine built with speculative decoding it also runs plain vs speculative decoding
    on bundled input-grounded, code, chat and agentic prompts at each --spec-batch-sizes (same
    engine, same run) and prints the speed-up, tokens per step and the cost of a speculative
    engine step over a plain one (and, with CUDA graphs, of its graph replay).

    With --baseline hf the same batches (same prompts, same lengths) then run through
    transformers' generate with a static cache and a compiled decode step.
    """
    from kiln.artifact.speculative import parse_window
    from kiln.bench.offline import latency_batches, run_latency
    from kiln.bench.report import environment, render_latency
    from kiln.bench.speculative import num_runs, run_speculative_latency

    _check_baseline(baseline)
    window = parse_window(lookahead, "--lookahead") if lookahead else None
    engine, startup, engine_dir = _load(engine_or_source, device, enforce_eager, no_async,
                                        adaptive_spec)
    with _progress("latency", num_iters) as advance:
        result = run_latency(engine, batch_size, input_len, output_len, num_iters, warmup,
                             seed=seed, progress=advance)
    if engine.speculative.mode != "none":
        sizes = parse_batch_sizes(spec_batch_sizes)
        with _progress("plain vs speculative",
                       num_runs(engine, spec_prompts, sizes)) as advance:
            result["speculative"] = run_speculative_latency(
                engine, output_len, spec_prompts, window, progress=advance,
                repeats=spec_repeats, batch_sizes=sizes, temperature=spec_temperature,
                top_p=spec_top_p)
    if getattr(engine, "tp", None) is not None:  # what the ranks' collectives cost a step
        from kiln.bench.collectives import profile_collectives

        result["collectives"] = profile_collectives(engine, batch_size, input_len, seed=seed)
    result.update(startup)
    result.update(_ranks_record(engine))
    env = environment(engine, engine_dir)
    if baseline == "hf":
        from kiln.bench.hf_baseline import baseline_record, run_hf_latency

        warm, timed = latency_batches(engine, batch_size, input_len, output_len, num_iters,
                                      warmup, seed)
        where = engine.device
        del engine  # free the engine (its KV cache holds most of the GPU) before transformers
        model, info = _free_engine_and_build_hf(engine_dir, where)
        compile_ = where.type == "cuda" if hf_compile is None else hf_compile
        with _progress("transformers latency", num_iters) as advance:
            run = run_hf_latency(
                model, [[r.prompt_token_ids for r in b] for b in warm],
                [[r.prompt_token_ids for r in b] for b in timed], output_len,
                compile_=compile_, progress=advance)
        kiln_iters = result["iterations"]
        result["baseline"] = baseline_record(
            run, info, result["output_tokens_per_s"],
            kiln_output_tokens=sum(it["output_tokens"] for it in kiln_iters),
            compile_requested=compile_)
    _finish(result, env, json_file, render_latency)


def _load_tokenizer(path: Path):
    """A transformers tokenizer from an engine directory or a tokenizer directory."""
    from transformers import AutoTokenizer

    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {path} does not exist; pass an engine "
                                "directory or a Hugging Face tokenizer directory")
    sub = path / "tokenizer"
    return AutoTokenizer.from_pretrained(str(sub if sub.is_dir() else path))


def serve(
    base_url: str = typer.Option("http://127.0.0.1:8000", "--base-url",
                                 help="Server root URL (kiln, vLLM, any OpenAI-compatible)."),
    tokenizer: Path = typer.Option(
        ..., "--tokenizer",
        help="Engine directory (or tokenizer directory) of the served model; makes the prompts.",
    ),
    model: str | None = typer.Option(None, "--model",
                                     help="Model name to send; default: first of /v1/models."),
    endpoint: str = typer.Option("/v1/completions", "--endpoint",
                                 help="/v1/completions or /v1/chat/completions."),
    num_prompts: int = typer.Option(64, "--num-prompts", min=1, help="Number of requests."),
    input_len: int = typer.Option(128, "--input-len", min=1,
                                  help="Prompt length in tokens (synthetic prompts)."),
    output_len: int | None = typer.Option(
        None, "--output-len", min=1,
        help="max_tokens per request. Default 64; with --dataset each record's reply length.",
    ),
    dataset: Path | None = typer.Option(
        None, "--dataset", help="Prompt file (ShareGPT JSON or JSONL) instead of random tokens.",
    ),
    request_rate: float = typer.Option(
        float("inf"), "--request-rate",
        help="Requests per second (Poisson arrivals); inf sends them all at once.",
    ),
    max_concurrency: int = typer.Option(0, "--max-concurrency", min=0,
                                        help="Most requests in flight; 0 is unlimited."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0,
                                      help="Sampling temperature sent with every request."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos",
                                    help="Ask the server to generate exactly max_tokens."),
    api_key: str | None = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY",
                                       help="Bearer token for the server."),
    seed: int = typer.Option(0, "--seed", help="Seed for prompts and arrival times."),
    timeout: float = typer.Option(600.0, "--timeout", min=1.0, help="Per-request timeout (s)."),
    json_file: Path | None = typer.Option(None, "--json", help=_JSON_HELP),
) -> None:
    """Benchmark a running OpenAI-compatible server: TTFT, TPOT, ITL, E2E, throughput."""
    from rich.console import Console

    from kiln.bench.online import ServePrompt, run_serve, synthetic_prompts
    from kiln.bench.report import environment, render_serve, write_json

    tok = _load_tokenizer(tokenizer)
    if dataset is not None:
        from kiln.bench.datasets import load_requests

        reqs = load_requests(dataset, tok, num_prompts, output_len=output_len, seed=seed)
        prompts = [ServePrompt(tok.decode(r.prompt_token_ids), r.output_len,
                               len(r.prompt_token_ids)) for r in reqs]
    else:
        prompts = synthetic_prompts(tok, num_prompts, input_len, output_len or 64, seed)
    with _progress("requests", len(prompts)) as advance:
        result = run_serve(base_url, prompts, model=model, endpoint=endpoint,
                           request_rate=request_rate, max_concurrency=max_concurrency,
                           api_key=api_key, temperature=temperature, ignore_eos=ignore_eos,
                           seed=seed, timeout_s=timeout, progress=advance)
    if dataset is not None:
        result["config"]["dataset"] = str(dataset)
    else:
        result["config"].update(input_len=input_len, output_len=output_len or 64)
    result["environment"] = environment(None, None)
    render_serve(result, Console())
    if json_file is not None:
        path = write_json(json_file, result)
        Console(stderr=True).print(f"wrote {path}", style="dim", highlight=False)
    if result["completed"] == 0:
        raise ValueError(f"all {result['failed']} requests failed; first error: "
                         f"{result['errors'][0]}")


def register(bench: typer.Typer) -> None:
    """Add the bench commands to the `bench` sub-app."""
    bench.command("throughput")(throughput)
    bench.command("latency")(latency)
    bench.command("serve")(serve)
