"""``build_engine``: validate, prepare weights layer by layer, write the engine atomically."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import kiln
from kiln.builder.safetensors_stream import SafetensorsStreamWriter
from kiln.builder.spec import DTYPES, ENGINE_FORMAT_VERSION, EngineSpec, Limits, QuantConfig
from kiln.builder.speculative import SpeculativeConfig
from kiln.builder.weights import (
    RANDOM_STD,
    TORCH_DTYPES,
    check_source_tensors,
    prepare_groups,
    runtime_shapes,
)
from kiln.errors import KilnError
from kiln.sources import SourceModel, open_source

ENGINE_JSON = "engine.json"
WEIGHTS_FILE = "weights.safetensors"
TOKENIZER_DIR = "tokenizer"


def _check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists():
        if not out_dir.is_dir():
            raise KilnError(f"output {out_dir} exists and is not a directory; choose another -o")
        if any(out_dir.iterdir()) and not force:
            raise KilnError(
                f"output directory {out_dir} exists and is not empty; pass --force to replace it"
            )


def build_engine(
    source: str | SourceModel,
    out_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    limits: Limits | None = None,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
    max_input_len: int | None = None,
    max_num_tokens: int | None = None,
    speculative: SpeculativeConfig | None = None,
    quantization: QuantConfig | None = None,
    progress: bool = True,
    force: bool = False,
) -> EngineSpec:
    """Build an engine directory at ``out_dir`` from ``source`` (see ``open_source``).

    Either pass ``limits`` or the individual ``max_*`` values (unset ones get defaults that fit
    the model). Everything is validated before weights are touched; the engine is written to
    a temp dir beside ``out_dir`` and renamed into place, so ``out_dir`` is never
    half-written. An existing non-empty ``out_dir`` is replaced only with ``force``.
    """
    out_dir = Path(out_dir).expanduser()
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {list(DTYPES)}")
    _check_out_dir(out_dir, force)
    speculative = speculative or SpeculativeConfig()
    quantization = (quantization or QuantConfig()).resolved(dtype)
    if quantization.weights != "none" or quantization.activations != "none":
        raise KilnError("quantized weights are built from a `kiln quantize` checkpoint (todo)")
    console = Console(stderr=True, quiet=not progress)

    model = source if isinstance(source, SourceModel) else open_source(source, progress=progress)
    cfg = model.config
    if limits is None:
        limits = Limits.for_model(
            cfg,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            max_input_len=max_input_len,
            max_num_tokens=max_num_tokens,
            speculative=speculative,
        )
    for warning in limits.validate_for(cfg, speculative):
        Console(stderr=True).print(f"[yellow]warning:[/] {warning}")
    if not model.is_random:
        model.materialize()  # heavy (GGUF dequantization) only after the checks above
        check_source_tensors(model)

    spec = EngineSpec(
        format_version=ENGINE_FORMAT_VERSION,
        kiln_version=kiln.__version__,
        model=cfg,
        dtype=dtype,
        limits=limits,
        quantization=quantization,
        speculative=speculative,
        provenance=model.provenance,
        weights=(
            {"format": "random", "seed": model.random_seed, "std": RANDOM_STD}
            if model.is_random
            else {}
        ),
    )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        if not model.is_random:
            files = _write_weights(model, tmp, dtype, console)
            spec = dataclasses.replace(spec, weights={"format": "safetensors", "files": files})
        _write_tokenizer(model, tmp / TOKENIZER_DIR)
        (tmp / ENGINE_JSON).write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    console.print(f"[green]built[/] {out_dir} ({cfg.architecture}, {dtype})")
    return spec


def _write_weights(model: SourceModel, tmp: Path, dtype: str, console: Console) -> dict[str, Any]:
    cfg = model.config
    shapes = runtime_shapes(cfg)
    writer = SafetensorsStreamWriter(
        tmp / WEIGHTS_FILE, shapes, TORCH_DTYPES[dtype], metadata={"format": "pt", "kiln": "1"}
    )
    bar = Progress(
        TextColumn("[bold]Building[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=console.quiet,
    )
    try:
        with bar:
            task = bar.add_task("weights", total=cfg.num_layers + 2)
            for group in prepare_groups(model, dtype):
                for name, tensor in group.items():
                    writer.write(name, tensor)
                bar.advance(task)
                del group
        sha, size = writer.close()
    except BaseException:
        writer.abort()
        raise
    return {WEIGHTS_FILE: {"sha256": sha, "size": size}}


def _write_tokenizer(model: SourceModel, path: Path) -> None:
    """Tokenizer files (incl. chat template) plus a generation_config.json with the eos ids."""
    path.mkdir()
    model.tokenizer.save_pretrained(str(path))
    cfg = model.config
    gen = {"eos_token_id": list(cfg.eos_token_ids)}
    if cfg.bos_token_id is not None:
        gen["bos_token_id"] = cfg.bos_token_id
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move ``tmp`` to ``out_dir``; an existing ``out_dir`` is swapped out, then deleted."""
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except BaseException:
        os.replace(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)
