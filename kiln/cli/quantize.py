"""`kiln quantize SOURCE -o CKPT`: FP8 post-training quantization with nvidia-modelopt."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def quantize(
    source: str = typer.Argument(
        ..., metavar="SOURCE",
        help="Model: a local HF directory, a .gguf file, a hub id org/name or a built-in "
        "alias (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b).",
    ),
    output: Path = typer.Option(..., "-o", "--output", help="Checkpoint directory to write."),
    qformat: str = typer.Option(
        "fp8", "--qformat",
        help="FP8 scheme: fp8 (E4M3 weights with one scale per tensor, static per-tensor "
        "activation scales from calibration) or fp8_pc_pt (one weight scale per output channel, "
        "activation scales per token at run time, modelopt's FP8_PER_CHANNEL_PER_TOKEN, "
        "which vLLM and TensorRT-LLM load too)."),
    kv_cache_dtype: str = typer.Option(
        "auto", "--kv-cache-dtype",
        help="fp8 (calibrate per-layer K/V scales), none, or auto: fp8, unless the checkpoint "
        "with it is past +3 % perplexity (or --max-quality-loss) and within it without: then "
        "none, said and recorded (Qwen2.5's keys: +78 % on Qwen2.5-Coder-1.5B)."),
    calib_size: int = typer.Option(64, "--calib-size", help="Most calibration samples."),
    calib_seq_len: int = typer.Option(256, "--calib-seq-len", help="Tokens per sample."),
    calib_data: str | None = typer.Option(
        None, "--calib-data",
        help="Calibration text: a .txt file (documents separated by a line =====) or a .jsonl "
        "file with a \"text\" field; default: kiln's built-in calibration set.",
    ),
    exclude: str = typer.Option(
        "lm_head,embed_tokens", "--exclude",
        help="Comma-separated module name patterns left unquantized (lm_head and embed_tokens "
        "always are: kiln reads them in the engine dtype; `kiln build CKPT "
        "--quantize-lm-head` makes an FP8 lm_head).",
    ),
    device: str | None = typer.Option(
        None, "--device", help="cpu or cuda (default: cuda when available)."
    ),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it exists."),
    eval_file: str | None = typer.Option(
        None, "--eval-file",
        help="Text the quality gate scores (as --calib-data); default: kiln's built-in eval "
        "set (no text shared with the calibration set)."),
    max_quality_loss: float = typer.Option(
        0.05, "--max-quality-loss",
        help="The quality gate: the most the FP8 checkpoint's perplexity (scored as the engine "
        "kiln build makes of it) may rise over the source's (0.05: +5 %); past it the command "
        "exits 1 and writes nothing."),
    allow_quality_loss: bool = typer.Option(
        False, "--allow-quality-loss",
        help="Write the checkpoint whatever the quality gate measures (both perplexities "
        "are still printed and recorded in kiln_quantize.json)."),
    as_json: bool = typer.Option(
        False, "--json", help="Print the calibration summary as JSON on stdout."
    ),
) -> None:
    """Calibrate FP8 weight, activation and KV cache scales; export a modelopt HF checkpoint
    that `kiln build` (and vLLM, SGLang, TensorRT-LLM) can load. A quality gate compares the
    perplexity of the source and of the FP8 model first (printed, and kept in the
    checkpoint's kiln_quantize.json)."""
    from kiln.quantize import quantize as run

    summary = run(
        source, output, qformat=qformat, kv_cache_dtype=kv_cache_dtype, calib_size=calib_size,
        calib_seq_len=calib_seq_len, calib_data=calib_data, exclude=exclude.split(","),
        device=device, progress=not as_json, force=force, eval_data=eval_file,
        max_quality_loss=max_quality_loss, allow_quality_loss=allow_quality_loss,
    )
    if as_json:
        typer.echo(json.dumps(summary, indent=2))


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize)
