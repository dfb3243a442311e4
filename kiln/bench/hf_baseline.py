"""`--baseline hf`: the same benchmark workload through plain transformers, in the same run.

The transformers model is made from the engine directory's own weights (never from the
original source: the engine may be a ``random:`` preset or FP8). Engine tensors are un-fused
(qkv -> q/k/v, gate_up -> gate/up, by ``tensor_plan`` in reverse) and FP8 linears are
dequantized, ``weight.float() * weight_scale``, to the engine's compute dtype; activation and
KV-cache scales are dropped, so an FP8 engine is compared against its dequantized model. An
FP8 lm_head is dequantized the same way; a tied model with one runs untied in transformers.

* latency: ``model.generate`` on the very prompts of kiln's latency run, greedy, exactly
  ``output_len`` new tokens (``min_new_tokens == max_new_tokens``, no EOS), with
  ``cache_implementation="static"`` and transformers' own decode-step compile
  (``torch.compile(mode="reduce-overhead")`` via ``CompileConfig``; default on CUDA). A compile
  or static-cache failure falls back one rung (static eager, then dynamic eager) and says why.
* throughput: the same requests through continuous batching, ``model.generate_batch`` (one
  output length) or its manager (per-request lengths), greedy, EOS disabled; if that is
  missing or fails, padded batches of ``model.generate`` (eager).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kiln.bench.offline import BenchRequest
from kiln.bench.stats import rate, summarize
from kiln.config import ModelConfig

HF_CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig",
                     "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
COMPILE_MODE = "reduce-overhead"
_FP8 = torch.float8_e4m3fn


def transformers_version() -> str:
    import transformers

    return transformers.__version__


# --- the model ------------------------------------------------------------------------------


def hf_config(cfg: ModelConfig) -> Any:
    """The transformers config class instance for ``cfg`` (EOS off: benchmarks ignore EOS)."""
    import transformers

    if cfg.qk_norm != (cfg.architecture == "qwen3"):
        raise ValueError(f"{cfg.architecture} with qk_norm={cfg.qk_norm} has no transformers "
                         "counterpart; the hf baseline supports qk norm only for qwen3")
    cls = getattr(transformers, HF_CONFIG_CLASSES[cfg.architecture])
    params = inspect.signature(cls.__init__).parameters
    kw: dict[str, Any] = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": None, "pad_token_id": 0,
    }
    if "rope_parameters" in params:  # transformers >= 5
        kw["rope_parameters"] = {"rope_type": "default", **(cfg.rope_scaling or {}),
                                 "rope_theta": cfg.rope_theta}
    else:
        kw.update(rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling)
    if "attention_bias" in params:  # llama/qwen3: q, k, v *and o* biases (o's stay zero)
        kw["attention_bias"] = cfg.qkv_bias
    if "sliding_window" in params:  # the runtime attends to the whole context
        kw["sliding_window"] = None
    if "use_sliding_window" in params:
        kw["use_sliding_window"] = False
    return cls(**kw)


def _rows(cfg: ModelConfig, hf_name: str) -> int:
    """Rows an HF shard takes in its fused engine tensor (dim 0)."""
    if ".q_proj." in hf_name:
        return cfg.q_size
    if ".k_proj." in hf_name or ".v_proj." in hf_name:
        return cfg.kv_size
    return cfg.intermediate_size  # gate_proj / up_proj


def hf_state_dict(cfg: ModelConfig, weights: dict[str, torch.Tensor],
                  dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], int]:
    """Engine tensors -> transformers names; returns (state dict, number of FP8 linears).

    Consumes ``weights`` (pops as it goes, so one copy lives at a time). Fused tensors are
    split on dim 0 (views); FP8 ``[N, K]`` e4m3 weights become ``(w.float() * s).to(dtype)``.
    """
    from kiln.artifact.weights import is_scale_name
    from kiln.builder.weights import tensor_plan

    sd: dict[str, torch.Tensor] = {}
    fp8 = 0
    for group in tensor_plan(cfg):
        for name, hf_names in group.items():
            t = weights.pop(name)
            if t.dtype == _FP8:
                prefix = name.removesuffix(".weight")
                scale = weights.pop(prefix + ".weight_scale").float().reshape(-1, 1)  # [] / [N]
                t = (t.float() * scale).to(dtype)
                fp8 += 1
            else:
                t = t.to(dtype)
            parts = [t] if len(hf_names) == 1 else t.split([_rows(cfg, n) for n in hf_names])
            sd.update(zip(hf_names, parts))
    left = sorted(n for n in weights if not is_scale_name(n))
    if left:
        raise ValueError(f"engine tensors {left[:5]} have no transformers counterpart")
    weights.clear()  # activation / KV-cache scales: the baseline runs unquantized
    return sd, fp8


def _as_run(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> ModelConfig:
    """``cfg`` as the engine runs it: a tied model whose engine has its own lm_head.weight
    (the FP8 lm_head, ``kiln build --quantize-lm-head``) runs untied, the head dequantized."""
    if cfg.tie_word_embeddings and "lm_head.weight" in weights:
        return dataclasses.replace(cfg, tie_word_embeddings=False)
    return cfg


def hf_model_from_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor],
                          dtype: torch.dtype, device: str | torch.device) -> tuple[Any, int]:
    """A transformers CausalLM (eval mode, on ``device``) holding the engine tensors
    ``weights`` (consumed); returns (model, number of dequantized FP8 linears)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = _as_run(cfg, weights)
    config = hf_config(cfg)
    sd, fp8 = hf_state_dict(cfg, weights, dtype)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    del sd
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    bad = [k for k in missing if k not in tied and not k.endswith(".bias")]
    if bad or unexpected:
        raise ValueError(f"transformers {type(model).__name__} does not match the engine "
                         f"weights: missing {bad[:5]}, unexpected {list(unexpected)[:5]}")
    with torch.no_grad():
        for k in missing:
            if k.endswith(".bias"):  # e.g. o_proj.bias under attention_bias: kiln has none
                model.get_parameter(k).zero_()
    if cfg.tie_word_embeddings:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=None,
                                               bos_token_id=cfg.bos_token_id)
    return model.to(device).eval(), fp8


def build_hf_model(engine_dir: str, device: str | torch.device) -> tuple[Any, dict]:
    """A transformers model on ``device`` with an engine directory's weights.

    Returns (model, info); info says the dtype and whether FP8 weights were dequantized.
    Random engines make their weights here exactly as the runtime does (same seed, device).
    """
    from kiln.artifact.loader import load_engine
    from kiln.dtypes import TORCH_DTYPES
    from kiln.runtime.models.calibration import ActivationCalibrator

    device = torch.device(device)
    # What is still allocated before the baseline's weights (the kiln engine should be gone).
    in_use = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    t0 = time.perf_counter()
    art = load_engine(engine_dir, verify_checksums=False)
    dtype = TORCH_DTYPES[art.spec.dtype]
    weights = art.load_weights(device, dtype, calibrator=ActivationCalibrator)
    model, fp8 = hf_model_from_weights(art.spec.model, weights, dtype, device)
    name = str(dtype).removeprefix("torch.")
    return model, {
        "class": type(model).__name__,
        "dtype": name,
        "dequantized_fp8_linears": fp8,
        "weights": (f"FP8 weights dequantized to {name} (w.float() * weight_scale): "
                    f"transformers runs the dequantized model in {name}")
                   if fp8 else f"engine weights in {name}",
        "device": str(device),
        "build_s": time.perf_counter() - t0,
        "cuda_gib_in_use_before": in_use,
    }


# --- helpers ----------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' warnings off (errors still show) while the baseline runs."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _why(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:200]}"


def free_cuda_memory() -> None:
    """Collect garbage and return cached CUDA blocks (call after dropping the kiln engine)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- latency --------------------------------------------------------------------------------


def _generate_config(n: int, *, static: bool, compile_: bool, device: torch.device) -> Any:
    from transformers import CompileConfig, GenerationConfig

    kw: dict[str, Any] = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False,
                          "pad_token_id": 0, "eos_token_id": None}
    if static:
        kw["cache_implementation"] = "static"
    if compile_:
        cc = CompileConfig(mode=COMPILE_MODE)
        if device.type != "cuda":  # transformers auto-compiles only on accelerators
            cc._compile_all_devices = True
        kw["compile_config"] = cc
    else:
        kw["disable_compile"] = True
    return GenerationConfig(**kw)


def _generate(model: Any, prompts: Sequence[Sequence[int]], gen: Any) -> tuple[float, int]:
    """One padded batch through ``model.generate``; (seconds, new tokens generated)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: every row's last prompt token aligns
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    _sync(model.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, generation_config=gen)  # under no_grad
    _sync(model.device)
    return time.perf_counter() - t0, (out.shape[1] - width) * len(prompts)


def run_hf_latency(
    model: Any, warmup_batches: Sequence[Sequence[Sequence[int]]],
    batches: Sequence[Sequence[Sequence[int]]], output_len: int, *, compile_: bool,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Time ``model.generate`` on each batch (after the untimed warm-up batches).

    Tries static cache + compile (when ``compile_``), then static cache eager, then the
    default dynamic cache; ``mode`` names the one that ran and ``fallbacks`` why others did
    not. A compiled run gets one extra warm-up batch (CUDA graph recording).
    """
    ladder = ([("static-cache+compile", True, True)] if compile_ else []) + [
        ("static-cache (eager)", True, False), ("dynamic-cache (eager)", False, False)]
    fallbacks: list[str] = []
    compile_error = None
    for mode, static, comp in ladder:
        gen = _generate_config(output_len, static=static, compile_=comp, device=model.device)
        warm = list(warmup_batches) + ([batches[0]] if comp else [])
        try:
            with _quiet_transformers():
                for b in warm:
                    _generate(model, b, gen)
            iters = []
            for b in batches:
                sec, toks = _generate(model, b, gen)
                iters.append({"latency_s": sec, "output_tokens": toks})
                if progress is not None:
                    progress(1)
        except Exception as e:
            fallbacks.append(f"{mode} failed: {_why(e)}")
            if comp:
                compile_error = _why(e)
                torch._dynamo.reset()
                with contextlib.suppress(AttributeError):
                    del model._compiled_call
            continue
        if comp and getattr(model, "_compiled_call", None) is None:
            mode = "static-cache (eager: transformers did not compile the decode step)"
        elif comp:
            mode = f"static-cache+compile({COMPILE_MODE})"
        elif compile_error:
            mode = f"{mode} (compile failed: {compile_error})"
        tokens = sum(it["output_tokens"] for it in iters)
        seconds = sum(it["latency_s"] for it in iters)
        return {"mode": mode, "fallbacks": fallbacks, "warmup": len(warm),
                "latency_s": summarize([it["latency_s"] for it in iters]),
                "output_tokens": tokens, "elapsed_s": seconds,
                "tokens_per_s": rate(tokens, seconds), "iterations": iters}
    raise RuntimeError("transformers generate failed in every mode: " + "; ".join(fallbacks))


# --- throughput ---------------------------------------------------------------------------


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _cb_config(requests: Sequence[BenchRequest], device: torch.device) -> Any:
    """ContinuousBatchingConfig: transformers' own sizing on CUDA (it sizes the paged cache
    from free memory), a small explicit cache on CPU (auto-sizing there is slow)."""
    import transformers

    cls = getattr(transformers, "ContinuousBatchingConfig", None)
    if cls is None or device.type == "cuda":
        return None
    params = inspect.signature(cls.__init__).parameters
    page = 16
    blocks = sum(-(-(len(r.prompt_token_ids) + r.output_len) // page) for r in requests)
    kw: dict[str, Any] = {"num_blocks": blocks + 4, "max_batch_tokens": 256}
    kw["page_size" if "page_size" in params else "block_size"] = page
    return cls(**{k: v for k, v in kw.items() if k in params})


def _collect(outputs: dict | Sequence) -> tuple[int, int, float | None]:
    """(finished without error, generated tokens, seconds first start -> last finish)."""
    outs = list(outputs.values()) if isinstance(outputs, dict) else list(outputs)
    ok = [o for o in outs if getattr(o, "error", None) is None]
    spans = [getattr(o, "lifespan", None) for o in ok]
    span = None
    if spans and all(s and s[0] > 0 and s[1] > 0 for s in spans):
        span = max(s[1] for s in spans) - min(s[0] for s in spans)
    return len(ok), sum(len(o.generated_tokens) for o in ok), span


def _continuous_batching(model: Any, requests: Sequence[BenchRequest]) -> dict:
    from transformers import GenerationConfig

    lens = {r.output_len for r in requests}
    gen = GenerationConfig(max_new_tokens=max(lens), do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    cb = _cb_config(requests, model.device)
    extra = {"continuous_batching_config": cb} if cb is not None else {}
    prompts = [list(r.prompt_token_ids) for r in requests]
    _sync(model.device)
    t0 = time.perf_counter()
    if len(lens) == 1:
        mode = "generate_batch"
        if not _accepts(model.generate_batch, "continuous_batching_config"):
            extra = {}
        outs = model.generate_batch(prompts, generation_config=gen, progress_bar=False, **extra)
    else:  # one output length per request: the manager behind generate_batch
        mode = "continuous_batching_context_manager (per-request max_new_tokens)"
        cm = model.continuous_batching_context_manager
        if not _accepts(cm, "continuous_batching_config"):
            extra = {}
        outs = {}
        with cm(generation_config=gen, block=True, timeout=5, **extra) as manager:
            for p, r in zip(prompts, requests):
                manager.add_request(p, max_new_tokens=r.output_len)  # EOS -1 from `gen`
            while len(outs) < len(requests):
                res = manager.get_result(timeout=1)
                if res is not None and res.is_finished():
                    outs[res.request_id] = res
                elif res is None and not manager.is_running():
                    break
    _sync(model.device)
    wall = time.perf_counter() - t0
    done, tokens, span = _collect(outs)
    if done != len(requests):
        raise RuntimeError(f"{mode} finished {done} of {len(requests)} requests")
    return {"mode": mode, "output_tokens": tokens, "wall_s": wall,
            "elapsed_s": span if span else wall,
            "timed": "first request scheduled -> last finished (transformers' request "
                     "timestamps; manager set-up and CUDA-graph warm-up excluded)"
            if span else "whole call"}


def _padded_batches(model: Any, requests: Sequence[BenchRequest], batch_size: int) -> dict:
    """Fallback: batches of ``batch_size`` (sorted by prompt length), each generating its
    longest output length; only the tokens each request asked for are counted."""
    order = sorted(requests, key=lambda r: len(r.prompt_token_ids))
    total, tokens = 0.0, 0
    for i in range(0, len(order), batch_size):
        chunk = order[i:i + batch_size]
        n = max(r.output_len for r in chunk)
        gen = _generate_config(n, static=False, compile_=False, device=model.device)
        sec, made = _generate(model, [r.prompt_token_ids for r in chunk], gen)
        if made != n * len(chunk):
            raise RuntimeError(f"generate made {made} tokens, expected {n * len(chunk)}")
        total += sec
        tokens += sum(r.output_len for r in chunk)
    return {"mode": f"padded-batches(generate, batch {batch_size}, eager)",
            "output_tokens": tokens, "elapsed_s": total, "wall_s": total,
            "timed": "sum of generate calls"}


def run_hf_throughput(model: Any, requests: Sequence[BenchRequest], *,
                      fallback_batch_size: int = 64) -> dict:
    """All ``requests`` through transformers continuous batching (or padded batches).

    An untimed two-request warm-up runs first. Returns mode, tokens, seconds, tokens/s.
    """
    fallbacks: list[str] = []
    r: dict | None = None
    if hasattr(model, "generate_batch"):
        try:
            warm = [BenchRequest(list(requests[0].prompt_token_ids[:16]), 4)] * 2
            with _quiet_transformers():
                _continuous_batching(model, warm)
                r = _continuous_batching(model, requests)
        except Exception as e:
            fallbacks.append(f"continuous batching failed: {_why(e)}")
    else:
        fallbacks.append(f"transformers {transformers_version()} has no generate_batch")
    if r is None:
        _padded_batches(model, requests[:2], 2)
        r = _padded_batches(model, requests, max(1, min(fallback_batch_size, len(requests))))
    expected = sum(x.output_len for x in requests)
    return {**r, "fallbacks": fallbacks, "num_requests": len(requests),
            "prompt_tokens": sum(len(x.prompt_token_ids) for x in requests),
            "expected_output_tokens": expected,
            "tokens_per_s": rate(r["output_tokens"], r["elapsed_s"])}


# --- the baseline object in a result ----------------------------------------------------------


def baseline_record(run: dict, info: dict, kiln_tokens_per_s: float, **extra: Any) -> dict:
    """The ``baseline`` object of a bench result: transformers' numbers and kiln / hf."""
    hf_tps = run["tokens_per_s"]
    return {
        "name": "transformers",
        "version": transformers_version(),
        "mode": run["mode"],
        "tokens_per_s": hf_tps,
        "kiln_tokens_per_s": kiln_tokens_per_s,
        "ratio": kiln_tokens_per_s / hf_tps if hf_tps > 0 else None,
        "ratio_basis": "kiln output tokens/s / transformers output tokens/s",
        "sampling": "greedy (kiln's benchmark samples at temperature 1)",
        **info,
        **extra,
        **{k: v for k, v in run.items() if k not in ("mode", "tokens_per_s")},
    }
