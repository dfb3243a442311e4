"""`kiln inspect ENGINE`: show what an engine was built from and for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer


def _fmt(value: Any) -> str:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value) if value else "-"
    return "-" if value is None else str(value)


def _table(title: str, rows: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_header=False, min_width=40)
    table.add_column(style="bold cyan")
    table.add_column(overflow="fold")
    for key, value in rows.items():
        table.add_row(key, _fmt(value))
    return table


def inspect(
    engine: Path = typer.Argument(
        ..., metavar="ENGINE", help="Engine directory from `kiln build`."
    ),
    as_json: bool = typer.Option(
        False, "--json",
        help="Print engine.json on stdout (a draft-model engine's with its draft engine's "
        "engine.json under \"draft\").",
    ),
    verify: bool = typer.Option(
        False, "--verify", help="Also check the weight files' sha256 checksums."
    ),
) -> None:
    """Show an engine's model, dtype, limits, quantization, speculative settings, tool-call
    parser and source."""
    from rich.console import Console

    from kiln.artifact.loader import load_engine

    artifact = load_engine(engine, verify_checksums=verify)
    spec = artifact.spec
    if as_json:
        out = spec.to_dict()
        if artifact.draft is not None:
            out["draft"] = artifact.draft.spec.to_dict()
        typer.echo(json.dumps(out, indent=2))
        return
    console = Console()
    model = spec.model.to_dict()
    model["parameters"] = f"{spec.model.num_params:,}"
    console.print(_table(f"Engine {artifact.path}", {
        "format version": spec.format_version,
        "kiln version": spec.kiln_version,
        "dtype": spec.dtype,
    }))
    console.print(_table("Model", model))
    console.print(_table("Limits", spec.limits.to_dict()))
    console.print(_table("Quantization", spec.quantization.to_dict()))
    console.print(_table("Speculative decoding", {
        **spec.speculative.to_dict(), "tokens_per_step": spec.speculative.tokens_per_step}))
    if artifact.draft is not None:
        console.print(_table("Draft engine", _draft_rows(artifact)))
    console.print(_table("Generation defaults", _generation_rows(spec.generation_defaults)))
    console.print(_table("Tool calling", _tools_rows(spec.tools)))
    console.print(_table("Tensor parallelism", _parallel_rows(spec)))
    console.print(_table("Provenance", spec.provenance))
    weights: dict[str, Any] = {"format": spec.weights.get("format")}
    if spec.is_random:
        weights.update(seed=spec.weights["seed"], std=spec.weights["std"])
    for name, info in spec.weights.get("files", {}).items():
        weights[name] = f"{info['size']:,} bytes, sha256 {info['sha256']}"
    console.print(_table("Weights", weights))
    console.print(_table("Kernel configs", _kernel_rows(spec.kernel_configs)))
    console.print(_table("Attention", _attention_rows(spec.attention)))
    console.print(_table("Compiled kernels", _compiled_rows(artifact.path)))


def _draft_rows(artifact: Any) -> dict[str, Any]:
    """A draft-model engine's draft: where, which checksum, what model."""
    draft, sp = artifact.draft, artifact.spec.speculative
    m = draft.spec.model
    weights = draft.spec.weights
    fmt = weights.get("format")
    if fmt == "safetensors":
        size = sum(info.get("size", 0) for info in weights.get("files", {}).values())
        fmt = f"safetensors ({size:,} bytes)"
    elif fmt == "random":
        fmt = f"random (seed {weights.get('seed')})"
    return {
        "directory": draft.path,
        "engine.json sha256": sp.draft_sha256,
        "source": sp.draft_model,
        "k (max_draft_len)": sp.max_draft_len,
        "architecture": m.architecture,
        "layers": m.num_layers,
        "hidden size": m.hidden_size,
        "vocab size": m.vocab_size,
        "parameters": f"{m.num_params:,}",
        "dtype": draft.spec.dtype,
        "weights": fmt,
    }


def _generation_rows(defaults: Any) -> dict[str, Any]:
    """The sampling values requests get for fields they omit, where from, what was dropped."""
    rows: dict[str, Any] = dict(defaults.values) or {"values": "none (kiln's own defaults)"}
    rows["source"] = defaults.source
    for name, info in defaults.dropped.items():
        rows[f"dropped {name}"] = f"{info.get('value')}: {info.get('reason')}"
    return rows


def _tools_rows(tools: Any) -> dict[str, Any]:
    if tools is None:
        return {"parser": "not recorded (built before kiln recorded it): serve detects it "
                          "from the chat template"}
    return {"parser": tools.parser or "none (no tool calling)", "source": tools.source}


def _attention_rows(section: dict[str, Any]) -> dict[str, Any]:
    """The attention backend per step class, where the choice came from, what was timed."""
    if not section:
        return {"backend": "not recorded (built before kiln recorded it): Triton on CUDA, "
                           "the torch reference elsewhere"}
    if section.get("backend") == "auto":
        return {"backend": "auto: Triton on CUDA, the torch reference elsewhere",
                "source": f"{section.get('source')} ({section.get('reason', 'no reason')})"}
    rows: dict[str, Any] = {"backend": section.get("backend"), "source": section.get("source")}
    for cls, backend in (section.get("classes") or {}).items():
        rows[f"{cls} steps"] = backend
    if section.get("gpu"):
        rows["measured on"] = (f"{section['gpu']}, {section.get('measured_at')}, "
                               f"{section.get('measure_s', 0):.1f} s")
    for problem, stat in (section.get("stats") or {}).items():
        us = stat.get("us") or {}
        rows[problem] = ", ".join(f"{b} {t:,.0f} us" for b, t in us.items()) or "not timed"
    for backend, why in (section.get("skipped") or {}).items():
        rows[f"{backend} not chosen"] = why
    return rows


def _parallel_rows(spec: Any) -> dict[str, Any]:
    """tp, how the KV heads and the vocabulary split, each rank's weight file."""
    par = spec.parallel
    if par is None:
        return {"tp": 1}
    rows: dict[str, Any] = {
        "tp": par.tp,
        "kv heads": f"{par.kv_heads} ({spec.model.num_kv_heads} KV heads, "
                    f"{max(spec.model.num_kv_heads // par.tp, 1)} per rank)",
        "query heads per rank": spec.model.num_heads // par.tp,
        "vocab padded": f"{par.vocab_size_padded} ({par.vocab_size_padded // par.tp} rows "
                        "per rank)",
    }
    files = spec.weights.get("files", {})
    for rank in range(par.tp):
        if par.shards:
            info = files.get(par.shards[rank], {})
            rows[f"rank {rank}"] = (f"{par.shards[rank]}, {info.get('size', 0):,} bytes, "
                                    f"sha256 {info.get('sha256')}")
        else:
            rows[f"rank {rank}"] = "random weights, sharded at load"
    return rows


def _compiled_rows(path: Path) -> dict[str, Any]:
    """The Triton kernels the engine ships (``kiln build --precompile-kernels``), per tag."""
    from kiln.runtime.kernel_cache import shipped_kernels

    shipped = shipped_kernels(path)
    if not shipped:
        return {"shipped": "none (compiled at the first start on each machine; "
                           "`kiln build --precompile-kernels` ships them)"}
    return {tag: f"{n} kernels" for tag, n in shipped.items()}


def _kernel_rows(section: dict[str, Any]) -> dict[str, Any]:
    """The tuning section in a few rows (all of it is in --json)."""
    if not section:
        return {"tuned": "no (engine built before kernel tuning existed)"}
    if not section.get("tuned"):
        return {"tuned": f"no ({section.get('reason', 'no reason recorded')})"}
    configs = section.get("configs") or {}
    rows: dict[str, Any] = {
        "tuned": "yes",
        "gpu": section.get("gpu"),
        "capability": ".".join(map(str, section.get("capability") or [])) or None,
        "triton / torch": f"{section.get('triton')} / {section.get('torch')}",
        "tuned at": section.get("tuned_at"),
        "tune time": f"{section.get('tune_s', 0):.1f} s",
        "configs": sum(len(v) for v in configs.values()),
    }
    for kernel, keys in configs.items():
        stats = (section.get("stats") or {}).get(kernel, {})
        speedups = [s["speedup"] for s in stats.values() if "speedup" in s]
        best = f", best {max(speedups):.2f}x over default" if speedups else ""
        skipped = (section.get("skipped") or {}).get(kernel, 0)
        rejected = (section.get("rejected") or {}).get(kernel, 0)
        rows[kernel] = (f"{len(keys)} configs{best} ({skipped} candidates skipped, "
                        f"{rejected} rejected)")
    return rows


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect)
