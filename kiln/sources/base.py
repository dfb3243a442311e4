"""The ``SourceModel`` every source returns, and helpers shared by the sources."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from kiln.config import ModelConfig

# The sampling fields a model's generation_config.json may set that kiln takes as defaults
# for requests that leave them out (vLLM's `--generation-config auto` takes the same).
GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class SourceModel:
    """A model opened from some source, ready for the builder.

    ``tensor_names``/``get_tensor`` give random access to the checkpoint's tensors under their
    Hugging Face names (``model.layers.0.self_attn.q_proj.weight``); a random source has none
    and sets ``random_seed`` instead. ``config.eos_token_ids`` already merges config.json,
    generation_config.json and the tokenizer's eos. ``tokenizer`` has ``save_pretrained``.
    """

    config: ModelConfig
    tokenizer: Any
    provenance: dict[str, Any]
    random_seed: int | None = None
    tensor_names: list[str] = field(default_factory=list)
    _get: Callable[[str], torch.Tensor] | None = None
    # name -> shape, known without reading the data (safetensors headers); None when unknown.
    tensor_shapes: dict[str, tuple[int, ...]] | None = None
    # Deferred heavy loading (GGUF dequantization): fills tensor_names/_get/tensor_shapes.
    _materialize: Callable[[SourceModel], None] | None = None
    # Sampling defaults the model's authors publish (generation_config.json's temperature,
    # top_p, ...; a built-in alias's from its model card), unvalidated, and where they came
    # from; `kiln build --generation-config auto` records them in engine.json.
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    generation_source: str | None = None

    def materialize(self) -> None:
        """Do the source's deferred heavy work now (idempotent); builders call it after
        validating the cheap parts (config, limits)."""
        if self._materialize is not None:
            load, self._materialize = self._materialize, None
            load(self)

    @property
    def is_random(self) -> bool:
        return self.random_seed is not None

    def get_tensor(self, name: str) -> torch.Tensor:
        self.materialize()
        if self._get is None:
            raise KeyError(f"source {self.provenance.get('kind')} has no stored tensors")
        return self._get(name)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) one at a time (loaded lazily where the source allows)."""
        self.materialize()
        for name in self.tensor_names:
            yield name, self.get_tensor(name)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_generation_defaults(path: Path) -> dict[str, Any]:
    """GENERATION_FIELDS set (not null) in a generation_config.json; {} without the file.
    Values are checked by the builder, which knows what it will record."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # merged_eos ignores an unreadable file the same way
    if not isinstance(raw, dict):
        return {}
    return {k: raw[k] for k in GENERATION_FIELDS if raw.get(k) is not None}


def merged_eos(
    config: ModelConfig, *, generation_config: Path | None, tokenizer: Any
) -> ModelConfig:
    """Return ``config`` with eos ids from generation_config.json and the tokenizer appended."""
    ids = list(config.eos_token_ids)
    if generation_config is not None and generation_config.is_file():
        try:
            eos = json.loads(generation_config.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError):
            eos = None
        if eos is not None:
            ids += [eos] if isinstance(eos, int) else list(eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.append(tok_eos)
    unique = tuple(dict.fromkeys(int(i) for i in ids))
    return replace(config, eos_token_ids=unique)
