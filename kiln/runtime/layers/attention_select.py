"""Which attention backend runs each step class: measured once at build, recorded in
engine.json ``attention``, read at load.

A step's class (``step_class``, kiln/runtime/layers/attention.py) is what its attention
metadata says: ``decode`` (one query token per sequence), ``prompt`` (a prompt, or prompt
chunks beside decodes: some sequence has more than one query token and there is no tree
mask) or ``tree`` (a speculative step with a tree mask). ``measure`` times each candidate
backend's attention call, one layer at the engine's shapes, on problems of each class::

    decode  batch 1 at min(8000, max_seq_len) tokens of context; batch min(64, max_batch_size)
            at min(1024, max_seq_len)
    prompt  one prompt of min(8192, max_num_tokens, max_seq_len) tokens ("prefill"); up to 8
            512-token prompt chunks (the first at 4096 tokens of context) beside up to 63
            decodes at 1024 ("mixed", the steps of a busy server)
    tree    (lookahead engines) min(8, batch the budget allows) sequences of tokens_per_step
            masked queries at 512 tokens of context

(GPU time of CUDA-graph replays, ``time_cuda``: launch overhead is not in the numbers; both
backends capture) and ``choose`` keeps, per class, the fastest backend that supports the
class and agrees with Triton's output (a backend never changes results beyond rounding), and
only when it beats Triton by ``WIN_MARGIN`` (timing noise never flips a choice). engine.json ``attention``::

    {"backend": "flash-attn", "source": "measured", "classes": {"decode": "triton",
     "prompt": "flash-attn", "tree": "triton"}, "gpu": ..., "measured_at": ..., "measure_s":
     ..., "stats": {problem: {"class", "us": {backend: us}, "compile_s": {backend: s}}},
     "skipped": {backend: reason}}

or ``{"backend": name, "source": "--attention-backend"}`` (a build flag), or
``{"backend": "auto", "source": "default", "reason": ...}`` (nothing measured: the runtime
picks as before: Triton on CUDA, the torch reference elsewhere). Which backends support a
class is ``SUPPORTS``: flash-attn-4 has no tree masks, and kiln runs decode steps inside CUDA
graphs, where it does not run flash-attn-4 (kiln/runtime/layers/flash_attention.py: each
launch configuration compiles for seconds at start-up). For the same reason a prompt step
small enough for the prefill graphs (RuntimeConfig.max_graph_tokens)
runs Triton's kernels whatever the choice; the prompt problems are the eager steps' sizes.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kiln.runtime import env
from kiln.runtime.layers.attention import STEP_CLASSES

if TYPE_CHECKING:
    from kiln.artifact.spec import Limits
    from kiln.config import ModelConfig

# Backends a build measures, and the step classes each can run (Triton runs every class).
SUPPORTS: dict[str, tuple[str, ...]] = {"triton": STEP_CLASSES, "flash-attn": ("prompt",)}
# What is timed (for the record) beyond what can be chosen: flash-attn-4 at decode, which it
# cannot run inside kiln's decode graphs.
TIMED: dict[str, tuple[str, ...]] = {"triton": STEP_CLASSES, "flash-attn": ("decode", "prompt")}
# A backend must take at most this fraction of Triton's time (summed over the class's
# problems) to be chosen over it.
WIN_MARGIN = 0.95
# Two backends agree when ‖out − triton‖ / ‖triton‖ is at most this: 16-bit rounding of
# different accumulation orders (~4e-3 measured), not a wrong result.
AGREE = 2e-2
DEFAULT = {"backend": "auto", "source": "default"}


def problems(model: ModelConfig, limits: Limits, tokens_per_step: int = 1,
             tree: bool = False) -> list[dict]:
    """The problems timed per class: ``{"name", "class", "seqs": [[prefix, query_len]...],
    "tree"}`` at the engine's limits (see the module docstring)."""
    seq, budget, batch = limits.max_seq_len, limits.max_num_tokens, limits.max_batch_size
    long = min(8000, seq)
    out = [{"name": f"decode b1 ctx{long}", "class": "decode", "seqs": [[long - 1, 1]]}]
    if batch > 1:
        ctx, b = min(1024, seq), min(64, batch)
        out.append({"name": f"decode b{b} ctx{ctx}", "class": "decode",
                    "seqs": [[ctx - 1, 1]] * b})
    n = min(8192, budget, seq)
    if n > 1:
        out.append({"name": f"prefill {n}", "class": "prompt", "seqs": [[0, n]]})
    chunk = min(512, budget // 2, seq // 2)
    if chunk > 1 and batch > 1:  # prompt chunks beside decodes, as a busy server steps
        ctx = min(4096, seq)
        decodes = min(63, batch - 1, budget - chunk)
        prompts = max(1, min(8, batch - decodes, (budget - decodes) // chunk))
        out.append({"name": f"mixed {prompts}x{chunk} + {decodes} decodes", "class": "prompt",
                    "seqs": [[ctx - chunk, chunk]] + [[0, chunk]] * (prompts - 1)
                    + [[min(1024, seq) - 1, 1]] * decodes})
    q = tokens_per_step
    if tree and 1 < q < seq - 512:
        b = max(1, min(8, batch, budget // q))
        out.append({"name": f"tree b{b} q{q} ctx{512 + q}", "class": "tree",
                    "seqs": [[512, q]] * b, "tree": True})
    return [{"tree": False, **p} for p in out]


def choose(stats: dict[str, dict], candidates: tuple[str, ...]) -> dict[str, str]:
    """Per step class, the backend of least total time over the class's problems among
    ``candidates`` that support the class and ran every one of them; Triton unless another
    beats it by WIN_MARGIN. ``stats``: {problem name: {"class", "us": {backend: us}}}."""
    classes = {}
    for cls in STEP_CLASSES:
        rows = [s["us"] for s in stats.values() if s["class"] == cls]
        if not rows:
            classes[cls] = "triton"
            continue
        totals = {b: sum(r[b] for r in rows) for b in candidates
                  if cls in SUPPORTS.get(b, ()) and all(b in r for r in rows)}
        best = min(totals, key=totals.get, default="triton")
        base = totals.get("triton")
        if best != "triton" and base is not None and totals[best] > WIN_MARGIN * base:
            best = "triton"
        classes[cls] = best
    return classes


def section_backend(classes: dict[str, str]) -> str:
    """The registry name that runs ``classes``: flash-attn when it runs any class."""
    return "flash-attn" if "flash-attn" in classes.values() else "triton"


def measured(model: ModelConfig, limits: Limits, dtype: torch.dtype, kv_dtype: torch.dtype,
             device: torch.device, tokens_per_step: int = 1, tree: bool = False,
             candidates: tuple[str, ...] = ("triton", "flash-attn"),
             progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """The engine.json ``attention`` section from timing ``candidates`` on this GPU."""
    from kiln.runtime.kernels.testing import rel_err
    from kiln.runtime.kernels.tunable import time_cuda
    from kiln.runtime.kernels.tuning import device_identity

    t0 = time.perf_counter()
    runners, skipped = _runners(candidates, dtype, kv_dtype, model.head_dim)
    probs = problems(model, limits, tokens_per_step, tree)
    stats: dict[str, dict] = {}
    for i, p in enumerate(probs):
        if progress is not None:
            progress(p["name"], i, len(probs))
        batch = _batch(p, model, dtype, kv_dtype, device)
        row: dict[str, Any] = {"class": p["class"], "us": {}, "compile_s": {}}
        ref = None
        for name, run in runners.items():
            if p["class"] not in TIMED[name]:
                continue
            try:
                tc = time.perf_counter()
                out = run(batch, model.head_dim ** -0.5)
                torch.cuda.synchronize(device)
                row["compile_s"][name] = round(time.perf_counter() - tc, 3)
                if ref is None:
                    ref = out
                elif (err := rel_err(out, ref)) > AGREE:
                    skipped[name] = (f"output differs from triton's on {p['name']} (relative "
                                     f"error {err:.2g} > {AGREE})")
                    continue
                row["us"][name] = round(time_cuda(
                    lambda _, run=run, batch=batch: run(batch, model.head_dim ** -0.5), device)
                    * 1e6, 1)
            except Exception as e:  # a backend that fails a shape is not chosen for it
                skipped[name] = f"{type(e).__name__}: {e}"[:200]
        stats[p["name"]] = row
    if progress is not None:
        progress("done", len(probs), len(probs))
    usable = tuple(b for b in runners if b not in skipped)
    classes = choose(stats, usable)
    ident = device_identity(device)
    return {"backend": section_backend(classes), "source": "measured", "classes": classes,
            "gpu": ident.get("gpu"), "measured_at": datetime.date.today().isoformat(),
            "measure_s": round(time.perf_counter() - t0, 1), "stats": stats,
            "skipped": skipped}


def _runners(candidates: tuple[str, ...], dtype: torch.dtype, kv_dtype: torch.dtype,
             head_dim: int) -> tuple[dict[str, Callable], dict[str, str]]:
    """One attention call per usable candidate (q, caches, metadata → out), and why the
    others are not measured."""
    from kiln.runtime.layers.flash_attention import DTYPES, HEAD_DIMS, FlashAttention
    from kiln.runtime.layers.triton_attention import TritonAttention

    runners: dict[str, Callable] = {}
    skipped: dict[str, str] = {}
    for name in candidates:
        if name == "triton":
            runners[name] = lambda b, s: TritonAttention._attend(b[0], b[1], b[2], b[3], s,
                                                                 1.0, 1.0)
        elif name == "flash-attn":
            if dtype not in DTYPES or kv_dtype != dtype:
                skipped[name] = (f"flash-attn-4 needs a bfloat16/float16 engine with a KV "
                                 f"cache of the same dtype (this one: {dtype}, KV {kv_dtype})")
                continue
            if head_dim not in HEAD_DIMS:
                skipped[name] = f"flash-attn-4 has no kernels for head size {head_dim}"
                continue
            fa = FlashAttention(classes=("prompt", "decode"))
            if fa.varlen is None:
                skipped[name] = "flash-attn-4 is not installed (pip install 'kiln-llm[flash-attn]')"
                continue
            runners[name] = lambda b, s, fa=fa: fa.flash(b[0], b[1], b[2], b[3], s)
        else:
            raise ValueError(f"attention backend {name!r} cannot be measured; measured are "
                             f"{sorted(SUPPORTS)}")
    return runners, skipped


def _batch(p: dict, model: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype,
           device: torch.device) -> tuple:
    """(q, k cache, v cache, device metadata) of problem ``p``, seeded."""
    from kiln.runtime.kernels.testing import random_paged_batch
    from kiln.runtime.layers.triton_attention import TritonAttentionMetadata

    with torch.random.fork_rng(devices=[device]):
        torch.manual_seed(0)
        b = random_paged_batch([(pre, n, p["tree"]) for pre, n in p["seqs"]], model.num_heads,
                               model.num_kv_heads, model.head_dim, 16, dtype, device,
                               cache_dtype=kv_dtype, layout=env.kv_layout())
    dm = TritonAttentionMetadata(
        block_tables=b.block_tables, query_start_loc=b.query_start_loc,
        context_lens=b.context_lens, max_query_len=b.max_query_len,
        max_context_len=b.max_context_len, mask=b.mask, mask_offsets=b.mask_offsets)
    return b.q, b.k_cache, b.v_cache, dm
