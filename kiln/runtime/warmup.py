"""Start-up warm-up: the kernel variants serving needs that graph capture does not compile.

CUDA graph capture compiles what the graphs run. Outside them run eager steps (prefill chunks
and batches no graph bucket fits) and the sampler. Left to the first request that needs one,
each new Triton variant (a JIT compile, or a load from the on-disk cache) and each torch
kernel module loaded lazily stalls the engine thread while every request waits: 0.5-1.9 s
per Triton variant on a cold cache and 0.1-0.3 s for the first top-k / top-p / seeded
request (docs/decisions.md).
So the engine runs each once at start-up, on dummy inputs, before it reports ready (vLLM
likewise runs a dummy sampler pass at start-up).

What varies between eager launches is bounded by the kernels themselves (sequence and split
counts are runtime arguments, see kiln/runtime/kernels/paged_attention.py): attention has one
variant per query class (decode / multi / prefill) x (keys split or not) x (tree mask or not)
and the split reduce one per width (16, 32, 64); the sampling kernels one scalar-temperature
and one per-row variant.
"""

from __future__ import annotations

import dataclasses

import torch

from kiln.runtime.sampling_params import SamplingParams

# The kernel modules are imported where used: importing one builds its kernels, compiled or
# interpreted as TRITON_INTERPRET says at that moment (the engine imports this module).


def eager_shapes(max_tokens: int, capacity: int, tokens_per_step: int = 1) -> list[tuple]:
    """(num_tokens, key-split count, masked) of the dummy eager forwards: each query class
    (1, 2 and 64 tokens of one sequence) with one split and with two; one token with each
    wider reduce width a context within ``capacity`` can reach (32 keys per split at the
    least); for speculative engines the masked step with one split and two."""
    from kiln.runtime.kernels.paged_attention import MAX_SPLITS, reduce_width

    shapes = [(t, s, False) for t in (1, 2, 64) if t <= max_tokens for s in (1, 2)]
    most = min(MAX_SPLITS, -(-capacity // 32))
    shapes += [(1, w, False) for w in sorted({reduce_width(s) for s in range(3, most + 1)})
               if w > reduce_width(2)]
    if 1 < tokens_per_step <= max_tokens:
        shapes += [(tokens_per_step, s, True) for s in (1, 2)]
    return shapes


def warm_eager_forward(model, cache, stager, tokens_per_step: int = 1) -> int:
    """Run the model eagerly on all-padding steps (no KV writes: slots -1) for every shape of
    ``eager_shapes``; returns how many ran. The stager's buffers are left as a padding step."""
    capacity = stager.max_blocks * stager.block_size
    shapes = eager_shapes(stager.max_tokens, capacity, tokens_per_step)
    d = stager.d
    for t, splits, masked in shapes:
        stager.fill_dummy(0, t)  # sequence 0 holds the t tokens; its keys: block 0
        meta = dataclasses.replace(stager.metadata(1, t, t, t, masked), num_splits=splits)
        model.forward(d["input_ids"][:t], d["positions"][:t], cache, meta, d["logit_rows"][:1])
    return len(shapes)


def warm_sampler(sampler, vocab: int, device: torch.device) -> None:
    """Every sampling path once on dummy logits: the kernels (one temperature or per-row
    temperatures, each with the step's seed or with seeded rows' own keys) and the torch
    paths (top-k, top-p, min-p, seeded rows drawn on the host, logprobs, repetition
    penalty)."""
    logits = torch.linspace(-4.0, 4.0, vocab, device=device).repeat(2, 1)
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    seeded = SamplingParams(temperature=1.0, seed=0)
    gen = torch.Generator().manual_seed(0)
    for params, gens in (([greedy, greedy], [None, None]), ([hot, hot], [None, None]),
                         ([greedy, SamplingParams(temperature=0.7)], [None, None]),
                         ([seeded, seeded], [gen, gen]), ([seeded, greedy], [gen, None])):
        sampler.choose(logits, params, gens)
    rows = [SamplingParams(top_k=50, top_p=0.9, min_p=0.05, logprobs=2,
                           repetition_penalty=1.1),
            SamplingParams(seed=0, temperature=0.8)]
    sampler(logits, rows, [[1, 2, 3], [4]], [None, gen])
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_moved_rows(runner) -> None:
    """The kernel that moves a draft model's steps launched ahead on by what the step in
    flight committed (``ModelRunner.execute(counts=)``: its catch-up of two tokens a
    sequence and its decode steps), compiled once with nothing to move (counts 1)."""
    from kiln.runtime.speculative.device_step import shift_rows

    one = torch.ones(1, dtype=torch.long, device=runner.device)
    for t in (1, 2):
        shift_rows(runner.moved_entries(1, t), runner.stager.staged_rows(), one, t, True)
    torch.cuda.synchronize(runner.device)
