"""Token-weighted perplexity of an engine over a text set (built-in eval set or a file).

The text is tokenized (each document wrapped in bos/eos when the tokenizer has them),
concatenated and cut into non-overlapping windows of ``seq_len`` tokens. Each window runs
as one prefill through the engine's model into its own KV cache (so an FP8 KV cache is
exercised exactly as in serving: K/V are stored and read back quantized), with logits for
every position. Token t of a window is scored given tokens 0..t-1 of that window; the first
token of each window is not scored. perplexity = exp(sum NLL / scored tokens).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_SEQ_LEN = 512


def window_nll(engine: Any, ids: list[int]) -> float:
    """Sum of next-token NLLs of ``ids[1:]`` given their prefixes, one prefill through
    ``engine.model`` into ``engine.cache`` (slots 0..len-1; the engine must be idle)."""
    import torch
    import torch.nn.functional as F

    from kiln.runtime.layers.attention import AttentionMetadata, SeqAttention

    dev = engine.device
    n = len(ids)
    slots = torch.arange(n, device=dev)
    meta = AttentionMetadata(slot_mapping=slots, seqs=[
        SeqAttention(query_start=0, query_len=n, context_len=n, key_slots=slots)])
    tokens = torch.tensor(ids, dtype=torch.long, device=dev)
    logits = engine.model.forward(tokens, slots, engine.cache, meta, slots[:-1])  # [n-1, V]
    return float(F.cross_entropy(logits.float(), tokens[1:], reduction="sum"))


def windows_perplexity(engine: Any, windows: list[list[int]],
                       advance: Callable[[], None] = lambda: None) -> tuple[float, int]:
    """(exp(mean next-token NLL), tokens scored) of ``engine`` over ``windows`` (``advance``
    after each window)."""
    nll, count = 0.0, 0
    for w in windows:
        nll += window_nll(engine, w)
        count += len(w) - 1
        advance()
    return math.exp(nll / count), count


def scoring_engine(engine_dir: str | Path, max_seq_len: int, device: str | None) -> Any:
    """The engine of ``engine_dir`` with a KV cache of one ``max_seq_len`` sequence (windows
    reuse slots 0..seq_len-1) and no prefix cache."""
    from kiln.runtime.engine import LLMEngine, RuntimeConfig

    block_size = RuntimeConfig().block_size
    return LLMEngine.from_engine_dir(engine_dir, RuntimeConfig(
        device=device, block_size=block_size, num_kv_blocks=-(-max_seq_len // block_size),
        enable_prefix_caching=False))


def perplexity(
    engine_dir: str | Path, *, data: str | Path | None = None, seq_len: int = DEFAULT_SEQ_LEN,
    device: str | None = None, progress: bool = True,
) -> dict[str, Any]:
    """{"perplexity", "tokens" (scored), "windows", "seq_len", "data", "seconds"}.
    ``progress``: a bar on stderr, from the first import to the last window (shown only
    when stderr is a terminal)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    t0 = time.perf_counter()
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                   disable=not progress)
    with bar:  # loading takes seconds (torch, weights, CUDA graphs) before the first window
        loading = bar.add_task(f"Loading {engine_dir}", total=None)
        engine, spec, text, windows, seq_len = _load(engine_dir, data, seq_len, device)
        bar.remove_task(loading)
        task = bar.add_task("[bold]Perplexity[/]", total=len(windows))
        ppl, count = windows_perplexity(engine, windows, lambda: bar.advance(task))
    q = spec.quantization
    return {
        "perplexity": ppl,
        "tokens": count,
        "windows": len(windows),
        "seq_len": seq_len,
        **text.provenance,
        "engine": str(engine_dir),
        "dtype": spec.dtype,
        "quantization": {"weights": q.weights, "activations": q.activations,
                         "kv_cache": q.kv_cache, "lm_head": q.lm_head},
        "device": str(engine.device),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _load(engine_dir: str | Path, data: str | Path | None, seq_len: int,
          device: str | None) -> tuple[Any, Any, Any, list[list[int]], int]:
    """(engine, its spec, the text set, the windows of token ids, the window length)."""
    from kiln.artifact.loader import load_engine
    from kiln.errors import KilnError
    from kiln.quantize.calib import eval_windows, load_text_set

    spec = load_engine(engine_dir).spec
    seq_len = min(seq_len, spec.limits.max_seq_len)
    if seq_len < 2:
        raise KilnError(f"--seq-len must be >= 2, got {seq_len}")
    engine = scoring_engine(engine_dir, spec.limits.max_seq_len, device)
    text = load_text_set(data, "eval")
    return engine, spec, text, eval_windows(engine.tokenizer, text, seq_len), seq_len
