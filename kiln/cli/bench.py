"""`kiln bench throughput|latency ENGINE`: in-process benchmarks of a built engine.

Numbers go to stdout as rich tables; ``--json FILE`` also writes them (with the command
line, engine, device and versions) for pipelines. Progress bars go to stderr.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import typer

_ENGINE = typer.Argument(..., metavar="ENGINE", help="Engine directory written by `kiln build`.")
_DEVICE_HELP = "Device to run on (cuda, cuda:1, cpu); default cuda when available."
_JSON_HELP = "Also write the results (with command line, device, versions) to this JSON file."


@contextlib.contextmanager
def _progress(description: str, total: int) -> Iterator:
    """A rich progress bar on stderr; yields ``advance(n)``."""
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as p:
        task = p.add_task(description, total=total)
        yield lambda n: p.advance(task, n)


def _finish(result: dict, engine, engine_dir: Path, json_file: Path | None, render) -> None:
    from rich.console import Console

    from kiln.bench.report import environment, write_json

    result["environment"] = environment(engine, engine_dir)
    render(result, Console())
    if json_file is not None:
        path = write_json(json_file, result)
        Console(stderr=True).print(f"wrote {path}", style="dim", highlight=False)


def throughput(
    engine_dir: Path = _ENGINE,
    num_prompts: int = typer.Option(64, "--num-prompts", min=1, help="Number of requests."),
    input_len: int = typer.Option(128, "--input-len", min=1,
                                  help="Prompt length in tokens (synthetic prompts)."),
    output_len: int | None = typer.Option(
        None, "--output-len", min=1,
        help="Tokens to generate per request (EOS ignored). Default 64; with --dataset the "
        "length of each record's reply.",
    ),
    dataset: Path | None = typer.Option(
        None, "--dataset", help="Prompt file (ShareGPT JSON or JSONL) instead of random tokens.",
    ),
    seed: int = typer.Option(0, "--seed", help="Seed for the synthetic prompts / sampling."),
    json_file: Path | None = typer.Option(None, "--json", help=_JSON_HELP),
    device: str | None = typer.Option(None, "--device", help=_DEVICE_HELP),
) -> None:
    """Offline throughput: all requests queued at once, continuous batching to the end."""
    from kiln.bench.offline import _limit, run_throughput, synthetic_requests
    from kiln.bench.report import render_throughput
    from kiln.cli.generate import check_engine_dir, load_engine

    check_engine_dir(engine_dir)
    engine, _ = load_engine(engine_dir, device)
    if dataset is not None:
        from kiln.bench.datasets import load_requests

        requests = load_requests(
            dataset, engine.tokenizer, num_prompts, output_len=output_len, seed=seed,
            max_seq_len=_limit(engine, "max_seq_len"),
            max_input_len=_limit(engine, "max_input_len"),
        )
    else:
        requests = synthetic_requests(engine, num_prompts, input_len, output_len or 64, seed)
    total = sum(r.output_len for r in requests)
    with _progress("throughput", total) as advance:
        result = run_throughput(engine, len(requests), input_len, output_len or 64, seed,
                                requests=requests, progress=advance)
    if dataset is None:
        result["config"]["source"] = "synthetic"
        result["config"]["input_len"] = input_len
        result["config"]["output_len"] = output_len or 64
    else:
        result["config"]["dataset"] = str(dataset)
    _finish(result, engine, engine_dir, json_file, render_throughput)


def latency(
    engine_dir: Path = _ENGINE,
    batch_size: int = typer.Option(1, "--batch-size", min=1, help="Requests per batch."),
    input_len: int = typer.Option(32, "--input-len", min=1, help="Prompt length in tokens."),
    output_len: int = typer.Option(128, "--output-len", min=1,
                                   help="Tokens to generate per request (EOS ignored)."),
    num_iters: int = typer.Option(3, "--num-iters", min=1, help="Timed iterations."),
    warmup: int = typer.Option(1, "--warmup", min=0, help="Untimed warm-up iterations."),
    seed: int = typer.Option(0, "--seed", help="Seed for the synthetic prompts."),
    json_file: Path | None = typer.Option(None, "--json", help=_JSON_HELP),
    device: str | None = typer.Option(None, "--device", help=_DEVICE_HELP),
) -> None:
    """Latency of one batch: E2E, TTFT and TPOT (mean/median/p90/p99) over iterations."""
    from kiln.bench.offline import run_latency
    from kiln.bench.report import render_latency
    from kiln.cli.generate import check_engine_dir, load_engine

    check_engine_dir(engine_dir)
    engine, _ = load_engine(engine_dir, device)
    with _progress("latency", num_iters) as advance:
        result = run_latency(engine, batch_size, input_len, output_len, num_iters, warmup,
                             seed=seed, progress=advance)
    _finish(result, engine, engine_dir, json_file, render_latency)


def register(bench: typer.Typer) -> None:
    """Add the bench commands to the `bench` sub-app."""
    bench.command("throughput")(throughput)
    bench.command("latency")(latency)
