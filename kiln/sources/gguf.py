"""A ``.gguf`` file: config from its metadata, tokenizer (and chat template) through
transformers, weights dequantized to float32 one tensor at a time when the builder reads them.

GGUF names map to Hugging Face names (``blk.0.attn_q.weight`` → ``model.layers.0.self_attn.
q_proj.weight``). llama.cpp's converter permutes the rows of q and k (weights and biases) of
``llama``-architecture models into its interleaved rotary layout; ``_unpermute`` restores HF's
half-split layout (transformers' ``LlamaTensorProcessor`` does the same). qwen2 and qwen3
files are written unpermuted. A file without ``output.weight`` ties the head to the embedding.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.config import ModelConfig
from kiln.errors import SourceError
from kiln.sources.base import SourceModel, merged_eos, sha256_file
from kiln.sources.gguf_reader import GGUFHeader, TensorData, read_header

# GGUF general.architecture → HF model_type (kiln's ModelConfig.from_hf reads the rest).
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
PERMUTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str:
    """The HF name of a GGUF tensor; an unknown one keeps its GGUF name (the builder's tensor
    check then names it)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m and m[2] in _LAYER_NAMES:
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"
    return gguf_name


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, rows (i, half) interleaved → half-split.
    w: [n_head * head_dim, ...] (a weight or a bias)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def gguf_hf_config(header: GGUFHeader) -> dict[str, Any]:
    """An HF config.json dict from the GGUF metadata (what transformers' GGUF loader makes of
    it, for the fields kiln reads)."""
    md = header.metadata
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise SourceError(
            f"{header.path}: GGUF architecture {arch!r} is not supported; kiln builds "
            f"{sorted(ARCHITECTURES)} GGUF files"
        )
    if "rope_freqs.weight" in header.tensors:
        raise SourceError(
            f"{header.path} carries rope_freqs.weight (Llama 3.1-style rope scaling baked into "
            "a tensor), which kiln does not read from GGUF; use the model's HF directory"
        )

    def key(name: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{name}", default)

    try:
        hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
        hf: dict[str, Any] = {
            "model_type": ARCHITECTURES[arch],
            "vocab_size": int(key("vocab_size") or md["tokenizer.ggml.tokens"]),
            "hidden_size": hidden,
            "intermediate_size": int(key("feed_forward_length")),
            "num_hidden_layers": int(key("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(key("attention.head_count_kv", heads)),
            "head_dim": int(key("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(key("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(key("context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in header.tensors,
            "attention_bias": "blk.0.attn_q.bias" in header.tensors,
            "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise SourceError(
            f"{header.path}: GGUF metadata lacks or mangles a field kiln needs ({e!r})"
        ) from e
    if key("rope.scaling.type") == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    return hf


def load_gguf_tokenizer(path: Path, architecture: str) -> Any:
    """transformers' tokenizer from the GGUF's vocabulary, merges, special tokens and chat
    template. Naming the tokenizer type skips transformers' own read of the whole GGUF config
    (6-8 s on a 151k vocabulary); where that type is unknown, AutoTokenizer finds it."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    directory, name = str(path.parent), path.name
    typed = [{"tokenizer_type": architecture}] if architecture in TOKENIZER_MAPPING_NAMES else []
    for kwargs in [*typed, {}]:
        try:
            return AutoTokenizer.from_pretrained(directory, gguf_file=name, **kwargs)
        except Exception as e:
            error = e
    raise SourceError(
        f"cannot load the tokenizer from GGUF file {path} ({type(error).__name__}: {error}); "
        "it may be truncated or corrupt"
    ) from error


def open_gguf(
    path: Path,
    *,
    progress: bool = True,
    provenance: dict[str, Any] | None = None,
    sha256: str | None = None,
) -> SourceModel:
    """Read config and tokenizer of a GGUF file now; its weights are dequantized to float32
    tensor by tensor when read (``SourceModel.get_tensor``). ``sha256``: the file's, when the
    caller has verified it already (a built-in), to skip hashing it again."""
    if not path.is_file():
        raise SourceError(f"GGUF file {path} does not exist")
    header = read_header(path)
    hf = gguf_hf_config(header)
    try:
        config = ModelConfig.from_hf(hf)
    except ValueError as e:
        raise SourceError(f"{path}: its metadata is not a valid {hf['model_type']} config: {e}"
                          ) from e
    tokenizer = load_gguf_tokenizer(path, hf["model_type"])
    config = merged_eos(config, generation_config=None, tokenizer=tokenizer)
    files = {path.name: sha256 or sha256_file(path)}
    prov: dict[str, Any] = {"kind": "gguf", "path": str(path.resolve()), "files": files}
    if provenance:
        prov = {**provenance, "gguf": prov["path"], "files": files}

    names = {hf_name(n): n for n in header.tensors}
    permuted: dict[str, int] = {}  # HF name → heads, for llama.cpp's permuted q/k rows
    if header.metadata["general.architecture"] in PERMUTED_ARCHITECTURES:
        for name in names:
            if ".self_attn.q_proj." in name:
                permuted[name] = config.num_heads
            elif ".self_attn.k_proj." in name:
                permuted[name] = config.num_kv_heads

    def load(source: SourceModel) -> None:
        data = TensorData(header)

        def get(name: str) -> torch.Tensor:
            gguf_name = names[name]  # KeyError for a name the file lacks, as other sources
            try:
                w = data.dequantize(gguf_name)
            except (ValueError, NotImplementedError) as e:
                raise SourceError(
                    f"cannot dequantize {gguf_name} of {path} ({type(e).__name__}: {e})"
                ) from e
            if name in permuted:
                w = _unpermute(w, permuted[name])
            if not w.flags.writeable or not w.flags.c_contiguous:  # a view of the file
                w = np.array(w, order="C")
            return torch.from_numpy(w)

        source.tensor_names = list(names)
        source._get = get
        source.tensor_shapes = {hf: header.tensors[g].shape for hf, g in names.items()}

    return SourceModel(config=config, tokenizer=tokenizer, provenance=prov, _materialize=load)
