"""The quality gate of `kiln quantize`: the perplexity of the source and of the FP8
checkpoint on an evaluation text set, side by side.

The source runs as the transformers model; the checkpoint as the engine `kiln build` makes
of it (``engine_perplexity``), so the number is what a user of the checkpoint gets: the
fused q/k/v and gate/up requantized to one scale, kiln's FP8 GEMMs and its FP8 KV cache
included. modelopt's own emulation (its quantizers in the transformers model) misses some
of that: on smollm2-135m it scored +2.7 % where the engine scores +3.3 %. Both score the
windows ``kiln eval perplexity`` scores (the built-in ``eval`` set or a file, cut into
windows of ``seq_len`` tokens; the first token of a window is not scored). A rise past
``max_loss`` stops the command before anything is written, unless it is allowed.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

DEFAULT_MAX_LOSS = 0.05  # +5 % perplexity
DEFAULT_SEQ_LEN = 512
# --kv-cache-dtype auto leaves the FP8 KV cache out when that alone brings the checkpoint
# within this rise (or within --max-quality-loss, when lower)
KV_QUALITY_TARGET = 0.03


def hf_perplexity(model: Any, windows: list[list[int]], device: str,
                  advance: Callable[[], None] = lambda: None) -> float:
    """exp(mean next-token NLL) of a transformers causal LM over ``windows``."""
    import torch
    import torch.nn.functional as F

    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w], device=device)
            logits = model(ids, use_cache=False).logits[0, :-1].float()
            nll += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            count += len(w) - 1
            advance()
    return math.exp(nll / count)


def engine_perplexity(checkpoint: Path, windows: list[list[int]], *, dtype: str,
                      kv_fp8: bool, device: str,
                      advance: Callable[[], None] = lambda: None) -> float:
    """The perplexity over ``windows`` of the engine `kiln build` makes of ``checkpoint`` in
    ``dtype`` (its KV cache FP8 with the checkpoint's K/V scales, or in ``dtype``), built
    into a temporary directory beside it and removed after."""
    from kiln.artifact.spec import QuantConfig
    from kiln.builder.writer import build_engine
    from kiln.eval.perplexity import scoring_engine, windows_perplexity

    seq_len = max(len(w) for w in windows)
    with tempfile.TemporaryDirectory(prefix=f".{checkpoint.name}.scoring-",
                                     dir=checkpoint.parent) as tmp:
        engine_dir = Path(tmp) / "engine"
        build_engine(str(checkpoint), engine_dir, dtype=dtype, max_seq_len=seq_len,
                     max_batch_size=1, quantization=QuantConfig(kv_cache="fp8" if kv_fp8
                                                                else dtype),
                     progress=False, tune=False, generation_config="none",
                     tool_parser="none")
        engine = scoring_engine(engine_dir, seq_len, device)
        try:
            return windows_perplexity(engine, windows, advance)[0]
        finally:
            engine.close()


def kv_limit(max_loss: float) -> float:
    """The rise past which --kv-cache-dtype auto measures the checkpoint without FP8 KV."""
    return min(max_loss, KV_QUALITY_TARGET)


def kv_cache_left_out(source: float, with_kv: float, without_kv: float, max_loss: float) -> bool:
    """--kv-cache-dtype auto's rule: leave the FP8 KV cache out when that alone brings the
    checkpoint within a limit it is past with it: ``kv_limit(max_loss)``, or ``max_loss``."""
    rise, rise_without = with_kv / source - 1, without_kv / source - 1
    return without_kv < with_kv and any(rise > limit >= rise_without
                                        for limit in (kv_limit(max_loss), max_loss))


def quality_record(source: float, quantized: float, windows: list[list[int]], seq_len: int,
                   provenance: dict[str, Any], max_loss: float, scored_by: str
                   ) -> dict[str, Any]:
    """What the checkpoint's kiln_quantize.json keeps of the comparison (``scored_by``: what
    ran the checkpoint)."""
    return {"source_perplexity": round(source, 4), "quantized_perplexity": round(quantized, 4),
            "increase": round(quantized / source - 1, 4), "max_increase": max_loss,
            "eval_tokens": sum(len(w) - 1 for w in windows), "eval_seq_len": seq_len,
            "scored_by": scored_by,
            **{f"eval_{k}": v for k, v in provenance.items()}}


def summary_line(q: dict[str, Any]) -> str:
    """``perplexity on builtin:eval (2,345 tokens): source 18.92, FP8 19.17 (+1.32%)``."""
    return (f"perplexity on {q['eval_data']} ({q['eval_tokens']:,} tokens): source "
            f"{q['source_perplexity']:.2f}, FP8 {q['quantized_perplexity']:.2f} "
            f"({q['increase']:+.2%})")


# what to try when a scheme loses the model: the other one
OTHER_QFORMAT = {
    "fp8": "--qformat fp8_pc_pt (a weight scale per output channel, activations per token)",
    "fp8_pc_pt": "--qformat fp8 (per-tensor weights, static activation scales)",
}


def check(q: dict[str, Any], allow: bool, qformat: str = "fp8", fp8_kv: bool = True) -> None:
    """One clear error when the rise is past the limit and not allowed, naming the options
    to try: the other FP8 scheme, the KV cache left unquantized (where it is FP8), the
    calibration text, exclusions."""
    if allow or q["increase"] <= q["max_increase"]:
        return
    kv = "--kv-cache-dtype none (the KV cache stays in the model's dtype), " if fp8_kv else ""
    raise KilnError(
        f"FP8 raises perplexity on {q['eval_data']} from {q['source_perplexity']:.2f} to "
        f"{q['quantized_perplexity']:.2f} ({q['increase']:+.1%}), past --max-quality-loss "
        f"{q['max_increase']:.0%}; nothing was written. Try {OTHER_QFORMAT[qformat]}, {kv}"
        "more or closer calibration text (--calib-size, --calib-data FILE like your traffic) "
        "or --exclude for the layers that lose most; or keep this checkpoint with "
        "--allow-quality-loss")
