"""Prompt files for benchmarks: ShareGPT JSON or JSONL.

Accepted records (a JSON list, or one JSON object per line):
- ShareGPT: ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}``
  (also ``"role"``/``"content"`` keys); the first human turn is the prompt and the length of
  the reply that follows it is the output length.
- Plain: ``{"prompt": "...", "output_len": 64}`` (``output_len`` optional; ``completion``
  or ``response`` text gives it instead).
- A bare string is a prompt.
``--output-len`` given on the command line overrides every record's output length.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.bench.offline import BenchRequest

_HUMAN = {"human", "user"}


def _read_records(path: Path) -> list[Any]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompt file {path} is not valid JSON: {e}") from e
        return list(data)
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(
                f"prompt file {path} line {lineno} is not JSON ({e}); expected a ShareGPT "
                "JSON list or JSONL with one object per line"
            ) from e
    return records


def _prompt_and_reply(rec: Any) -> tuple[str | None, str | None, int | None]:
    """(prompt, reply text, explicit output length) of one record."""
    if isinstance(rec, str):
        return rec, None, None
    if not isinstance(rec, dict):
        return None, None, None
    turns = rec.get("conversations") or rec.get("messages")
    if isinstance(turns, list):
        for i, turn in enumerate(turns):
            role = str(turn.get("from", turn.get("role", ""))).lower()
            if role in _HUMAN:
                reply = turns[i + 1] if i + 1 < len(turns) else {}
                return (turn.get("value", turn.get("content")),
                        reply.get("value", reply.get("content")), None)
        return None, None, None
    prompt = rec.get("prompt") or rec.get("text")
    reply = rec.get("completion") or rec.get("response")
    out_len = rec.get("output_len") or rec.get("max_tokens")
    return prompt, reply, int(out_len) if out_len else None


@dataclass(frozen=True)
class PromptFile:
    """The requests taken from a prompt file, and how many of its records were read to get
    them: ``num_records`` in the file, ``num_skipped`` of those passed over (no prompt, under
    4 prompt or output tokens, or over the engine's limits)."""

    requests: list[BenchRequest]
    num_records: int
    num_skipped: int


def load_dataset(
    path: str | Path,
    tokenizer: Any,
    num_prompts: int | None = None,
    *,
    output_len: int | None = None,
    max_seq_len: int | None = None,
    max_input_len: int | None = None,
    seed: int = 0,
) -> PromptFile:
    """Every usable record of a prompt file as a request, or the first ``num_prompts`` of
    them after a seeded shuffle.

    Prompts are tokenized as plain text. Records with no usable prompt, fewer than 4 prompt
    or output tokens (vLLM's filter), or that do not fit the engine's limits are skipped.
    """
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1 (or None: every record)")
    path = Path(path)
    records = _read_records(path)
    random.Random(seed).shuffle(records)
    reqs: list[BenchRequest] = []
    skipped = 0
    for rec in records:
        if num_prompts is not None and len(reqs) >= num_prompts:
            break
        prompt, reply, n_out = _prompt_and_reply(rec)
        if not prompt:
            skipped += 1
            continue
        ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if output_len is not None:
            n_out = output_len
        elif n_out is None and reply:
            n_out = len(tokenizer(reply, add_special_tokens=False)["input_ids"])
        if (n_out is None or len(ids) < 4 or n_out < 4
                or (max_input_len is not None and len(ids) > max_input_len)
                or (max_seq_len is not None and len(ids) + n_out > max_seq_len)):
            skipped += 1
            continue
        reqs.append(BenchRequest(ids, n_out))
    if not reqs:
        raise ValueError(
            f"prompt file {path} has no usable prompts (need a prompt and an output length of "
            ">= 4 tokens that fit the engine's limits); pass --output-len to set the length"
        )
    return PromptFile(reqs, len(records), skipped)


def load_requests(
    path: str | Path,
    tokenizer: Any,
    num_prompts: int | None = None,
    *,
    output_len: int | None = None,
    max_seq_len: int | None = None,
    max_input_len: int | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """``load_dataset(...).requests``: the requests alone."""
    return load_dataset(path, tokenizer, num_prompts, output_len=output_len,
                        max_seq_len=max_seq_len, max_input_len=max_input_len,
                        seed=seed).requests
