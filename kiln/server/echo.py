"""/v1/completions' prompt part: ``echo`` (the prompt's text and, with ``logprobs``, its
tokens scored in the legacy logprobs object), ``prompt_logprobs`` (vLLM's per-token shape)
and ``max_tokens: 0`` (the prompt alone).

Scores come from the engine's prompt logprobs (``SamplingParams.prompt_logprobs``: raw
model logits, no temperature or penalties). lm-evaluation-harness' ``local-completions``
reads loglikelihoods this way: ``echo``, ``logprobs: 1``, ``max_tokens: 1``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from kiln.runtime.outputs import RequestOutput, TokenLogprob

MIN_LOGPROB = -9999.0  # what -inf and NaN logprobs are reported as (vLLM's clamp)


def clamp(v: float) -> float:
    return v if math.isfinite(v) else MIN_LOGPROB


@dataclass
class PromptPart:
    """What a /v1/completions request adds to each choice before its completion.

    ``echo``: the prompt's text first (``texts``: per prompt, set once the engine accepted
    them); ``logprobs``: the legacy logprobs' alternatives per token (None: no logprobs
    object); ``prompt_logprobs``: alternatives in the choice's ``prompt_logprobs`` (None: not
    asked); ``prompt_only``: max_tokens 0, the one token the engine draws is dropped;
    ``n``: choices per prompt.
    """

    n: int
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_only: bool = False
    texts: list[str] = field(default_factory=list)

    @property
    def engine_k(self) -> int | None:
        """The engine's ``prompt_logprobs``: enough alternatives for both uses."""
        ks = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
              if k is not None]
        return max(ks) if ks else None

    def add(self, body: dict, index: int, first: bool, prompt_ids: list[int],
            scores: list[TokenLogprob | None] | None, text: dict[int, str]) -> dict:
        """``body`` (a choice or chunk choice of choice ``index``: text, logprobs with text
        offsets into the completion) with the prompt's part when it is the choice's
        ``first`` (the prompt's text and scores first), else with its offsets moved past
        the echoed prompt. ``scores``: the engine's prompt logprobs; ``text``: token id ->
        its text."""
        prompt = self.texts[index // self.n] if self.echo else ""
        if not first:
            if prompt and body["logprobs"]:
                body["logprobs"]["text_offset"] = [len(prompt) + o for o in
                                                   body["logprobs"]["text_offset"]]
            return body
        if self.echo:
            body["text"] = prompt + body["text"]
            if self.logprobs is not None:
                body["logprobs"] = _echo_logprobs(prompt_ids, scores, self.logprobs, text,
                                                  len(prompt), body["logprobs"])
        if self.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(scores, self.prompt_logprobs, text)
        return body


def prompt_only(out: RequestOutput) -> RequestOutput:
    """``out`` without what was generated (max_tokens 0: the prompt alone), finishing for
    "length" (the engine drew one token, which is dropped)."""
    reason = out.finish_reason
    if out.finished and reason not in ("error", "abort"):
        reason = "length"
    return dataclasses.replace(out, token_ids=[], text="", new_token_ids=[], new_text="",
                               logprobs=[] if out.logprobs is not None else None,
                               finish_reason=reason, stop_reason=None)


def _echo_logprobs(prompt_ids: list[int], scores: list[TokenLogprob | None] | None, k: int,
                   text: dict[int, str], prompt_len: int, completion: dict | None) -> dict:
    """The legacy logprobs object over the prompt's tokens, then ``completion``'s (its
    offsets moved past the echoed prompt)."""
    scores = scores or [None] * len(prompt_ids)
    tokens = [text.get(t, "") for t in prompt_ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    out = {"tokens": tokens,
           "token_logprobs": [None if s is None else clamp(s.logprob) for s in scores],
           "top_logprobs": [None if s is None else {text.get(t, ""): clamp(v) for t, v in
                                                    list(s.top.items())[:k]} for s in scores],
           "text_offset": offsets}
    if completion:
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            out[key] += completion[key]
        out["text_offset"] += [prompt_len + o for o in completion["text_offset"]]
    return out


def prompt_logprobs_json(scores: list[TokenLogprob | None] | None, k: int,
                         text: dict[int, str]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} of the token itself, then its ``k`` most likely alternatives."""
    out: list[dict | None] = []
    for s in scores or []:
        if s is None:
            out.append(None)
            continue
        entry = {str(s.token_id): {"logprob": clamp(s.logprob), "rank": s.rank,
                                   "decoded_token": text.get(s.token_id, "")}}
        for rank, (t, v) in enumerate(list(s.top.items())[:k], start=1):
            entry.setdefault(str(t), {"logprob": clamp(v), "rank": rank,
                                      "decoded_token": text.get(t, "")})
        out.append(entry)
    return out
