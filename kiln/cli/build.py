"""`kiln build SOURCE -o OUT`: turn a model source into an engine directory."""

from __future__ import annotations

import json
from collections.abc import Callable
from enum import Enum
from pathlib import Path

import typer


class Dtype(str, Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class GenerationConfig(str, Enum):
    auto = "auto"
    none = "none"


def build(
    source: str = typer.Argument(
        ...,
        metavar="SOURCE",
        help="Model: a local HF directory, a .gguf file, a hub id org/name, a built-in "
        "alias (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b: real Instruct weights "
        "stored as 4-5 bit GGUF, dequantized at build), or random:<preset>[:seed] "
        "(tiny-llama, tiny-qwen2, tiny-qwen3, smollm2-135m, llama-3-8b, qwen2.5-0.5b, "
        "qwen2.5-1.5b, qwen2.5-7b, llama-3.2-1b, llama-3-70b).",
    ),
    output: Path = typer.Option(..., "-o", "--output", help="Engine directory to write."),
    dtype: Dtype | None = typer.Option(
        None, "--dtype", help="Weight and activation dtype (default: bfloat16 when CUDA is "
        "available, float32 without, as serve and generate build a source)."),
    max_batch_size: int | None = typer.Option(
        None, "--max-batch-size",
        help="Most sequences in one step (default 256; serve runs fewer when the KV memory "
        "left after the weights holds fewer).",
    ),
    max_seq_len: int | None = typer.Option(
        None,
        "--max-seq-len",
        help="Most tokens per sequence, prompt + output (default: the model's context, at "
        "most its sliding window). On CUDA the KV cache must hold one such sequence.",
    ),
    max_input_len: int | None = typer.Option(
        None, "--max-input-len", help="Most prompt tokens (default max_seq_len - 1 - draft)."
    ),
    max_num_tokens: int | None = typer.Option(
        None, "--max-num-tokens",
        help="Token budget of one scheduling step (default 8192, at least 1 + max_draft_len).",
    ),
    speculative_decoding_mode: str = typer.Option(
        "none",
        "--speculative-decoding-mode",
        help="Speculative decoding: none, lookahead, ngram (prompt lookup), draft (a draft "
        "model, --draft-model) or suffix (suffix decoding: the request's text and a cache "
        "of earlier responses).",
    ),
    lookahead_config: str | None = typer.Option(
        None,
        "--lookahead-config",
        help="Lookahead window W,N,G (default 7,7,7, the measured best of the windows tried); "
        "max_draft_len is derived from it.",
    ),
    max_draft_len: int | None = typer.Option(
        None, "--max-draft-len",
        help="Most draft tokens per step: lookahead derives it from --lookahead-config (given "
        "both, they must match); ngram and draft need it (draft: 1 to 16, e.g. 4); suffix: "
        "the draft tree's most tokens, default 16, at most --suffix-tree-depth minus "
        "--suffix-min-match.",
    ),
    ngram_match: int | None = typer.Option(
        None, "--ngram-match",
        help="Longest n-gram matched by prompt lookup: mode ngram's drafts and lookahead's "
             "prompt-lookup candidate (one of its G slots). Default 3.",
    ),
    suffix_tree_depth: int | None = typer.Option(
        None, "--suffix-tree-depth",
        help="Suffix decoding: the suffix trees' depth, the longest match plus draft (default "
        "24, at most 64; memory grows with it).",
    ),
    suffix_min_match: int | None = typer.Option(
        None, "--suffix-min-match",
        help="Suffix decoding: the shortest match of the request's last tokens that drafts "
        "(default 2); a draft is at most as long as its match.",
    ),
    suffix_cache_requests: int | None = typer.Option(
        None, "--suffix-cache-requests",
        help="Suffix decoding: earlier responses kept in the server's shared cache, oldest "
        "evicted first (default 256; 0: each request's own text only).",
    ),
    draft_model: str | None = typer.Option(
        None, "--draft-model", metavar="SOURCE",
        help="The draft model of --speculative-decoding-mode draft: any SOURCE form, a "
        "smaller model with the same tokenizer as the target (e.g. qwen2.5-coder-0.5b for "
        "qwen2.5-coder-1.5b); built in --dtype with the same limits into ENGINE/draft.",
    ),
    kv_cache_dtype: str = typer.Option(
        "auto",
        "--kv-cache-dtype",
        help="KV cache dtype: auto (fp8 when the checkpoint has FP8 KV scales, else --dtype), "
        "bfloat16, float16, float32 or fp8 (without calibrated scales: 1.0, with a warning).",
    ),
    quantization: str = typer.Option(
        "none",
        "--quantization",
        help="none, or for random:<preset> sources fp8 (random FP8 weights with per-tensor "
        "scales, static activation scales calibrated at load: `kiln quantize`'s default "
        "scheme) or fp8_pc_pt (per-channel weight scales, per-token activations: `kiln "
        "quantize --qformat fp8_pc_pt`'s). Real models: build an FP8 checkpoint from `kiln "
        "quantize`.",
    ),
    quantize_lm_head: bool = typer.Option(
        False, "--quantize-lm-head",
        help="Store the output projection (lm_head; when the model ties it to the embedding, "
        "a separate FP8 copy of it, the embedding itself stays in --dtype) as FP8 e4m3 with "
        "one scale per row (the row's amax/448) made at build. Halves the output projection's "
        "bytes per decode step (llama-3-8b FP8 batch 1 on an H200: 376 -> 392 tok/s); costs "
        "some accuracy (smollm2-135m perplexity +1.3-1.9 %): measure it with `kiln eval "
        "perplexity`. Any source, with or without FP8 linears.",
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace OUT if it exists and is not empty."
    ),
    tune: bool | None = typer.Option(
        None, "--tune/--no-tune",
        help="Time kernel launch configs on this machine's GPU and record the fastest in "
        "engine.json (default: tune when CUDA is available; `kiln serve` never re-tunes).",
    ),
    precompile: bool | None = typer.Option(
        None, "--precompile-kernels/--no-precompile-kernels",
        help="Start the engine once on this GPU and ship the Triton kernels it compiles in "
        "ENGINE/kernels, so `kiln serve` on a machine with an empty Triton cache (a fresh "
        "container) does not compile them again: an 8B engine starts in ~10 s instead of "
        "~17 s. Adds that first start (~20 s for 8B; stopped after KILN_PRECOMPILE_TIMEOUT_S, "
        "default 900) to the build; if it fails the engine still builds, without them. "
        "Default: on when CUDA is available.",
    ),
    generation_config: GenerationConfig = typer.Option(
        GenerationConfig.auto, "--generation-config",
        help="auto: record the model's sampling defaults (temperature, top_p, top_k, min_p, "
        "repetition_penalty from its generation_config.json; smollm2-135m: its model card's) "
        "in engine.json; serve and generate use them for fields a request leaves out. none: "
        "record nothing (kiln's own defaults apply). Speculative engines never record a "
        "repetition penalty (it would turn speculation off).",
    ),
    tool_parser: str = typer.Option(
        "auto", "--tool-parser",
        help="How serve reads tool calls from the model's output: auto (the family the chat "
        "template speaks: hermes for Qwen2.5 / Qwen3 <tool_call> blocks, llama3_json for Llama "
        "3.1+ JSON calls, mistral for [TOOL_CALLS]; none when the template has no tools), one "
        "of those names, or none. Recorded in engine.json; `kiln serve --tool-parser` "
        "overrides it.",
    ),
    attention_backend: str = typer.Option(
        "auto", "--attention-backend",
        help="Attention kernels the engine runs: auto (on a CUDA machine, time triton and "
        "flash-attn per step class (decode, prompt, speculative tree) at this engine's shapes "
        "with the kernel tuning, and record the fastest; flash-attn needs `pip install "
        "'kiln-llm[flash-attn]'`), triton, flash-attn (flash-attn-4 for prompt steps, Triton "
        "for the rest) or torch (the plain-torch reference). Recorded in engine.json; "
        "KILN_ATTENTION_BACKEND at serve time overrides it.",
    ),
    tp: int = typer.Option(
        1, "--tp", min=1,
        help="Tensor parallelism: shard the weights over this many ranks (one weight file "
        "per rank; `kiln generate` starts one process per rank). The query heads, the "
        "intermediate size and the KV heads must split: N divides the KV heads, or they "
        "divide N (each KV head replicated); a model that does not split says which tp "
        "values work.",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the engine spec (engine.json) as JSON on stdout."
    ),
) -> None:
    """Build an engine directory (engine.json, weights, tokenizer) from a model source."""
    from kiln.artifact.speculative import SpeculativeConfig
    from kiln.builder import build_engine
    from kiln.cli.engine_source import default_dtype

    chosen = dtype is None
    if dtype is None:
        dtype = Dtype(default_dtype())
    speculative = SpeculativeConfig.from_cli(
        speculative_decoding_mode,
        lookahead_config=lookahead_config,
        max_draft_len=max_draft_len,
        ngram_match=ngram_match,
        draft_model=draft_model,
        suffix={"suffix_tree_depth": suffix_tree_depth, "suffix_min_match": suffix_min_match,
                "suffix_cache_requests": suffix_cache_requests},
    )
    finish = None
    if precompile is not False:  # None (the default) and True: it skips itself without CUDA
        finish = _precompile_step(quiet=as_json)
    spec = build_engine(
        source,
        output,
        dtype=dtype.value,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        max_input_len=max_input_len,
        max_num_tokens=max_num_tokens,
        speculative=speculative,
        quantization=_quant_config(quantization, kv_cache_dtype, quantize_lm_head),
        progress=not as_json,
        force=force,
        tune=tune,
        finish=finish,
        generation_config=generation_config.value,
        tool_parser=tool_parser,
        attention_backend=attention_backend,
        tp=tp,
    )
    given = {name for name, value in (("max_batch_size", max_batch_size),
                                      ("max_seq_len", max_seq_len),
                                      ("max_input_len", max_input_len),
                                      ("max_num_tokens", max_num_tokens)) if value is not None}
    typer.echo(f"kiln build: {spec.limits.describe(spec.model, given)}", err=True)
    if spec.speculative.mode == "lookahead" and lookahead_config is None:
        typer.echo("kiln build: lookahead window {},{},{} (the default; --lookahead-config "
                   "W,N,G names another)".format(*spec.speculative.lookahead), err=True)
    if chosen and dtype is Dtype.float32:
        typer.echo("kiln build: no CUDA device, so float32 (bfloat16 is slow on most CPUs); "
                   "pass --dtype bfloat16 for an engine to run on a GPU", err=True)
    if as_json:
        typer.echo(json.dumps(spec.to_dict(), indent=2))


QUANTIZATION = ("none", "fp8", "fp8_pc_pt")


def _quant_config(quantization: str, kv_cache_dtype: str, quantize_lm_head: bool):
    """--quantization as the engine's QuantConfig: fp8_pc_pt is FP8 with per-channel weight
    scales and per-token activations (random sources; a checkpoint records its own)."""
    from kiln.artifact.spec import QuantConfig
    from kiln.errors import KilnError

    if quantization not in QUANTIZATION:
        raise KilnError(f"--quantization {quantization!r} is not supported; use one of "
                        f"{list(QUANTIZATION)}")
    lm_head = "fp8" if quantize_lm_head else "none"
    if quantization == "fp8_pc_pt":
        return QuantConfig("fp8", "fp8", kv_cache_dtype,
                           {"weights": "per-channel", "activations": "dynamic"}, lm_head)
    return QuantConfig(quantization, quantization, kv_cache_dtype, lm_head=lm_head)


def _precompile_step(quiet: bool) -> Callable[[Path], None]:
    """The kernel precompilation, for ``build_engine`` to run on the complete temp dir
    before its rename (so the kernels land atomically with the engine). A bad
    KILN_PRECOMPILE_TIMEOUT_S fails here, before any weight is read."""
    from rich.console import Console

    from kiln import env
    from kiln.cli.precompile import precompile_kernels

    timeout_s = env.precompile_timeout_s()
    console = Console(stderr=True, quiet=quiet)
    return lambda engine_dir: precompile_kernels(engine_dir, console, timeout_s)


def register(app: typer.Typer) -> None:
    app.command("build")(build)
