"""Prompt logprobs: each prompt token's logprob given the tokens before it, scored from the
logits a prefill step computes at the prompt positions (``ForwardOutput.prompt_rows``).

Scores are log_softmax of the raw model logits in float32 (no temperature, penalties, bias
or grammar), as vLLM reports them; lm-evaluation-harness sums them for loglikelihoods.
Everything runs on the device; the step's results come back in one copy.
"""

from __future__ import annotations

import math

import torch

from kiln.runtime.host_copy import to_device
from kiln.runtime.outputs import TokenLogprob
from kiln.runtime.request import Request

# Rows per log_softmax: its float32 temporary is at most ROW_BLOCK x vocab (a 2048-token
# prompt chunk of a 152k vocabulary would otherwise double the step's 1.2 GB of logits).
ROW_BLOCK = 256


def score_prompt_rows(logits: torch.Tensor, prompt_rows: dict[Request, tuple[int, int, int]]
                      ) -> dict[Request, list[TokenLogprob] | None]:
    """Per request of ``prompt_rows`` (request -> (first row of ``logits``, count, first
    position p)) the TokenLogprobs of prompt tokens p+1 .. p+count, in order: the token's
    logprob, its rank (1 = most likely) and the ``params.prompt_logprobs`` most likely
    tokens; None for a request whose rows are not finite (NaN or inf in the model's output).

    ``logits``: [rows, vocab] float32.
    """
    reqs = list(prompt_rows)
    index: list[int] = []
    targets: list[int] = []
    for req in reqs:
        first, count, p = prompt_rows[req]
        index.extend(range(first, first + count))
        targets.extend(req.prompt_token_ids[p + 1 : p + 1 + count])
    k = min(max(r.params.prompt_logprobs for r in reqs), logits.shape[-1])
    dev = logits.device
    target = to_device(targets, torch.long, dev)
    if index == list(range(index[0], index[0] + len(index))):  # the usual case: the tail
        rows = logits[index[0] : index[0] + len(index)]
    else:
        rows = logits.index_select(0, to_device(index, torch.long, dev))
    packed = []
    for block, tok in zip(rows.split(ROW_BLOCK), target.split(ROW_BLOCK)):
        lp = torch.log_softmax(block, dim=-1)  # [r, V] float32
        chosen = lp.gather(1, tok[:, None])  # [r, 1]
        # rank as vLLM counts it: 1 + tokens strictly more likely
        rank = (lp > chosen).sum(-1, keepdim=True)
        cols = [chosen.double(), rank.double() + 1]
        if k:
            top = lp.topk(k, dim=-1)  # the same values as ``chosen`` where they coincide
            cols += [top.values.double(), top.indices.double()]
        # float64 holds float32 values and token ids exactly: one tensor, one copy back
        packed.append(torch.cat(cols, dim=1))
    host = torch.cat(packed).cpu().tolist()  # [rows, 2 + 2k]
    out: dict[Request, list[TokenLogprob] | None] = {}
    i = 0
    for req, tok_ids in zip(reqs, _split(targets, [prompt_rows[r][1] for r in reqs])):
        kr = req.params.prompt_logprobs
        lps: list[TokenLogprob] | None = []
        for t in tok_ids:
            row = host[i]
            i += 1
            if lps is None:
                continue
            if not math.isfinite(row[0]):
                lps = None
                continue
            top = {int(row[2 + k + j]): row[2 + j] for j in range(kr)}
            lps.append(TokenLogprob(t, row[0], top, int(row[1])))
        out[req] = lps
    return out


def _split(values: list[int], counts: list[int]) -> list[list[int]]:
    out, i = [], 0
    for c in counts:
        out.append(values[i : i + c])
        i += c
    return out
