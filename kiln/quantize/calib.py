"""Calibration / evaluation text: the built-in sets (kiln/data) or a user's .txt / .jsonl file.

Built-in sets (written for kiln, see README "Built-in text sets"): ``calib`` is used by
``kiln quantize``, ``eval`` by ``kiln eval perplexity``; they share no text.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

BUILTIN_SETS = ("calib", "eval")


@dataclass(frozen=True)
class TextSet:
    """Documents of one set and where they came from (``name``: builtin:calib or a path)."""

    name: str
    documents: list[str]
    sha256: str

    @property
    def provenance(self) -> dict[str, Any]:
        return {"data": self.name, "sha256": self.sha256}


def _read_builtin(name: str) -> str:
    return (resources.files("kiln") / "data" / f"{name}.txt").read_text(encoding="utf-8")


def _split_documents(text: str) -> list[str]:
    """Documents of a .txt file: blocks separated by a line of ``=====`` (or the whole file)."""
    docs = [d.strip("\n") for d in text.split("\n=====\n")]
    return [d for d in docs if d.strip()]


def load_text_set(data: str | Path | None, default: str) -> TextSet:
    """``data`` None → the built-in set ``default``; else a .txt file (documents separated by
    a line ``=====``) or a .jsonl file of objects with a "text" field."""
    if data is None or str(data) in (f"builtin:{s}" for s in BUILTIN_SETS):
        name = default if data is None else str(data).split(":", 1)[1]
        raw = _read_builtin(name)
        return TextSet(f"builtin:{name}", _split_documents(raw),
                       hashlib.sha256(raw.encode()).hexdigest())
    path = Path(data).expanduser()
    if not path.is_file():
        raise KilnError(f"text file {path} does not exist; pass a .txt or .jsonl file")
    raw = path.read_text(encoding="utf-8")
    sha = hashlib.sha256(raw.encode()).hexdigest()
    if path.suffix == ".jsonl":
        docs = []
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise KilnError(f"{path}:{lineno} is not JSON ({e}); one object per line") from e
            text = obj.get("text") if isinstance(obj, dict) else None
            if not isinstance(text, str):
                raise KilnError(f'{path}:{lineno} has no string "text" field')
            docs.append(text)
    elif path.suffix == ".txt":
        docs = _split_documents(raw)
    else:
        raise KilnError(f"{path}: use a .txt file or a .jsonl file with a \"text\" field")
    if not docs:
        raise KilnError(f"{path} has no text")
    return TextSet(str(path), docs, sha)


def token_stream(tokenizer: Any, docs: list[str]) -> list[int]:
    """All documents tokenized and concatenated, each starting with bos (when the tokenizer
    has one) and ending with eos (when it has one)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for d in docs:
        if bos is not None:
            ids.append(bos)
        ids += tokenizer.encode(d, add_special_tokens=False)
        if eos is not None:
            ids.append(eos)
    return ids


def eval_windows(tokenizer: Any, text: TextSet, seq_len: int) -> list[list[int]]:
    """The set's token stream cut into non-overlapping windows of ``seq_len`` tokens (the
    last may be shorter; windows of fewer than 2 tokens, which score nothing, are dropped)."""
    if seq_len < 2:
        raise KilnError(f"--seq-len must be >= 2, got {seq_len}")
    ids = token_stream(tokenizer, text.documents)
    windows = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise KilnError(f"{text.name} has fewer than 2 tokens")
    return windows


def calibration_chunks(tokenizer: Any, text: TextSet, size: int, seq_len: int) -> list[list[int]]:
    """Up to ``size`` chunks of ``seq_len`` tokens (the last may be shorter, >= seq_len/4).

    A set shorter than size x seq_len gives fewer chunks; every token is used once.
    """
    if size < 1 or seq_len < 8:
        raise KilnError(f"calibration needs --calib-size >= 1 and --calib-seq-len >= 8, got "
                        f"{size} and {seq_len}")
    ids = token_stream(tokenizer, text.documents)
    chunks = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    chunks = [c for c in chunks if len(c) >= max(8, seq_len // 4)]
    if not chunks:
        raise KilnError(f"{text.name} has too few tokens ({len(ids)}) for calibration")
    return chunks[:size]
