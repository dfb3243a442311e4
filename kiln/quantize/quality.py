"""The quality gate of `kiln quantize`: the perplexity of the source and of the calibrated
model on an evaluation text set, side by side.

Both run through the same transformers model, before and after ``mtq.quantize`` (after it,
modelopt's quantizers emulate FP8 weights, activations and, where calibrated, the KV cache),
on the windows ``kiln eval perplexity`` scores (the built-in ``eval`` set or a file, cut into
windows of ``seq_len`` tokens; the first token of a window is not scored). A rise past
``max_loss`` stops the command before anything is written, unless it is allowed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from kiln.errors import KilnError

DEFAULT_MAX_LOSS = 0.05  # +5 % perplexity
DEFAULT_SEQ_LEN = 512


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


def quality_record(source: float, quantized: float, windows: list[list[int]], seq_len: int,
                   provenance: dict[str, Any], max_loss: float) -> dict[str, Any]:
    """What the checkpoint's kiln_quantize.json keeps of the comparison."""
    return {"source_perplexity": round(source, 4), "quantized_perplexity": round(quantized, 4),
            "increase": round(quantized / source - 1, 4), "max_increase": max_loss,
            "eval_tokens": sum(len(w) - 1 for w in windows), "eval_seq_len": seq_len,
            **{f"eval_{k}": v for k, v in provenance.items()}}


def summary_line(q: dict[str, Any]) -> str:
    """``perplexity on builtin:eval (2,345 tokens): source 18.92, FP8 19.17 (+1.3 %)``."""
    return (f"perplexity on {q['eval_data']} ({q['eval_tokens']:,} tokens): source "
            f"{q['source_perplexity']:.2f}, FP8 {q['quantized_perplexity']:.2f} "
            f"({q['increase']:+.1%})")


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
