"""Token selection: penalties, temperature, top-k, top-p, min-p, seeded sampling, logprobs."""

from __future__ import annotations

import torch

from kiln.runtime.outputs import TokenLogprob
from kiln.runtime.sampling_params import SamplingParams


def apply_repetition_penalty(
    logits: torch.Tensor, seen: list[int], penalty: float
) -> torch.Tensor:
    """HF / CTRL rule on one row: seen tokens' positive logits / p, negative ones * p."""
    if penalty == 1.0 or not seen:
        return logits
    idx = torch.tensor(sorted(set(seen)), device=logits.device, dtype=torch.long)
    idx = idx[idx < logits.shape[-1]]
    vals = logits.index_select(-1, idx)
    vals = torch.where(vals > 0, vals / penalty, vals * penalty)
    logits = logits.clone()
    logits.index_copy_(-1, idx, vals)
    return logits


def warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row [V]; returns probabilities (float32)."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (keeps at least one).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= p.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
    return probs


def sample_row(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token from probabilities [V]; seeded draws run on CPU for reproducibility."""
    if generator is not None:
        return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))
    return int(torch.multinomial(probs.float(), 1))


class Sampler:
    """Picks one token per row. Greedy rows share one argmax; others are warped per row."""

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], seen: list[list[int]],
        generators: list[torch.Generator | None],
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        # logits: [rows, V] float32
        processed = logits
        penalized = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if penalized:  # copy the logits only when some row changes them
            processed = logits.clone()
            for i in penalized:
                processed[i] = apply_repetition_penalty(logits[i], seen[i],
                                                        params[i].repetition_penalty)
        tokens = processed.argmax(-1).tolist()
        for i, p in enumerate(params):
            if not p.greedy:
                tokens[i] = sample_row(warp(processed[i], p), generators[i])
        logprobs: list[TokenLogprob | None] = [None] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            for row, i in enumerate(want):
                k = params[i].logprobs
                top = {}
                if k:
                    vals, idx = torch.topk(lp[row], k)
                    top = dict(zip(idx.tolist(), vals.tolist()))
                logprobs[i] = TokenLogprob(tokens[i], float(lp[row, tokens[i]]), top)
        return tokens, logprobs
