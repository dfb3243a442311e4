"""Token selection: penalties, temperature, top-k, top-p, min-p, seeded sampling, logprobs.

A row whose logits are not finite (NaN or +inf from the model, or all -inf: a grammar that
allows no token) gets the token ``INVALID_TOKEN`` instead of an arbitrary id; the engine fails
that request alone with a message (``describe_bad_row`` says which case it was).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from kiln.runtime.host_copy import to_device
from kiln.runtime.outputs import TokenLogprob
from kiln.runtime.sampling_params import SamplingParams

INVALID_TOKEN = -1


def describe_bad_row(logits: torch.Tensor) -> str:
    """Why one row [V] got ``INVALID_TOKEN`` (for the request's error message)."""
    if bool(torch.isnan(logits).any()):
        return "the model's logits are NaN"
    if bool(torch.isposinf(logits).any()):
        return "the model's logits are +inf"
    return "no token is allowed (every logit is -inf: the grammar allows nothing here)"


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


def apply_penalties(logits: torch.Tensor, p: SamplingParams, seen: list[int],
                    generated: list[int]) -> torch.Tensor:
    """Every history- or bias-dependent rule on one row [V] (a new tensor when any applies):
    logit_bias, the repetition penalty over ``seen`` (prompt + output, HF's rule), then
    OpenAI's frequency and presence penalties over ``generated`` (output only). Masked
    (-inf) logits stay -inf; SamplingParams' bounds keep the rest finite."""
    v = logits.shape[-1]
    if p.logit_bias:
        ids = [t for t, _ in p.logit_bias if t < v]
        bias = [b for t, b in p.logit_bias if t < v]
        logits = logits.clone()
        logits.index_add_(-1, torch.tensor(ids, dtype=torch.long, device=logits.device),
                          torch.tensor(bias, dtype=logits.dtype, device=logits.device))
    logits = apply_repetition_penalty(logits, seen, p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and generated:
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=v)[:v]
        counts = counts.to(device=logits.device, dtype=logits.dtype)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    return logits


def warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p on one row [V]; returns probabilities (float32)."""
    return warp_batch(logits[None], [p])[0]


def warp_batch(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``warp`` for many rows at once (logits [R, V], one SamplingParams per row): the same
    rules, each applied to the rows that use it, with per-row values as [R, 1] tensors."""
    dev, v = logits.device, logits.shape[-1]

    def col(vals: list) -> torch.Tensor:  # per-row values as [R, 1]
        return torch.tensor(vals, device=dev)[:, None]

    temps = [float(p.temperature) for p in params]
    # one temperature for all rows (the common case): a scalar, no host->device copy
    logits = logits / (temps[0] if len(set(temps)) == 1 else col(temps))
    ks = [p.top_k if 0 < p.top_k < v else 0 for p in params]
    if any(ks):
        # the k-th largest logit of each row with top-k (rows without: -inf, keeps all)
        top = torch.topk(logits, max(ks), dim=-1).values  # [R, kmax] descending
        kth = top.gather(-1, col([max(k, 1) - 1 for k in ks]))
        kth = kth.masked_fill(~col([k > 0 for k in ks]), float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        cum = sorted_probs.cumsum(-1)
        # drop a token when the mass before it already reaches top_p (top_p 1.0: never)
        drop_sorted = (cum - sorted_probs) >= col([float(p.top_p) if p.top_p < 1.0 else 2.0
                                                   for p in params])
        # the most likely token always stays: a top_p that is 0 in float32 (5e-324) would
        # otherwise drop every token and leave a row of NaN
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    if any(p.min_p > 0 for p in params):
        floor = col([float(p.min_p) for p in params]) * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def race(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of probabilities [R, V]: argmax of p / E with E ~ Exp(1) i.i.d.
    (the exponential race: token v wins with probability p_v exactly). A few elementwise
    kernels and an argmax on the device, where ``torch.multinomial`` runs a cumsum and a
    search per row."""
    e = torch.empty_like(probs).exponential_().clamp_min_(1e-20)  # E = 0 would make 0/0
    return probs.div(e).argmax(-1)


def sample_row(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token from probabilities [V]; seeded draws run on CPU for reproducibility.
    Probabilities that are not a distribution (NaN from a model's NaN logits) give their
    argmax, NaN counting as the largest (torch.argmax's rule): torch.multinomial would raise,
    and an exception in a step stops the engine for every request."""
    p = probs.float().cpu() if generator is not None else probs.float()
    total = float(p.sum())  # NaN or inf anywhere shows in the sum (probabilities are >= 0)
    if not (math.isfinite(total) and total > 0):
        return int(p.argmax())
    return int(torch.multinomial(p, 1, generator=generator))


def kernel_inv_temps(params: list[SamplingParams], vocab: int) -> list[float] | None:
    """1 / temperature per row for the sampling kernels (0: greedy rows; seeded rows too get
    theirs: they draw with a Philox key from their own generator, see ``Sampler``), or None
    when some row needs top-k, top-p or min-p (those warp the distribution: the torch path,
    where seeded rows are redrawn on the host)."""
    inv = []
    for p in params:
        if p.greedy:
            inv.append(0.0)
        elif 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0:
            return None
        else:
            inv.append(1.0 / p.temperature)
    return inv or None


def kernels_enabled() -> bool:
    """Whether ``Sampler.choose`` uses the Triton sampling kernels for CUDA logits (bench
    reports record it)."""
    return _triton_available()


@functools.cache
def _triton_available() -> bool:
    from kiln.runtime import kernels

    return kernels.available()


class Sampler:
    """Picks one token per row. Greedy rows share one argmax; sampled rows are warped and
    drawn together on the device (no per-row host sync). A seeded row's draw depends on its
    own generator only, so a seed reproduces across batches: on CUDA, where no row of the
    batch needs top-k / top-p / min-p, the sampling kernels draw it with a Philox key taken
    from its generator (one per token); otherwise its generator draws on the host (a host
    sync and a CPU multinomial per token: 2 ms at a 49152 vocabulary, which made seeded
    requests 5x slower)."""

    @staticmethod
    def device_only(params: list[SamplingParams], generators: list[torch.Generator | None],
                    kernels: bool = False) -> bool:
        """Whether ``choose`` alone picks these rows' tokens, so a step can leave its tokens
        on the device: no penalties, no logprobs, and seeded rows only where ``kernels`` (the
        logits are on CUDA and ``kernels_enabled()``) and the batch takes the kernel path."""
        if any(p.penalized or p.logprobs is not None for p in params):
            return False
        if all(p.greedy or g is None for p, g in zip(params, generators)):
            return True
        # any top-k counts as warping here (no vocabulary to compare with): the host path
        return kernels and kernel_inv_temps(params, vocab=2**62) is not None

    def choose(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> torch.Tensor:
        """Every row's token id [rows] on the device, no host sync, except seeded rows off
        the kernel path: those get their argmax here (``__call__`` redraws them). Rows whose
        logits are not finite get ``INVALID_TOKEN``.

        On CUDA, when no row needs top-k, top-p or min-p, two Triton kernels do it all
        (kiln/runtime/kernels/sampling.py: the same distribution, without torch's one-block
        argmax and softmax over the vocabulary)."""
        return self._choose(logits, params, generators)[0]

    def _choose(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[torch.Tensor, bool]:
        """``choose``'s tokens, and whether seeded rows were drawn (the kernel path)."""
        inv = (kernel_inv_temps(params, logits.shape[-1])
               if logits.is_cuda and kernels_enabled() else None)
        if inv is not None:
            from kiln.runtime.kernels import sampling

            one = inv[0] if len(set(inv)) == 1 else None
            # greedy-only steps need no noise: no seed drawn (and torch's CPU RNG untouched)
            seed = int(torch.randint(0, 2**31 - 1, ())) if max(inv) > 0 else 0
            seeded = [i for i, (t, g) in enumerate(zip(inv, generators))
                      if t > 0 and g is not None]
            if seeded:  # one Philox key per row: a seeded row's from its own generator
                keys = [seed + (i << 32) for i in range(len(inv))]
                for i in seeded:
                    keys[i] = int(torch.randint(0, 2**62, (), generator=generators[i]))
                seed = to_device(keys, torch.int64, logits.device)
            return sampling.sample_tokens(
                logits.contiguous(),  # a view of whole rows, as graph steps give: no copy
                one if one is not None else to_device(inv, torch.float32, logits.device),
                seed), True
        batch = [i for i, p in enumerate(params) if not p.greedy and generators[i] is None]
        top = logits.amax(-1)  # NaN when the row has one; +-inf when not finite
        if len(batch) == len(params) and batch:  # every row samples: no argmax, no gather
            chosen = race(warp_batch(logits, params))
        else:
            chosen = logits.argmax(-1)  # [rows], on the device
            if batch:
                idx = torch.tensor(batch, device=logits.device)
                probs = warp_batch(logits.index_select(0, idx), [params[i] for i in batch])
                chosen = chosen.index_copy(0, idx, race(probs))
        return chosen.masked_fill(~torch.isfinite(top), INVALID_TOKEN), False

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], seen: list[list[int]],
        generators: list[torch.Generator | None], prompt_lens: list[int] | None = None,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Tokens and logprobs of every row. ``seen[i]``: row i's token ids so far, the
        first ``prompt_lens[i]`` of them its prompt (None: no prompt; frequency and presence
        penalties count the rest). ``INVALID_TOKEN`` marks a row whose logits are not
        finite (its logprobs are None)."""
        # logits: [rows, V] float32
        processed = logits
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if penalized:  # copy the logits only when some row changes them
            processed = logits.clone()
            for i in penalized:
                start = prompt_lens[i] if prompt_lens is not None else 0
                processed[i] = apply_penalties(logits[i], params[i], seen[i], seen[i][start:])
        chosen, seeded_drawn = self._choose(processed, params, generators)
        tokens = chosen.tolist()  # the step's one host sync
        for i, p in enumerate(params):
            if (not seeded_drawn and not p.greedy and generators[i] is not None
                    and tokens[i] != INVALID_TOKEN):
                tokens[i] = sample_row(warp(processed[i], p), generators[i])
        logprobs: list[TokenLogprob | None] = [None] * len(params)
        want = [i for i, p in enumerate(params)
                if p.logprobs is not None and tokens[i] != INVALID_TOKEN]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            for row, i in enumerate(want):
                k = params[i].logprobs
                top = {}
                if k:
                    vals, idx = torch.topk(lp[row], k)
                    # tokens a grammar masked out (-inf) are no alternatives
                    top = {t: v for t, v in zip(idx.tolist(), vals.tolist())
                           if math.isfinite(v)}
                logprobs[i] = TokenLogprob(tokens[i], float(lp[row, tokens[i]]), top)
        return tokens, logprobs

    def sample_requests(self, logits: torch.Tensor, reqs: list,
                        on_error: Callable[[int, BaseException], None]
                        ) -> tuple[list[int], list[TokenLogprob | None]]:
        """``__call__`` over requests' rows (their params, tokens, generators); if the
        batch raises, each row alone, so the row that raised goes to ``on_error(row, exc)``
        with token ``INVALID_TOKEN`` and the others are sampled."""
        def run(rows: torch.Tensor, rs: list):
            return self(rows, [r.params for r in rs], [r.all_token_ids for r in rs],
                        [r.generator for r in rs], [r.num_prompt_tokens for r in rs])

        try:
            return run(logits, reqs)
        except Exception:
            tokens: list[int] = []
            logprobs: list[TokenLogprob | None] = []
            for i, req in enumerate(reqs):
                try:
                    (tok,), (lp,) = run(logits[i : i + 1], [req])
                except Exception as e:
                    on_error(i, e)
                    tok, lp = INVALID_TOKEN, None
                tokens.append(tok)
                logprobs.append(lp)
            return tokens, logprobs
