"""``build_engine``: validate, prepare weights layer by layer, write the engine atomically.

A draft-model engine (speculative mode "draft") holds its draft as a second complete engine
in ENGINE/draft, written by the same ``write_engine`` into the same temp dir.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import kiln
from kiln.artifact import ENGINE_JSON, TOKENIZER_DIR, WEIGHTS_FILE
from kiln.artifact.parallel import ParallelConfig
from kiln.artifact.spec import (
    DTYPES,
    EngineSpec,
    Limits,
    QuantConfig,
    ToolsConfig,
    format_version_for,
)
from kiln.artifact.speculative import SpeculativeConfig
from kiln.artifact.weights import (
    RANDOM_STD,
    RandomCalibration,
    quantize_lm_head,
    runtime_shapes,
)
from kiln.builder import fp8
from kiln.builder.draft import DRAFT_DIR, check_draft, source_name
from kiln.builder.generation import GENERATION_CONFIG_MODES, resolve_generation_defaults
from kiln.builder.safetensors_stream import SafetensorsStreamWriter
from kiln.builder.shard import ShardedWriter
from kiln.builder.weights import check_source_tensors, prepare_groups, tensor_plan
from kiln.dtypes import TORCH_DTYPES
from kiln.errors import KilnError
from kiln.runtime.layers import attention_select
from kiln.sources import SourceModel, open_source
from kiln.sources.base import sha256_file
from kiln.sources.umask import honour_umask


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
    tune: bool | None = False,
    finish: Callable[[Path], None] | None = None,
    generation_config: str = "auto",
    tool_parser: str = "auto",
    attention_backend: str = "auto",
    tp: int = 1,
) -> EngineSpec:
    """Build an engine directory at ``out_dir`` from ``source`` (see ``open_source``).

    Either pass ``limits`` or the individual ``max_*`` values (unset ones get defaults that fit
    the model). Everything is validated before weights are touched; the engine is written to
    a temp dir beside ``out_dir`` and renamed into place, so ``out_dir`` is never
    half-written. An existing non-empty ``out_dir`` is replaced only with ``force``.
    ``tune``: time kernel launch configs on this machine's GPU and record the fastest in
    engine.json ``kernel_configs`` (None: when CUDA is available; `kiln build`'s default).
    ``finish``: called with the temp dir once the engine is complete in it (engine.json
    written), before the rename, so what it adds lands atomically with the rest and an error
    it raises fails the build, leaving nothing (`kiln build` ships precompiled kernels this
    way: kiln/cli/precompile.py).
    ``generation_config``: "auto" records the source's sampling defaults (generation_config.json,
    a built-in's model card) in engine.json ``generation_defaults``; "none" records none.
    ``tool_parser``: "auto" records the tool-call family the chat template speaks
    (kiln.tools.detect_parser) in engine.json ``tools``; a family name (kiln.tools.PARSERS)
    records that one; "none" records that the engine parses no tool calls.
    ``attention_backend``: "auto" times the attention backends per step class on this
    machine's GPU when tuning (kiln.runtime.layers.attention_select) and records the
    winners in engine.json ``attention``; a backend name records that one.
    ``tp``: tensor parallelism over that many ranks (kiln.artifact.parallel): checked
    against the model's head counts with the rest, weights written as one file per rank.
    ``speculative`` mode "draft": ``speculative.draft_model`` (any source form) is opened and
    checked against the target (kiln.builder.draft) with the rest, then built as a complete
    engine in ``out_dir/draft`` (the same dtype and limits, no speculation, no quantization,
    no generation defaults, tuned like the target) inside the same temp dir; the target's
    engine.json records ``draft_engine`` "draft" and ``draft_sha256``, the sha256 of
    draft/engine.json.
    """
    out_dir = Path(out_dir).expanduser()
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {list(DTYPES)}")
    if generation_config not in GENERATION_CONFIG_MODES:
        raise ValueError(f"--generation-config {generation_config!r} is not supported; use "
                         f"one of {list(GENERATION_CONFIG_MODES)}")
    tools = _requested_tools(tool_parser)
    attention = _requested_attention(attention_backend)
    _check_out_dir(out_dir, force)
    speculative = speculative or SpeculativeConfig()
    console = Console(stderr=True, quiet=not progress)

    model = source if isinstance(source, SourceModel) else open_source(source, progress=progress)
    plan = _plan_engine(
        model, dtype=dtype, limits=limits, max_batch_size=max_batch_size,
        max_seq_len=max_seq_len, max_input_len=max_input_len, max_num_tokens=max_num_tokens,
        speculative=speculative, requested=quantization or QuantConfig(),
        generation_config=generation_config,
    )
    parallel = _requested_parallel(plan.spec, tp)
    plan = dataclasses.replace(plan, spec=dataclasses.replace(
        plan.spec, tools=tools, attention=attention, parallel=parallel,
        format_version=format_version_for(plan.spec.quantization, speculative, parallel)))
    draft = None
    if speculative.mode == "draft":
        draft = _plan_draft(source_name(source, model), plan, speculative, progress)
    for p in (plan, draft):  # heavy (GGUF dequantization) only after every check above
        if p is not None and not p.model.is_random:
            p.model.materialize()
            check_source_tensors(fp8.without_scales(p.model) if p.fp8_ckpt else p.model)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-", dir=out_dir.parent))
    try:
        spec = plan.spec
        if draft is not None:
            console.print(f"building the draft model {speculative.draft_model} "
                          f"({draft.spec.model.architecture}, {dtype}) into {out_dir}/{DRAFT_DIR}")
            (tmp / DRAFT_DIR).mkdir()
            write_engine(draft, tmp / DRAFT_DIR, tune, console, label="draft weights")
            recorded = dataclasses.replace(
                speculative, draft_engine=DRAFT_DIR,
                draft_sha256=sha256_file(tmp / DRAFT_DIR / ENGINE_JSON))
            plan = dataclasses.replace(plan, spec=dataclasses.replace(spec,
                                                                      speculative=recorded))
            console.print("building the target model")
        spec = write_engine(plan, tmp, tune, console)
        if finish is not None:
            finish(tmp)
        honour_umask(tmp)  # mkdtemp made it 0700
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    drafted = (f", draft {draft.spec.model.architecture} K={speculative.max_draft_len}"
               if draft is not None else "")
    console.print(f"[green]built[/] {out_dir} ({spec.model.architecture}, {dtype}{drafted})")
    return spec


def _requested_attention(name: str) -> dict[str, Any]:
    """engine.json ``attention`` as asked at build: {} for "auto" (``write_engine`` measures
    it), else the named backend."""
    from kiln.runtime.layers.attention_registry import BACKENDS

    if name == "auto":
        return {}
    if name not in BACKENDS:
        raise ValueError(f"--attention-backend {name!r} is unknown; choose auto (measure at "
                         f"build) or one of {sorted(BACKENDS)}")
    return {"backend": name, "source": "--attention-backend"}
def _requested_parallel(spec: EngineSpec, tp: int) -> ParallelConfig | None:
    """engine.json ``parallel`` for ``--tp``: the model's heads must split (ValueError
    naming them and the tp values that work); a draft-model engine runs on one device."""
    parallel = ParallelConfig.for_model(spec.model, tp)
    if parallel is not None and spec.speculative.mode == "draft":
        raise ValueError(
            f"--tp {tp} with --speculative-decoding-mode draft: a draft-model engine runs on "
            "one device (its draft is not sharded); build it without --tp, or use lookahead "
            "or ngram speculation with --tp")
    return parallel


def _requested_tools(tool_parser: str) -> ToolsConfig | None:
    """engine.json ``tools`` as asked at build: None for "auto" (``write_engine`` detects it
    from the chat template once the tokenizer is loaded)."""
    from kiln.tools import get_parser

    if tool_parser == "auto":
        return None
    if tool_parser == "none":
        return ToolsConfig(None, "--tool-parser")
    try:
        get_parser(tool_parser)
    except ValueError as e:
        raise ValueError(f"--tool-parser: {e}, auto or none") from None
    return ToolsConfig(tool_parser, "--tool-parser")


def _detected_tools(tokenizer: Any) -> ToolsConfig:
    """The tool-call family of ``tokenizer``'s chat template (several named templates: the
    one for tool use, else any)."""
    from kiln.tools import detect_parser

    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or "\n".join(map(str, template.values()))
    parser = detect_parser(template)
    return ToolsConfig(parser, "chat template" if parser is not None else "none")


@dataclass(frozen=True)
class EnginePlan:
    """A checked engine, not written yet: its source, its spec so far (no weight checksums,
    kernel configs) and the FP8 checkpoint its weights come from, if any."""

    model: SourceModel
    spec: EngineSpec
    fp8_ckpt: fp8.Fp8Checkpoint | None = None


def _plan_engine(
    model: SourceModel,
    *,
    dtype: str,
    limits: Limits | None,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
    max_input_len: int | None = None,
    max_num_tokens: int | None = None,
    speculative: SpeculativeConfig,
    requested: QuantConfig,
    generation_config: str,
) -> EnginePlan:
    """Validate what the engine of ``model`` will be (quantization, limits, generation
    defaults; warnings printed) without reading a weight."""
    cfg = model.config
    quantization, fp8_ckpt = _resolve_quantization(model, requested, dtype)
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
    generation, gen_warnings = resolve_generation_defaults(
        model.generation_defaults, model.generation_source, generation_config, speculative)
    for warning in gen_warnings:
        Console(stderr=True).print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    spec = EngineSpec(
        format_version=format_version_for(quantization, speculative),
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
        generation_defaults=generation,
    )
    return EnginePlan(model, spec, fp8_ckpt)


def _plan_draft(
    target_name: str, target: EnginePlan, speculative: SpeculativeConfig, progress: bool
) -> EnginePlan:
    """Open ``speculative.draft_model`` and check it against the target (kiln.builder.draft);
    plan its engine: the target's dtype and limits, no speculation, unquantized, no
    generation defaults."""
    name = str(speculative.draft_model)
    draft = open_source(name, progress=progress)
    warnings = check_draft(target.model, draft, target.spec.limits, target_name=target_name,
                           draft_name=name)
    for warning in warnings:
        Console(stderr=True).print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    dtype = target.spec.dtype
    plan = _plan_engine(draft, dtype=dtype, limits=target.spec.limits,
                        speculative=SpeculativeConfig(), requested=QuantConfig(),
                        generation_config="none")
    # a draft engine is never served: it parses no tool calls, and runs its target's
    # attention backend
    plan = dataclasses.replace(plan, spec=dataclasses.replace(
        plan.spec, tools=ToolsConfig(), attention={**attention_select.DEFAULT,
                                                   "reason": "a draft runs its target's backend"}))
    if plan.fp8_ckpt is not None:
        raise KilnError(
            f"draft model {name} is an FP8 checkpoint ({plan.fp8_ckpt.scheme}): a draft "
            f"engine is built unquantized in the target's dtype {dtype}; pass the unquantized "
            f"model as --draft-model"
        )
    return plan


def write_engine(
    plan: EnginePlan, directory: Path, tune: bool | None, console: Console,
    label: str = "weights",
) -> EngineSpec:
    """Write the engine of ``plan`` (weights, tokenizer/, kernel configs, engine.json last)
    into the existing empty ``directory``; return the spec written. The source must be
    materialized. No rename: the caller owns the directory (build_engine's temp dir, or the
    draft's inside it)."""
    model, spec = plan.model, plan.spec
    quantization = spec.quantization
    if not model.is_random:
        report: dict[str, Any] = {}
        files = _write_weights(model, directory, spec.dtype, console, quantization, report,
                               label=label, parallel=spec.parallel)
        spec = dataclasses.replace(spec, weights={"format": "safetensors", "files": files})
        if spec.parallel is not None:
            spec = dataclasses.replace(spec, parallel=spec.parallel.with_shards())
        if quantization.kv_cache == "fp8":
            spec = _record_kv_scales(spec, report)
    elif quantization.kv_cache == "fp8":
        spec = _record_kv_scales(spec, {"kv_missing": spec.model.num_layers})
    _write_tokenizer(model, directory / TOKENIZER_DIR)
    if spec.tools is None:  # "auto"
        spec = dataclasses.replace(spec, tools=_detected_tools(model.tokenizer))
    spec = dataclasses.replace(spec, kernel_configs=_tune_kernels(spec, tune, console))
    if not spec.attention:  # "auto"
        spec = dataclasses.replace(spec, attention=_measure_attention(spec, tune, console))
    (directory / ENGINE_JSON).write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
    return spec


def _tune_kernels(spec: EngineSpec, tune: bool | None, console: Console) -> dict[str, Any]:
    """The engine.json ``kernel_configs`` section: tuned on this GPU, or why not."""
    import torch

    from kiln.runtime.kernels import tuning

    if tune is False:
        return tuning.untuned("tuning not requested (--no-tune)")
    if not torch.cuda.is_available():
        reason = "no CUDA device at build time"
        console.print(f"kernel tuning skipped: {reason} (the engine uses default kernel "
                      "configs; build on the serving GPU to tune)")
        return tuning.untuned(reason)
    device = torch.device("cuda", torch.cuda.current_device())
    q, sp = spec.quantization, spec.speculative
    bar = Progress(
        TextColumn("[bold]Tuning[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console, transient=True, disable=console.quiet,
    )
    task = bar.add_task(torch.cuda.get_device_name(device), total=None)

    def advance(label: str, done: int, total: int) -> None:
        bar.update(task, completed=done, total=total, description=label)

    try:
        with bar:
            section = tuning.tune(
                spec.model, spec.limits, spec.dtype, device, advance,
                kv_dtype="fp8" if q.kv_cache == "fp8" else spec.dtype,
                weights_fp8=q.weights == "fp8", tokens_per_step=sp.tokens_per_step,
                tree_mask=sp.mode == "lookahead", lm_head_fp8=q.lm_head == "fp8")
    except Exception as e:
        Console(stderr=True).print(f"[yellow]warning:[/] kernel tuning failed ({type(e).__name__}:"
                                   f" {e}); the engine uses default kernel configs")
        return tuning.untuned(f"tuning failed: {type(e).__name__}: {e}"[:300])
    skipped = sum(section["skipped"].values())
    rejected = sum(section["rejected"].values())
    console.print(
        f"tuned {tuning.num_configs(section)} kernel configs on {section['gpu']} in "
        f"{section['tune_s']:.1f} s ({skipped} candidates skipped, {rejected} rejected)")
    return section


def _measure_attention(spec: EngineSpec, tune: bool | None, console: Console
                       ) -> dict[str, Any]:
    """The engine.json ``attention`` section: the backend per step class measured on this
    GPU (with the kernel tuning), or why nothing was measured."""
    import torch

    if tune is False:
        return {**attention_select.DEFAULT, "reason": "not measured (--no-tune)"}
    if not torch.cuda.is_available():
        return {**attention_select.DEFAULT, "reason": "no CUDA device at build time"}
    device = torch.device("cuda", torch.cuda.current_device())
    q, sp = spec.quantization, spec.speculative
    dtype = TORCH_DTYPES[spec.dtype]
    bar = Progress(
        TextColumn("[bold]Attention[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console, transient=True, disable=console.quiet,
    )
    task = bar.add_task("backends", total=None)
    try:
        with bar:
            section = attention_select.measured(
                spec.model, spec.limits, dtype,
                torch.float8_e4m3fn if q.kv_cache == "fp8" else dtype, device,
                tokens_per_step=sp.tokens_per_step, tree=sp.mode == "lookahead",
                progress=lambda label, done, total: bar.update(
                    task, completed=done, total=total, description=label))
    except Exception as e:
        Console(stderr=True).print(f"[yellow]warning:[/] measuring the attention backends "
                                   f"failed ({type(e).__name__}: {e}); the engine runs Triton")
        return {**attention_select.DEFAULT,
                "reason": f"measurement failed: {type(e).__name__}: {e}"[:300]}
    finally:
        torch.cuda.empty_cache()
    won = ", ".join(f"{c} {b}" for c, b in section["classes"].items())
    console.print(f"attention backends measured on {section['gpu']} in "
                  f"{section['measure_s']:.1f} s: {won}")
    return section


def _resolve_quantization(
    model: SourceModel, requested: QuantConfig, dtype: str
) -> tuple[QuantConfig, fp8.Fp8Checkpoint | None]:
    """The engine's QuantConfig from what was asked and what the checkpoint is."""
    wants_fp8 = requested.weights != "none" or requested.activations != "none"
    if model.is_random:
        if not wants_fp8:
            return requested.resolved(dtype), None
        return QuantConfig("fp8", "fp8", requested.kv_cache, _random_scales(model, requested),
                           requested.lm_head).resolved(dtype), None
    ckpt = fp8.detect_fp8_checkpoint(model)
    if ckpt is None:
        if wants_fp8:
            raise KilnError(
                "FP8 weights are built from an FP8 checkpoint: run `kiln quantize SOURCE -o "
                "CKPT --qformat fp8` first and build CKPT (modelopt and compressed-tensors FP8 "
                "checkpoints are read directly); only random:<preset> sources quantize at build"
            )
        return requested.resolved(dtype), None
    kv = requested.kv_cache
    if kv == "auto":
        kv = "fp8" if ckpt.kv_cache else dtype
    scales: dict[str, Any] = {
        "source": ckpt.scheme,
        "producer": ckpt.producer,
        "weights": ("per-channel (one scale per output row)" if ckpt.weights == "channel"
                    else "per-tensor; fused q/k/v and gate/up requantized to the max shard scale"),
        "activations": ckpt.activations,
    }
    if ckpt.calibration:
        scales["calibration"] = ckpt.calibration
    return QuantConfig("fp8", "fp8", kv, scales, requested.lm_head), ckpt


def _random_scales(model: SourceModel, requested: QuantConfig) -> dict[str, Any]:
    """engine.json ``quantization.scales`` of a random FP8 engine: weights quantized at load
    and static activation scales calibrated at load from the engine's seed, the scheme of a
    `kiln quantize` checkpoint (kiln.artifact.weights.RandomCalibration); dynamic
    activations where ``requested.scales`` asks for them ({"activations": "dynamic"}), per
    output channel weight scales where it asks for them ({"weights": "per-channel"}: the
    scheme of `kiln quantize --qformat fp8_pc_pt`, with dynamic activations)."""
    asked_weights = (requested.scales or {}).get("weights", "per-tensor")
    if asked_weights not in ("per-tensor", "per-channel"):
        raise ValueError(f"random FP8 weight scales {asked_weights!r}: use 'per-tensor' or "
                         "'per-channel'")
    scales: dict[str, Any] = {"source": "random",
                              "weights": f"{asked_weights} amax/448, quantized at load"}
    asked = (requested.scales or {}).get("activations", "static")
    if asked == "dynamic":
        return {**scales, "activations": "dynamic"}
    if asked != "static":
        raise ValueError(f"random FP8 activation scales {asked!r}: use 'static' (calibrated "
                         "at load) or 'dynamic'")
    calibration = RandomCalibration(seed=model.random_seed or 0)
    return {**scales, "activations": "static", "calibration": calibration.to_dict()}


def _record_kv_scales(spec: EngineSpec, report: dict[str, Any]) -> EngineSpec:
    """Note where the KV scales came from in engine.json; warn loudly when they are 1.0."""
    n = spec.model.num_layers
    warning = fp8.kv_warning(report, n)
    if warning:
        Console(stderr=True).print(f"[bold red]WARNING:[/] {warning}")
    if report.get("kv_missing"):
        kv = f"1.0 (missing in the source for {report['kv_missing']}/{n} layers)"
    elif report.get("kv_ones") == n:
        kv = "checkpoint (all exactly 1.0)"
    else:
        kv = "checkpoint (calibrated)"
    q = spec.quantization
    scales = {**(q.scales or {"source": "none"}), "kv_cache": kv}
    return dataclasses.replace(spec, quantization=dataclasses.replace(q, scales=scales))


def _write_weights(
    model: SourceModel, tmp: Path, dtype: str, console: Console,
    quantization: QuantConfig | None = None, report: dict[str, Any] | None = None,
    label: str = "weights", parallel: ParallelConfig | None = None,
) -> dict[str, Any]:
    cfg = model.config
    target = TORCH_DTYPES[dtype]
    q = quantization or QuantConfig()
    report = {} if report is None else report
    fp8_head = q.lm_head == "fp8"
    shapes = runtime_shapes(cfg, separate_head=fp8_head)
    if q.weights == "fp8" or q.kv_cache == "fp8":
        plan = tensor_plan(cfg, separate_head=fp8_head)
        kv_fp8 = q.kv_cache == "fp8"
        layout = fp8.fp8_layout(model, cfg, plan, shapes, target, kv_fp8=kv_fp8)
        groups = fp8.prepare_fp8_groups(model, cfg, plan, target, kv_fp8=kv_fp8, report=report)
    else:
        layout = {name: (shape, target) for name, shape in shapes.items()}
        groups = prepare_groups(model, dtype, separate_head=fp8_head)
    if fp8_head:  # the head group's engine-dtype lm_head becomes e4m3 + scale
        layout = fp8.fp8_lm_head_layout(layout)
        groups = (quantize_lm_head(g) if "lm_head.weight" in g else g for g in groups)
    metadata = {"format": "pt", "kiln": "1"}
    writer: SafetensorsStreamWriter | ShardedWriter = (
        SafetensorsStreamWriter(
            tmp / WEIGHTS_FILE, {name: shape for name, (shape, _) in layout.items()}, target,
            metadata=metadata, dtypes={name: dt for name, (_, dt) in layout.items()})
        if parallel is None else ShardedWriter(tmp, layout, target, cfg, parallel, metadata))
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
            task = bar.add_task(label, total=cfg.num_layers + 2)
            for group in groups:
                for name, tensor in group.items():
                    writer.write(name, tensor)
                bar.advance(task)
                del group
        if isinstance(writer, ShardedWriter):
            return writer.close()
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
