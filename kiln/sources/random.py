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
    **{
        f"qwen2.5-{size}": ModelConfig(
            architecture="qwen2",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=hidden // heads,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=32768,
            tie_word_embeddings=tied,
            qkv_bias=True,
            bos_token_id=BYTE_BOS_ID,
            eos_token_ids=(BYTE_EOS_ID,),
        )
        # The config.json of Qwen/Qwen2.5-{0.5B,1.5B,7B}-Instruct.
        for size, vocab, hidden, inter, layers, heads, kv_heads, tied in (
            ("0.5b", 151936, 896, 4864, 24, 14, 2, True),
            ("1.5b", 151936, 1536, 8960, 28, 12, 2, True),
            ("7b", 152064, 3584, 18944, 28, 28, 4, False),
        )
    },
    "llama-3-70b": ModelConfig(  # meta-llama/Meta-Llama-3-70B config.json
        architecture="llama",
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        bos_token_id=BYTE_BOS_ID,
        eos_token_ids=(BYTE_EOS_ID,),
    ),
    "llama-3.2-1b": ModelConfig(  # meta-llama/Llama-3.2-1B config.json
        architecture="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
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
