"""Model architecture config: every field the runtime needs, recorded in engine.json.

The runtime never re-reads a source config.json; ``ModelConfig`` is the whole contract
between sources, the builder and the runtime.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import SourceError

# HF ``model_type`` / ``architectures`` → kiln architecture name.
SUPPORTED_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    """A llama-family decoder.

    Covers Llama 2/3 (rope scaling ``llama3``), SmolLM2, Mistral, Qwen2/2.5 (``qkv_bias``)
    and Qwen3 (``qk_norm``: RMSNorm over each head of q and k before rotary).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or {"rope_type": "linear"|"llama3"|"default", "factor": ..., ...} as in HF.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"kiln runs {sorted(set(SUPPORTED_ARCHITECTURES.values()))}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads "
                f"{self.num_kv_heads}"
            )
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        if self.qkv_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown model config fields {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Translate a Hugging Face config.json dict; raises SourceError when unsupported."""
        model_type = hf.get("model_type")
        arch = SUPPORTED_ARCHITECTURES.get(model_type or "")
        if arch is None:
            archs = hf.get("architectures") or []
            raise SourceError(
                f"model_type {model_type!r} (architectures {archs}) is not supported; kiln "
                f"builds llama-family decoders: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = hf.get("head_dim") or hidden // num_heads
        rope_theta = hf.get("rope_theta")
        rope_scaling = hf.get("rope_scaling")
        # transformers >= 5 folds theta and scaling into ``rope_parameters``.
        rp = hf.get("rope_parameters")
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            if "type" in rope_scaling and "rope_type" not in rope_scaling:
                rope_scaling["rope_type"] = rope_scaling.pop("type")
            if rope_scaling.get("rope_type", "default") == "default":
                rope_scaling = None
            elif rope_scaling["rope_type"] not in ("linear", "llama3"):
                raise SourceError(
                    f"rope_scaling type {rope_scaling['rope_type']!r} is not supported; "
                    "kiln supports default, linear and llama3"
                )
        # Mistral v0.1 uses a 4096-token window; the runtime attends to the full context, so
        # the builder keeps max_seq_len within the window.
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos_ids),
            sliding_window=int(window) if window else None,
        )
