"""HF checkpoint tensors → runtime tensors (fused qkv and gate_up), group by group.

The runtime names and shapes they become: kiln/artifact/weights.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kiln.artifact.weights import has_lm_head, runtime_shapes
from kiln.config import ModelConfig
from kiln.dtypes import TORCH_DTYPES
from kiln.errors import SourceError
from kiln.sources.base import SourceModel

# Tensors some checkpoints carry that the runtime does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _layer_sources(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """Runtime name → HF names concatenated (dim 0) to make it."""
    a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
    p = f"layers.{i}."
    src = {
        p + "input_norm.weight": [f"model.layers.{i}.input_layernorm.weight"],
        p + "qkv.weight": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
    }
    if cfg.qkv_bias:
        src[p + "qkv.bias"] = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
    if cfg.qk_norm:
        src[p + "q_norm.weight"] = [a + "q_norm.weight"]
        src[p + "k_norm.weight"] = [a + "k_norm.weight"]
    src[p + "o_proj.weight"] = [a + "o_proj.weight"]
    src[p + "post_norm.weight"] = [f"model.layers.{i}.post_attention_layernorm.weight"]
    src[p + "gate_up.weight"] = [m + "gate_proj.weight", m + "up_proj.weight"]
    src[p + "down.weight"] = [m + "down_proj.weight"]
    return src


def tensor_plan(cfg: ModelConfig, separate_head: bool = False) -> list[dict[str, list[str]]]:
    """Groups of runtime name → HF names: [embedding], one per layer, [norm (+ lm_head)].

    ``separate_head`` on a tied model: the head group's lm_head.weight is read from the
    embedding (a second read of it; the embedding group keeps its own)."""
    head = {"norm.weight": ["model.norm.weight"]}
    if has_lm_head(cfg, separate_head):
        hf = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        head["lm_head.weight"] = [hf]
    return [
        {"embed_tokens.weight": ["model.embed_tokens.weight"]},
        *(_layer_sources(cfg, i) for i in range(cfg.num_layers)),
        head,
    ]


def check_source_tensors(source: SourceModel) -> None:
    """Raise SourceError naming any missing, unexpected or mis-shaped tensor (no data read)."""
    cfg = source.config
    needed = {hf for group in tensor_plan(cfg) for names in group.values() for hf in names}
    have = set(source.tensor_names)
    missing = sorted(needed - have)
    if missing:
        raise SourceError(
            f"the checkpoint is missing {len(missing)} tensor(s) the {cfg.architecture} "
            f"config needs, e.g. {missing[:5]}; it does not match its config.json"
        )
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    extra = sorted(
        n for n in have - needed - optional if not n.endswith(_IGNORED_SUFFIXES)
    )
    if extra:
        raise SourceError(
            f"the checkpoint has {len(extra)} tensor(s) kiln does not know, e.g. {extra[:5]}; "
            f"it is not a plain {cfg.architecture} decoder as its config.json says"
        )
    if source.tensor_shapes is None:
        return
    expected_shapes = runtime_shapes(cfg)
    for group in tensor_plan(cfg):
        for name, hf_names in group.items():
            shapes = [source.tensor_shapes[n] for n in hf_names]
            fused = (sum(s[0] for s in shapes), *shapes[0][1:])
            expected = expected_shapes[name]
            if fused != expected or any(s[1:] != shapes[0][1:] for s in shapes):
                raise SourceError(
                    f"tensor(s) {hf_names} have shapes {shapes}; {name} needs {list(expected)} "
                    "from the config: the checkpoint does not match its config.json"
                )


def prepare_groups(
    source: SourceModel, dtype: str, separate_head: bool = False
) -> Iterator[dict[str, torch.Tensor]]:
    """Yield runtime tensors one group (embedding, each layer, head) at a time, in ``dtype``
    (``separate_head``: see ``tensor_plan``).

    Only one group's source tensors are alive at once, so memory stays bounded by a layer.
    """
    target = TORCH_DTYPES[dtype]
    shapes = runtime_shapes(source.config, separate_head)
    for group in tensor_plan(source.config, separate_head):
        out = {}
        for name, hf_names in group.items():
            parts = [source.get_tensor(n).to(target) for n in hf_names]
            t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if tuple(t.shape) != shapes[name]:
                raise SourceError(
                    f"{name} from {hf_names} has shape {list(t.shape)}, expected "
                    f"{list(shapes[name])} from the config"
                )
            out[name] = t.contiguous()
        yield out
