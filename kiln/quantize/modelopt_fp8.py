"""FP8 post-training quantization with nvidia-modelopt, exported in modelopt's HF format.

Pipeline: load the source as a transformers model (float32 on CPU, bfloat16 on CUDA) →
``mtq.quantize`` with FP8_DEFAULT_CFG (E4M3 per-tensor weights, static per-tensor input
scales; max calibration) plus FP8_KV_CFG (per-tensor K/V scales from the attention's
k/v bmm quantizers, i.e. after RoPE: what the KV cache stores) → modelopt's
``export_hf_checkpoint``. The result (config.json with ``quantization_config``,
hf_quant_config.json, weights as e4m3 ``weight`` + f32 ``weight_scale`` / ``input_scale``,
``k_proj.k_scale`` / ``v_proj.v_scale`` per layer) loads in vLLM, SGLang and TensorRT-LLM,
and in ``kiln build``.

The export format is that of ``MODELOPT_VERSION`` (pinned in pyproject.toml).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import kiln
from kiln.errors import KilnError
from kiln.quantize import quality
from kiln.quantize.calib import calibration_chunks, eval_windows, load_text_set
from kiln.sources.umask import honour_umask

MODELOPT_VERSION = "0.47.0"
# kiln reads them in the engine dtype (`kiln build --quantize-lm-head` makes an FP8 lm_head)
ALWAYS_EXCLUDED = ("lm_head", "embed_tokens")
# --qformat -> modelopt's recipe: fp8 per-tensor weights with static per-tensor activation
# scales (modelopt quant_algo FP8); fp8_pc_pt per-channel weights with dynamic per-token
# activations (FP8_PER_CHANNEL_PER_TOKEN, which vLLM and TensorRT-LLM load as modelopt too)
QFORMATS = ("fp8", "fp8_pc_pt")
_QFORMAT_CFG = {"fp8": "FP8_DEFAULT_CFG", "fp8_pc_pt": "FP8_PER_CHANNEL_PER_TOKEN_CFG"}
KV_DTYPES = ("auto", "fp8", "none")
CALIB_FILE = "kiln_quantize.json"


def _modelopt() -> tuple[Any, Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "transformers X is not tested" on import
            import modelopt
            import modelopt.torch.quantization as mtq
            from modelopt.torch.export import export_hf_checkpoint
    except ImportError as e:
        raise KilnError(
            f"kiln quantize needs nvidia-modelopt=={MODELOPT_VERSION} ({e}); "
            f"pip install 'nvidia-modelopt=={MODELOPT_VERSION}'"
        ) from e
    if modelopt.__version__ != MODELOPT_VERSION:
        Console(stderr=True).print(
            f"[yellow]warning:[/] nvidia-modelopt {modelopt.__version__} is installed; kiln's "
            f"FP8 checkpoint format is tested with {MODELOPT_VERSION}"
        )
    return mtq, export_hf_checkpoint


def quant_config(mtq: Any, kv_cache_dtype: str, exclude: list[str],
                 qformat: str = "fp8") -> dict[str, Any]:
    """modelopt config: ``qformat``'s FP8 weights and activations, FP8 KV scales,
    exclusions."""
    base = getattr(mtq, _QFORMAT_CFG[qformat])
    rules = list(base["quant_cfg"])
    if kv_cache_dtype == "fp8":
        rules += list(mtq.FP8_KV_CFG["quant_cfg"])
    for name in dict.fromkeys([*ALWAYS_EXCLUDED, *exclude]):
        rules.append({"quantizer_name": f"*{name}*", "enable": False})
    return {"quant_cfg": rules, "algorithm": base.get("algorithm", "max")}


def _load_hf_model(spec: str, device: str, progress: bool) -> tuple[Any, Any, dict[str, Any]]:
    """(transformers model on ``device``, the kiln SourceModel (tokenizer, generation
    defaults), provenance) for a kiln source spec."""
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.sources import open_source

    if spec.startswith("random:"):
        raise KilnError("random:<preset> sources have no weights to calibrate; build them with "
                        "`kiln build random:<preset> --quantization fp8`")
    source = open_source(spec, progress=progress)  # tokenizer + provenance; weights lazy
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    prov = source.provenance
    kwargs: dict[str, Any] = {"dtype": dtype}
    status = Console(stderr=True, quiet=not progress).status("Loading the model…")
    with status, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if prov.get("kind") in ("local", "hub"):
            model = AutoModelForCausalLM.from_pretrained(prov["path"], **kwargs)
        else:  # builtin alias or .gguf file: kiln's GGUF reader dequantizes it
            from kiln.sources.builtin import BUILTINS, fetch_builtin

            gguf = Path(fetch_builtin(spec, progress=progress) if spec in BUILTINS else spec)
            model = gguf_model(source, gguf, dtype)
    if not model.config.architectures:
        # A config read from GGUF has none; modelopt's export iterates it and every loader
        # of the checkpoint (kiln build, vLLM, transformers) picks the model class from it.
        model.config.architectures = [type(model).__name__]
    return model.to(device).eval(), source, prov


def gguf_model(source: Any, path: Path, dtype: Any) -> Any:
    """A transformers model of the GGUF file ``path`` holding the weights kiln's reader
    dequantizes (``source``: ``open_source`` of it), filled tensor by tensor into a model
    made without initialising its weights. They equal what transformers' own GGUF path
    loads (``gguf_file=``), in well under half the time (qwen2.5-coder-0.5b, float32, on a
    loaded 2-core CPU: 13.8 s against 35.9 s; that path also holds every tensor twice)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln.sources.gguf import gguf_hf_config
    from kiln.sources.gguf_reader import read_header

    cfg = AutoConfig.for_model(**gguf_hf_config(read_header(path)))
    with _no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    params = dict(model.named_parameters())
    loaded = set()
    with torch.no_grad():
        for name, tensor in source.tensors():
            if name not in params:
                raise KilnError(f"{path}: tensor {name} has no place in {type(model).__name__}")
            params[name].copy_(tensor)
            loaded.add(name)
    model.tie_weights()
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(set(params) - loaded - tied)
    if missing:  # their memory is uninitialised: never calibrate on it
        raise KilnError(f"{path} lacks tensors {type(model).__name__} needs: {missing[:5]}")
    return model


def _no_init_weights() -> Any:
    """transformers' context that skips weight initialisation (every weight is loaded after)."""
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights  # transformers 4
    return no_init_weights()


def _carry_generation_defaults(path: Path, defaults: dict[str, Any]) -> None:
    """Write the source's sampling defaults into the checkpoint's generation_config.json
    (where `kiln build`, vLLM and transformers read them): a GGUF source's (a built-in's
    model card values) would otherwise be lost with the GGUF."""
    if not defaults:
        return
    gen = json.loads(path.read_text()) if path.is_file() else {}
    gen.update(defaults)
    if gen.get("temperature", 1.0) > 0:
        gen.setdefault("do_sample", True)  # transformers samples only with it
    path.write_text(json.dumps(gen, indent=2) + "\n")


def strip_kv_cache(ckpt: Path) -> None:
    """Make the exported checkpoint ``ckpt`` one without an FP8 KV cache, as modelopt exports
    it with the K/V quantizers off (its export converts the model's weights in place, so it
    cannot run twice): no ``k_proj.k_scale`` / ``v_proj.v_scale`` tensors,
    ``kv_cache_quant_algo`` null in hf_quant_config.json, no ``kv_cache_scheme`` in
    config.json's ``quantization_config``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    kv_scale = (".k_scale", ".v_scale")
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            if not any(n.endswith(kv_scale) for n in f.keys()):
                continue
            kept = {n: f.get_tensor(n) for n in f.keys() if not n.endswith(kv_scale)}
            meta = f.metadata()
        save_file(kept, str(shard), metadata=meta)
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {n: f for n, f in data["weight_map"].items()
                              if not n.endswith(kv_scale)}
        index.write_text(json.dumps(data, indent=2) + "\n")
    hq = json.loads((ckpt / "hf_quant_config.json").read_text())
    hq["quantization"]["kv_cache_quant_algo"] = None
    (ckpt / "hf_quant_config.json").write_text(json.dumps(hq, indent=4))
    config = json.loads((ckpt / "config.json").read_text())
    config.get("quantization_config", {}).pop("kv_cache_scheme", None)
    (ckpt / "config.json").write_text(json.dumps(config, indent=4))


def quantize(
    source: str,
    out_dir: str | Path,
    *,
    qformat: str = "fp8",
    kv_cache_dtype: str = "auto",
    calib_size: int = 64,
    calib_seq_len: int = 256,
    calib_data: str | Path | None = None,
    exclude: list[str] | None = None,
    device: str | None = None,
    progress: bool = True,
    force: bool = False,
    eval_data: str | Path | None = None,
    eval_seq_len: int = quality.DEFAULT_SEQ_LEN,
    max_quality_loss: float = quality.DEFAULT_MAX_LOSS,
    allow_quality_loss: bool = False,
) -> dict[str, Any]:
    """Calibrate ``source`` and write a modelopt FP8 checkpoint to ``out_dir`` (atomically),
    unless its perplexity on ``eval_data`` (kiln's built-in eval set by default) rises past
    ``max_quality_loss`` over the source's and that is not allowed (kiln/quantize/quality.py).

    The checkpoint is scored as the engine `kiln build` makes of it (``quality.engine_perplexity``).
    ``kv_cache_dtype`` "auto": an FP8 KV cache unless leaving it out alone brings the checkpoint
    within a limit it is past with it (``quality.kv_cache_left_out``: 3 %, or
    ``max_quality_loss`` when lower; or ``max_quality_loss``): then the KV cache stays in the
    model's dtype and the summary says why (``fp8_kv_quality``). Qwen2.5-Coder-1.5B: +78 %
    from FP8 KV alone, +0.7 % from FP8 weights and activations
    (benchmarks/fp8_attribution.py); smollm2-135m: +3.29 % with it, +2.96 % without.

    Returns the summary also written to ``out_dir/kiln_quantize.json``.
    """
    import torch

    if qformat not in QFORMATS:
        raise KilnError(f"--qformat {qformat!r} is not supported; use one of {list(QFORMATS)}")
    if kv_cache_dtype not in KV_DTYPES:
        raise KilnError(
            f"--kv-cache-dtype {kv_cache_dtype!r} is not supported; use one of {list(KV_DTYPES)}"
        )
    out_dir = Path(out_dir).expanduser()
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise KilnError(f"output {out_dir} exists and is not empty; pass --force to replace it")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise KilnError(f"--device {device!r}: use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise KilnError("--device cuda but CUDA is not available; use --device cpu")
    if not max_quality_loss >= 0:
        raise KilnError(f"--max-quality-loss {max_quality_loss} must be >= 0 (0.05: +5 % "
                        "perplexity)")
    exclude = [e.strip() for e in (exclude or []) if e.strip()]
    mtq, export_hf_checkpoint = _modelopt()
    console = Console(stderr=True, quiet=not progress)

    t0 = time.perf_counter()
    model, src, prov = _load_hf_model(source, device, progress)
    tokenizer = src.tokenizer
    text = load_text_set(calib_data, "calib")
    chunks = calibration_chunks(tokenizer, text, calib_size, calib_seq_len)
    eval_text = load_text_set(eval_data, "eval")
    windows = eval_windows(tokenizer, eval_text, eval_seq_len)

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=console, transient=True, disable=console.quiet,
    )

    def forward_loop(m: Any) -> None:
        with bar:
            task = bar.add_task(f"[bold]Calibrating[/] {len(chunks)} x {calib_seq_len} tokens",
                                total=len(chunks))
            for chunk in chunks:
                m(torch.tensor([chunk], device=device))
                bar.advance(task)

    def evaluate(what: str) -> float:
        with bar:
            task = bar.add_task(f"[bold]Perplexity[/] of the {what}", total=len(windows))
            return quality.hf_perplexity(model, windows, device, lambda: bar.advance(task))

    # the checkpoint is scored as the engine kiln builds of it, in the dtype the source ran
    engine_dtype = "bfloat16" if device == "cuda" else "float32"
    scored_by = f"kiln engine ({engine_dtype}, {device})"

    def score(ckpt: Path, kv_fp8: bool, what: str) -> float:
        with bar:
            task = bar.add_task(f"[bold]Perplexity[/] of the {what}", total=len(windows))
            return quality.engine_perplexity(ckpt, windows, dtype=engine_dtype, kv_fp8=kv_fp8,
                                             device=device, advance=lambda: bar.advance(task))

    model.eval()
    source_ppl = evaluate("source")
    kv = "none" if kv_cache_dtype == "none" else "fp8"
    # modelopt prints on stdout: keep stdout for --json
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings(), \
            contextlib.redirect_stdout(sys.stderr):
        warnings.simplefilter("ignore")
        model = mtq.quantize(model, quant_config(mtq, kv, exclude, qformat), forward_loop)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.quantizing-", dir=out_dir.parent))
    try:
        with console.status("Exporting the FP8 checkpoint…"), warnings.catch_warnings(), \
                contextlib.redirect_stdout(sys.stderr):
            warnings.simplefilter("ignore")
            export_hf_checkpoint(model, export_dir=str(tmp))
        tokenizer.save_pretrained(str(tmp))
        _carry_generation_defaults(tmp / "generation_config.json", src.generation_defaults)
        fp8_ppl = score(tmp, kv == "fp8", "FP8 checkpoint")
        checked = quality.quality_record(source_ppl, fp8_ppl, windows, eval_seq_len,
                                         eval_text.provenance, max_quality_loss, scored_by)
        fp8_kv = None  # the FP8 KV cache's record, when auto left it out
        if kv_cache_dtype == "auto" and checked["increase"] > quality.kv_limit(max_quality_loss):
            without = score(tmp, False, "FP8 checkpoint with the KV cache unquantized")
            if quality.kv_cache_left_out(source_ppl, fp8_ppl, without, max_quality_loss):
                fp8_kv, kv = checked, "none"
                strip_kv_cache(tmp)
                checked = quality.quality_record(source_ppl, without, windows, eval_seq_len,
                                                 eval_text.provenance, max_quality_loss,
                                                 scored_by)
                Console(stderr=True).print(  # said under --json too: it decides the format
                    f"[yellow]note[/]: with an FP8 KV cache perplexity rises from "
                    f"{source_ppl:.2f} to {fp8_ppl:.2f} ({fp8_kv['increase']:+.2%}), past "
                    f"{quality.kv_limit(max_quality_loss):.0%}; without it {without:.2f} "
                    f"({checked['increase']:+.2%}): the "
                    "KV cache stays in the model's dtype (--kv-cache-dtype fp8 keeps it FP8 "
                    "anyway)")
        # auto measured the KV cache's share already: suggest leaving it out only when asked
        quality.check(checked, allow_quality_loss, qformat, fp8_kv=kv_cache_dtype == "fp8")
        summary = {
            "tool": "kiln quantize",
            "kiln_version": kiln.__version__,
            "modelopt_version": MODELOPT_VERSION,
            "qformat": qformat,
            "kv_cache_dtype": kv,
            "kv_cache_dtype_asked": kv_cache_dtype,
            "calib_size": len(chunks),
            "calib_seq_len": calib_seq_len,
            "calib_tokens": sum(len(c) for c in chunks),
            **text.provenance,
            "exclude": list(dict.fromkeys([*ALWAYS_EXCLUDED, *exclude])),
            "device": device,
            "source": prov,
            "quality": checked,
            **({"fp8_kv_quality": fp8_kv} if fp8_kv else {}),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        (tmp / CALIB_FILE).write_text(json.dumps(summary, indent=2) + "\n")
        honour_umask(tmp)  # mkdtemp made it 0700
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    console.print(f"[green]quantized[/] {out_dir} (FP8 weights"
                  f"{' + FP8 KV cache' if kv == 'fp8' else ''}, "
                  f"{len(chunks)} calibration samples); {quality.summary_line(checked)}")
    return summary
