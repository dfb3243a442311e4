"""What each kind of kernel costs a batch-1 llama-3-8b decode step *in the chain*: one engine
per variant, the CUDA graph captured with that kernel replaced by nothing (or the attention
split count forced), then the graph replay on dummy inputs and whole engine steps of one
greedy 128-token request after each prompt length (``--prompt-lens``). A removed kernel's
delta is what a perfect fusion of it could save; the outputs of ablated variants are garbage
(timing only). Random weights, FP8 (or bf16) llama-3-8b, max batch 8.

    PYTHONPATH=.:scripts python3 scripts/ablate_step.py [--quant fp8] [--variants base,...]
        [--prompt-lens 128,1792]

A benchmark, not a test. Prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch
from step_gap import steps_ms  # scripts/ is on sys.path when run as a script

from kiln.builder import QuantConfig, build_engine
from kiln.runtime import cuda_graph, staging
from kiln.runtime.engine import LLMEngine, RuntimeConfig
from kiln.runtime.kernels import _pdl, gemv, paged_attention, rms_norm, rotary
from kiln.runtime.models import llama
from kiln.runtime.sampling_params import SamplingParams


def _splits(n: int):
    return lambda *a, **k: n


def _replay_view(self, b, num_rows):
    """CudaGraphRunner.replay without the logits copy (timing only)."""
    self.replays[b] = self.replays.get(b, 0) + 1
    graph = self.graphs.get(b)
    if graph is None:
        return self._forward(b)[:num_rows]
    graph.replay()
    return self.outputs[b][:num_rows]


def _no_gemv(x, w, *a, **k):
    return torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)


def _no_residual_gemv(x, w, scale, bias, residual, *a, **k):
    """gemv_add_residual_weighted without its kernel: (h, h * g, ss) of the right shapes."""
    h = torch.empty_like(residual)
    return h, torch.empty_like(h), torch.ones(1, device=x.device)


def _no_scaled_gemv(hg, ss, eps, w, *a, **k):
    return _no_gemv(hg, w)


PATCHES = {  # variant: [(module, attribute, replacement)]
    "base": [],
    "no_rotary_kv": [(rotary, "rotary_and_cache_", lambda *a, **k: None)],
    "no_attention": [(paged_attention, "paged_attention", lambda q, *a, **k: q)],
    **{f"splits{n}": [(paged_attention, "choose_num_splits", _splits(n))]
       for n in (1, 2, 4, 8, 32, 64)},
    "w_evict_normal": [(gemv, "WEIGHT_EVICT", "")],  # before weights loaded evict_first
    "noskip": [(paged_attention, "SKIP_EMPTY_SPLITS", False)],  # before the empty-split exit
    **{f"noskip_splits{n}": [(paged_attention, "SKIP_EMPTY_SPLITS", False),
                             (paged_attention, "choose_num_splits", _splits(n))]
       for n in (4, 8, 32)},
    "no_gemv": [(gemv, "gemv", _no_gemv),  # and the batch-1 fused pairs (not re-run since)
                (gemv, "gemv_add_residual_weighted", _no_residual_gemv),
                (gemv, "gemv_rms_scaled", _no_scaled_gemv)],
    "norm4096": [(gemv, "NORM_PROLOGUE_MAX_K", 4096)],  # add + RMSNorm into qkv / gate_up
    "no_staged_early": [(_pdl, "STAGED_EARLY", False)],  # metadata read after the wait
    "no_kv_prefetch": [(paged_attention, "KV_PREFETCH_TILES", 0)],
    "kv_prefetch_split": [(paged_attention, "KV_PREFETCH_TILES", 64)],  # the whole split
    "no_res_fusion": [(gemv, "RESIDUAL_FUSION", False)],  # GEMV, norm kernel, GEMV
    "no_norm_epi": [(gemv, "NORM_EPILOGUE", False)],  # 8B: GEMV, norm kernel, GEMV
    "torch_ends": [(llama, "FUSED_ENDS", False)],  # F.embedding, add, index_select, .float()
    "upload_inline": [(staging, "UPLOAD_STREAM", False)],  # the upload in the compute stream
    "no_clone": [(cuda_graph.CudaGraphRunner, "replay", _replay_view)],  # logits not copied
    # the layers' add + RMSNorm kernels (x and the residual passed on untouched)
    "no_norm": [(rms_norm, "fused_add_rms_norm", lambda x, r, *a, **k: (x, r))],
    "norm_w_late": [(rms_norm, "WEIGHT_EARLY", False)],  # the norm weight after the wait
}


@contextlib.contextmanager
def patched(items):
    old = [(m, a, getattr(m, a)) for m, a, _ in items]
    for m, a, f in items:
        setattr(m, a, f)
    try:
        yield
    finally:
        for m, a, f in old:
            setattr(m, a, f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", default="fp8")
    ap.add_argument("--variants", default=",".join(PATCHES))
    ap.add_argument("--prompt-lens", default="128", help="contexts to decode at, e.g. 128,1792")
    ap.add_argument("--lm-head", default="none", help="fp8: the engine's lm_head in FP8")
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp()) / "l3"
    build_engine("random:llama-3-8b", path, dtype="bfloat16", max_seq_len=2048,
                 max_num_tokens=8192, max_batch_size=8, progress=False,
                 quantization=QuantConfig(weights=args.quant if args.quant == "fp8" else "none",
                                          lm_head=args.lm_head))
    rows = []
    for name in args.variants.split(","):
        with patched(PATCHES[name]):
            eng = LLMEngine.from_engine_dir(path, RuntimeConfig(device="cuda", max_num_seqs=8))
            g = eng.runner.graphs
            b = next(b for b in g.buckets if b.num_seqs == 1 and not b.masked)
            replay = statistics.median(g.replay_ms(b, iters=30) for _ in range(3))
            eng.generate([list(range(1000, 1128))],
                         SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            p = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
            for plen in (int(v) for v in args.prompt_lens.split(",")):
                prompt = [1000 + i % 5000 for i in range(plen)]
                step = statistics.median(steps_ms(eng, p, prompt)[0] for _ in range(3))
                rows.append((name, plen, replay, step))
                print(f"{name} prompt {plen}: replay {replay:.3f} ms, engine step {step:.3f} ms",
                      flush=True)
            del eng, g
            gc.collect()
            torch.cuda.empty_cache()
    base = {plen: step for n, plen, _, step in rows if n == "base"}
    print(f"\n{torch.cuda.get_device_name()} {time.strftime('%Y-%m-%d')}, llama-3-8b "
          f"{args.quant}, batch 1")
    print("| variant | prompt | replay ms (dummy, context 1) | engine step ms (128 new tokens) "
          "| step delta vs base |")
    print("|---|---|---|---|---|")
    for n, plen, r, s in rows:
        d = f"{s - base[plen]:+.3f}" if plen in base else ""
        print(f"| {n} | {plen} | {r:.3f} | {s:.3f} | {d} |")


if __name__ == "__main__":
    main()
