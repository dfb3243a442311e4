"""Benchmark reports: rich tables for people, a JSON file for pipelines."""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kiln import __version__


def environment(engine: Any = None, engine_dir: str | Path | None = None) -> dict:
    """Where and how a benchmark ran: command line, engine, device, versions, date (UTC)."""
    import torch

    device = str(getattr(engine, "device", "") or "")
    device_name = _cpu_name()
    if device.startswith("cuda") and torch.cuda.is_available():
        try:
            device_name = torch.cuda.get_device_name(torch.device(device))
        except (RuntimeError, AssertionError, ValueError):
            device_name = torch.cuda.get_device_name()
    spec = getattr(engine, "spec", None)
    model = getattr(spec, "model", None)
    return {
        "command": " ".join(["kiln", *sys.argv[1:]]),
        "engine_dir": str(Path(engine_dir).resolve()) if engine_dir else None,
        "model": _model_name(spec, model),
        "dtype": str(getattr(spec, "dtype", "")) or None,
        "device": device or None,
        "device_name": device_name,
        "torch_version": torch.__version__,
        "kiln_version": __version__,
        "python_version": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        # how the engine ran: attention kernels, CUDA graphs, async scheduling
        "attention_backend": getattr(engine, "attention_backend", None),
        "cuda_graphs": getattr(getattr(engine, "runner", None), "graphs", None) is not None
        if engine is not None else None,
        "async_scheduling": getattr(engine, "async_scheduling", None),
        # speculative engines: greedy requests' speculative state, drafting and verification
        # on the device (KILN_DEVICE_SPECULATION; the default for prompt lookup on CUDA)
        "device_speculation": getattr(getattr(engine, "runner", None), "spec_step", None)
        is not None if engine is not None else None,
        # programmatic dependent launch of the Triton kernels (KILN_PDL 0/1/2; None off CUDA)
        "pdl": _pdl_mode(device),
        # tokens chosen by kiln's sampling kernels (CUDA; rows without top-k/top-p/min-p)
        "sampling_kernels": _sampling_kernels(device),
        # speculative engines: tokens per speculative step a request must commit to
        # speculate, by batch size (None: always speculates)
        "spec_break_even": _break_even(engine),
    }


def _break_even(engine: Any) -> dict[str, float] | None:
    be = getattr(engine, "spec_break_even", None)
    return None if be is None else be.to_json()


def _pdl_mode(device: str) -> int | None:
    """The KILN_PDL mode CUDA kernels launch with (0 where the GPU or triton lacks PDL)."""
    if not device.startswith("cuda"):
        return None
    try:
        from kiln.runtime.kernels import _pdl
    except ImportError:  # no triton: the torch path, no kiln kernels
        return None
    return _pdl.mode()


def _sampling_kernels(device: str) -> bool:
    """Whether ``Sampler.choose`` picks tokens with kiln's Triton kernels on ``device``."""
    if not device.startswith("cuda"):
        return False
    from kiln.runtime.layers import sampler

    return sampler.kernels_enabled()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _model_name(spec: Any, model: Any) -> str | None:
    prov = getattr(spec, "provenance", None) or {}
    for key in ("source", "name", "model"):
        if isinstance(prov.get(key), str):
            return prov[key]
    return getattr(model, "architecture", None)


def _clean(obj: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str | Path, result: dict) -> Path:
    """Write ``result`` as indented JSON (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(result), indent=2) + "\n")
    return path


def _ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 1000:.2f}"


def _summary_table(title: str, rows: list[tuple[str, dict]]) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("metric (ms)")
    for col in ("mean", "median", "p90", "p99"):
        t.add_column(col, justify="right")
    for name, s in rows:
        t.add_row(name, *(_ms(s.get(col)) for col in ("mean", "median", "p90", "p99")))
    return t


def _header(result: dict) -> Table:
    env = result.get("environment") or {}
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    for key in ("engine_dir", "device_name", "torch_version"):
        if env.get(key):
            t.add_row(key.replace("_", " "), str(env[key]))
    for key, value in (result.get("config") or {}).items():
        if value is not None:
            t.add_row(key.replace("_", " "), str(value))
    return t


def render_throughput(result: dict, console: Console | None = None) -> None:
    """Print a throughput result as tables."""
    console = console or Console()
    console.print(_header(result))
    t = Table(title="Offline throughput", title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    records = (result.get("config") or {}).get("dataset_records")
    t.add_row("requests", str(result["num_requests"])
              + ("" if records is None else f" (of {records} records)"))
    t.add_row("prompt tokens", str(result["prompt_tokens"]))
    t.add_row("output tokens", str(result["output_tokens"]))
    t.add_row("elapsed (s)", f"{result['elapsed_s']:.3f}")
    t.add_row("requests/s", f"{result['requests_per_s']:.2f}")
    t.add_row("output tokens/s", f"{result['output_tokens_per_s']:.1f}")
    t.add_row("total tokens/s", f"{result['total_tokens_per_s']:.1f}")
    if result.get("num_steps"):  # where a run's time goes: steps x the mean step
        t.add_row("engine steps", str(result["num_steps"]))
        t.add_row("mean step (ms)", f"{1000 * result['elapsed_s'] / result['num_steps']:.2f}")
    if "num_preemptions" in result:  # KV blocks ran out: requests recomputed from the start
        t.add_row("preemptions", str(result["num_preemptions"]))
    console.print(t)
    console.print(_summary_table("Per request (all queued at once)",
                                 [("TTFT", result["ttft_s"]), ("TPOT", result["tpot_s"])]))
    render_memory(result, console)
    render_startup(result, console)
    if result.get("baseline"):
        render_baseline(result["baseline"], console)


def render_workloads(result: dict, console: Console | None = None) -> None:
    """Print TensorRT-LLM's workloads as run by kiln: one row per workload, with the request
    count that ran and TensorRT-LLM's published output tokens/s beside kiln's."""
    console = console or Console()
    console.print(_header(result))
    ref = result["reference"]
    t = Table(title="TensorRT-LLM workloads (random prompts, EOS ignored, all queued at once)",
              title_justify="left")
    cols = ["I/O", "requests", "output\ntok/s", "mean TTFT\nms", "mean TPOT\nms",
            f"TRT-LLM\n{ref['card']} tok/s", "kiln /\nTRT-LLM"]
    for col in cols:
        t.add_column(col, justify="left" if col == "I/O" else "right")
    scaled = []
    for w in result["workloads"]:
        if w["num_requests"] != w["published_num_requests"]:
            scaled.append(f"{w['workload']} {w['published_num_requests']}")
        t.add_row(w["workload"], str(w["num_requests"]), f"{w['output_tokens_per_s']:.1f}",
                  _ms(w["ttft_s"]["mean"]), _ms(w["tpot_s"]["mean"]),
                  f"{w['trtllm_output_tokens_per_s'][ref['card']]:,.0f}",
                  "-" if w["ratio"] is None else f"{w['ratio']:.2f}x")
    console.print(t)
    notes = [f"TRT-LLM: {ref['model']}, one {ref['card']}, {ref['tool']} (perf-overview.md)"]
    if scaled:
        notes.append(f"requests: --num-prompts in place of TensorRT-LLM's counts "
                     f"({', '.join(scaled)})")
    if not ref["ratio_shown"]:
        notes.append("no ratio: this engine is not Llama-3-8B's shape at tp 1")
    for note in notes:
        console.print(f"  {note}", style="dim", highlight=False)
    render_memory(result, console)
    render_startup(result, console)


def render_latency(result: dict, console: Console | None = None) -> None:
    """Print a latency result as tables."""
    console = console or Console()
    console.print(_header(result))
    console.print(_summary_table(
        "Latency",
        [("batch E2E", result["latency_s"]), ("request E2E", result["e2e_s"]),
         ("TTFT", result["ttft_s"]), ("TPOT", result["tpot_s"])],
    ))
    console.print(f"output tokens/s: {result['output_tokens_per_s']:.1f}")
    if result.get("speculative"):
        render_speculative(result["speculative"], console)
    render_collectives(result, console)
    render_memory(result, console)
    render_startup(result, console)
    if result.get("baseline"):
        render_baseline(result["baseline"], console)


def render_collectives(result: dict, console: Console) -> None:
    """A tensor-parallel engine's collectives per decode step (kiln.bench.collectives)."""
    c = result.get("collectives")
    if not c:
        return
    parts = [f"{kind.replace('_', '-')} {c[f'{kind}_ms_per_step']:.3f} ms "
             f"({c[f'{kind}_calls_per_step']:g} calls)"
             for kind in ("all_reduce", "gather", "broadcast")]
    tpot = (result.get("tpot_s") or {}).get("median")
    of = f"; TPOT median {tpot * 1e3:.3f} ms" if tpot else ""
    console.print(f"collectives per decode step, batch {c['batch_size']}, {c['source']}: "
                  f"{', '.join(parts)}{of}", highlight=False)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def render_memory(result: dict, console: Console) -> None:
    """The engine's ranks and each one's peak memory (``memory_by_rank``), when recorded."""
    ranks = result.get("memory_by_rank")
    if not ranks:
        return
    t = Table(title=f"Peak memory by rank (tp {result.get('tp', len(ranks))})",
              title_justify="left")
    for col in ("rank", "device", "peak RSS (MiB)", "device peak (MiB)"):
        t.add_column(col, justify="left" if col == "device" else "right")
    for rank, m in enumerate(ranks):
        t.add_row(str(rank), m["device"], _mib(m["peak_rss_bytes"]),
                  _mib(m["device_peak_bytes"]))
    console.print(t)


def render_startup(result: dict, console: Console) -> None:
    """One line: the engine's start-up wall time and the engine's own breakdown."""
    if result.get("startup_s") is None:
        return
    parts = [f"{k.removesuffix('_s').replace('_', ' ')} {v:.2f}"
             for k, v in (result.get("startup_times") or {}).items()
             if isinstance(v, (int, float)) and k != "total_s"]
    detail = f" ({', '.join(parts)})" if parts else ""
    console.print(f"engine start-up: {result['startup_s']:.2f} s{detail}", highlight=False)


def render_baseline(b: dict, console: Console) -> None:
    """kiln vs transformers on the same workload: both tokens/s and the ratio."""
    t = Table(title=f"kiln vs transformers {b['version']} (same workload, same run)",
              title_justify="left")
    t.add_column("")
    t.add_column("output tokens/s", justify="right")
    t.add_column("how", justify="left", overflow="fold")
    t.add_row("kiln", f"{b['kiln_tokens_per_s']:.1f}", "engine")
    t.add_row("transformers", f"{b['tokens_per_s']:.1f}", b["mode"])
    ratio = b.get("ratio")
    t.add_row("kiln / transformers", "-" if ratio is None else f"{ratio:.2f}x", "")
    console.print(t)
    notes = [b.get("weights", "")]
    done, total = b.get("num_requests"), b.get("kiln_num_requests")
    if b.get("subset"):
        notes.append(f"transformers ran {done} of {total} requests; the ratio is of "
                     "output tokens/s")
    notes += [f"fallback: {f}" for f in b.get("fallbacks") or []]
    for note in filter(None, notes):
        console.print(f"  {note}", style="dim", highlight=False)


def _sampling(cfg: dict) -> str:
    """How both runs of a speculative comparison chose tokens, for its title."""
    if cfg.get("greedy", True):
        return "greedy"
    top_p = cfg.get("top_p", 1.0)
    return f"temperature {cfg['temperature']:g}" + (f", top_p {top_p:g}" if top_p < 1 else "")


def render_speculative(result: dict, console: Console) -> None:
    """Plain vs speculative decoding: one row per prompt set and batch size, then the graph
    replay ratios (GPU time alone) when they were measured."""
    cfg = result["config"]
    window = cfg["request_window"] or cfg["engine_window"]
    title = (f"Plain vs {cfg['mode']}"
             + (f" {tuple(window)}" if window else f" (max draft {cfg['max_draft_len']})")
             + f", {_sampling(cfg)}, {cfg['output_len']} tokens")
    t = Table(title=title, title_justify="left")
    repeats = cfg.get("repeats", 1)
    if repeats > 1:
        t.title += f"; median of {repeats} alternating runs, range of the speed-up"
    # two-line headers keep the table within ~100 columns
    cols = ["prompts", "batch", "plain\ntok/s", "spec\ntok/s", "speed-up"]
    cols += ["range"] if repeats > 1 else []
    cols += ["tokens\n/step", "step\ncost", "spec\nsteps", "same\noutput"]
    for col in cols:
        t.add_column(col, justify="left" if col == "prompts" else "right")
    for name, s in result["sets"].items():
        # results written before batch sizes existed hold batch 1 at the set's top level
        for batch, b in (s.get("batches") or {"1": s}).items():
            t.add_row(name, batch, *_speculative_cells(b, repeats, cfg.get("dtype")))
    console.print(t)
    if cfg["mode"] == "suffix":
        shares = [f"{name} {_fmt(b.get('cache_share'), '{:.0%}')} (batch {batch})"
                  for name, s in result["sets"].items()
                  for batch, b in (s.get("batches") or {"1": s}).items()]
        console.print(f"  accepted draft tokens from the cache of earlier responses: "
                      f"{', '.join(shares)}", style="dim", highlight=False)
    console.print("  step cost: wall time per engine step (host work included), speculative "
                  "run over plain run;\n  spec steps: speculative steps per request over the "
                  "speculative run's engine steps", style="dim", highlight=False)
    if cfg.get("skipped_batch_sizes"):
        skipped = cfg["skipped_batch_sizes"]
        console.print(f"  skipped batch {', '.join(map(str, skipped))}: over the engine's "
                      f"{cfg['max_num_seqs']} sequences per step (rebuild with "
                      f"--max-batch-size {max(skipped)})", style="dim", highlight=False)
    replay = result.get("replay")
    if replay:
        parts = [f"batch {b} {r['ratio']:.2f}x ({r['decode_ms']:.3f} -> {r['spec_ms']:.3f} ms"
                 + (f", the draft's {r['draft_ms']:.3f} ms a token" if "draft_ms" in r else "")
                 + ")" for b, r in replay.items()]
        console.print(f"graph replay, speculative over decode step: {'; '.join(parts)}",
                      highlight=False)


def _fmt(v: float | None, spec: str = "{:.1f}") -> str:
    return "-" if v is None else spec.format(v)


def _speculative_cells(s: dict, repeats: int, dtype: str | None) -> list[str]:
    """The cells of one (prompt set, batch size) row of ``render_speculative``."""
    row = [_fmt(s["plain_tokens_per_s"]), _fmt(s["spec_tokens_per_s"]),
           _fmt(s["speedup"], "{:.2f}x")]
    if repeats > 1:
        ups = [u for u in s.get("speedups") or [] if u is not None]
        row.append(f"{min(ups):.2f}-{max(ups):.2f}x" if ups else "-")
    # greedy output is equal in float32; in bf16/fp16 the speculative step's GEMMs round
    # differently from the decode GEMV and may pick the other token at a near-tie
    same = ("n/a (sampled)" if s["same_output"] is None else "yes" if s["same_output"] else
            f"differs ({dtype} rounding)" if dtype and dtype != "float32" else "NO")
    return row + [_fmt(s["tokens_per_step"], "{:.2f}"), _fmt(s.get("step_cost_ratio"), "{:.2f}x"),
                  _fmt(s.get("spec_step_fraction"), "{:.0%}"), same]


def render_serve(result: dict, console: Console | None = None) -> None:
    """Print a `bench serve` result as tables."""
    console = console or Console()
    console.print(_header(result))
    t = Table(title="Serving benchmark", title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("completed / failed", f"{result['completed']} / {result['failed']}")
    t.add_row("duration (s)", f"{result['duration_s']:.3f}")
    t.add_row("prompt tokens", str(result["prompt_tokens"]))
    t.add_row("output tokens", str(result["output_tokens"]))
    t.add_row("requests/s", f"{result['requests_per_s']:.2f}")
    t.add_row("output tokens/s", f"{result['output_tokens_per_s']:.1f}")
    t.add_row("total tokens/s", f"{result['total_tokens_per_s']:.1f}")
    if result.get("tokens_per_chunk") is not None:
        t.add_row("tokens per streamed chunk", f"{result['tokens_per_chunk']:.2f}")
    console.print(t)
    console.print(_summary_table(
        "Per request",
        [("TTFT", result["ttft_s"]), ("TPOT", result["tpot_s"]), ("ITL", result["itl_s"]),
         ("E2E", result["e2e_s"])],
    ))
    for err in result.get("errors") or []:
        console.print(f"[red]failed:[/red] {err}", highlight=False)
