"""``random:<preset>[:seed]``: named shapes with seeded random weights made at load time."""

from __future__ import annotations

from kiln.config import ModelConfig
from kiln.errors import SourceError
from kiln.sources.base import SourceModel
from kiln.sources.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, make_byte_tokenizer

_TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=BYTE_BOS_ID,
    eos_token_ids=(BYTE_EOS_ID,),
)

# Every preset uses the byte tokenizer's bos/eos so generation can stop.
PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(architecture="llama", **_TINY),
    "tiny-qwen2": ModelConfig(
        architecture="qwen2", qkv_bias=True, rms_norm_eps=1e-6, tie_word_embeddings=True, **_TINY
    ),
    "tiny-qwen3": ModelConfig(
        architecture="qwen3",
        qk_norm=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        **{**_TINY, "head_dim": 32},
    ),
    "smollm2-135m": ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=BYTE_BOS_ID,
        eos_token_ids=(BYTE_EOS_ID,),
    ),
    "llama-3-8b": ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        bos_token_id=BYTE_BOS_ID,
        eos_token_ids=(BYTE_EOS_ID,),
    ),
}


def parse_random_spec(spec: str) -> tuple[str, int]:
    """``random:tiny-llama:7`` → ("tiny-llama", 7); the seed defaults to 0."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] != "random":
        raise SourceError(f"bad random source {spec!r}; use random:<preset>[:seed]")
    preset = parts[1]
    if preset not in PRESETS:
        raise SourceError(f"unknown random preset {preset!r}; presets: {sorted(PRESETS)}")
    seed = 0
    if len(parts) == 3:
        try:
            seed = int(parts[2])
        except ValueError:
            raise SourceError(f"seed {parts[2]!r} in {spec!r} is not an integer") from None
        if seed < 0:
            raise SourceError(f"seed {seed} in {spec!r} must be >= 0")
    return preset, seed


def open_random(spec: str) -> SourceModel:
    """A weightless source: the engine records the seed and the loader makes the weights."""
    preset, seed = parse_random_spec(spec)
    return SourceModel(
        config=PRESETS[preset],
        tokenizer=make_byte_tokenizer(),
        provenance={"kind": "random", "preset": preset, "seed": seed},
        random_seed=seed,
    )
