"""engine.json ``parallel``: tensor parallelism, and how each runtime tensor is sharded.

A tp-N engine holds one weight file per rank (``weights-rank{r}-of-{N}.safetensors``) with
the runtime names of kiln.artifact.weights at per-rank shapes. Megatron-style layout, the
one vLLM / TensorRT-LLM / SGLang use; nh/nkv heads, hd head_dim, I intermediate, V vocab:

    qkv.weight / .bias   column-parallel: rank r holds cat(q_r, k_r, v_r), its nh/N query
                         heads and the KV heads those heads read
    gate_up.weight       column-parallel: cat(gate_r, up_r), I/N rows of each
    o_proj.weight        row-parallel: the input columns of rank r's query heads
    down.weight          row-parallel: I/N input columns; the runtime all-reduces the
                         partial sums of o_proj and down
    embed_tokens.weight  vocab-parallel: rows r*V'/N .. (r+1)*V'/N of the vocabulary padded
    lm_head.weight       to V' (the next multiple of N, zero rows past V); the embedding
    lm_head.weight_scale sums its ranks' rows, the head gathers its logits and drops the pad
    norms, scalar FP8    replicated (a per-tensor FP8 scale is valid for every slice of its
    scales, k/v scales   tensor, so a shard keeps its tensor's scale)
    per-row FP8 scales   [N], one per output row (per-channel checkpoints): split like their
                         weight's rows (qkv, gate_up); whole on row-parallel o_proj / down

KV heads: split (nkv/N per rank) when N divides nkv; replicated when nkv < N and nkv
divides N (each rank keeps the one KV head its query heads read, N/nkv ranks hold each).
Biases exist only on qkv (Qwen2), which is column-parallel, so no bias is added twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kiln.artifact.weights import is_scale_name
from kiln.config import ModelConfig

KV_SPLIT, KV_REPLICATED = "split", "replicated"
# What each runtime tensor is on a rank; recorded in engine.json so a reader of the engine
# needs no code to know the layout.
LAYOUT = {
    "qkv": "column: cat(q_r, k_r, v_r)",
    "gate_up": "column: cat(gate_r, up_r)",
    "o_proj": "row: input columns of the rank's query heads; all-reduce",
    "down": "row: input columns r*I/N..(r+1)*I/N; all-reduce",
    "embed_tokens": "vocab rows of the padded vocabulary; all-reduce",
    "lm_head": "vocab rows of the padded vocabulary; logits gathered, pad dropped",
    "norms and scalar scales": "replicated",
}


def shard_file(rank: int, tp: int) -> str:
    return f"weights-rank{rank}-of-{tp}.safetensors"


def tp_problem(cfg: ModelConfig, tp: int) -> str | None:
    """Why ``cfg`` cannot be split over ``tp`` ranks (the value and the rule), or None."""
    nh, nkv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if nh % tp:
        return (f"num_attention_heads={nh} is not divisible by tp={tp} (every rank gets the "
                "same number of query heads)")
    if nkv % tp and tp % nkv:
        return (f"num_key_value_heads={nkv} is neither divisible by tp={tp} (KV heads split "
                f"across ranks) nor a divisor of it (each KV head replicated on tp/{nkv} "
                "ranks)")
    if inter % tp:
        return (f"intermediate_size={inter} is not divisible by tp={tp} (every rank gets the "
                "same share of the MLP)")
    return None


def valid_tp(cfg: ModelConfig) -> list[int]:
    """Every tp that splits ``cfg`` (at most its query head count)."""
    return [n for n in range(1, cfg.num_heads + 1) if tp_problem(cfg, n) is None]


@dataclass(frozen=True)
class ParallelConfig:
    """engine.json ``parallel`` (absent: tp 1, one weights.safetensors). ``shards``: the
    rank files in rank order (empty for a random engine, which shards its seeded weights
    at load). ``vocab_size_padded``: the vocabulary rounded up to a multiple of tp."""

    tp: int
    kv_heads: str
    vocab_size_padded: int
    shards: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 2:
            raise ValueError(f"parallel.tp must be an integer >= 2 (tp 1 has no parallel "
                             f"section), got {self.tp!r}")
        if self.kv_heads not in (KV_SPLIT, KV_REPLICATED):
            raise ValueError(f"parallel.kv_heads {self.kv_heads!r} is not one of "
                             f"{[KV_SPLIT, KV_REPLICATED]}")
        if self.shards and len(self.shards) != self.tp:
            raise ValueError(f"parallel.shards names {len(self.shards)} files for tp="
                             f"{self.tp}; need one per rank")
        object.__setattr__(self, "shards", tuple(self.shards))

    @classmethod
    def for_model(cls, cfg: ModelConfig, tp: int) -> ParallelConfig | None:
        """The section for ``cfg`` over ``tp`` ranks (None for tp 1); ValueError naming the
        head counts, the rule and the tp values that work when ``cfg`` does not split."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"--tp must be a positive integer, got {tp!r}")
        if tp == 1:
            return None
        problem = tp_problem(cfg, tp)
        if problem is not None:
            raise ValueError(
                f"--tp {tp}: {problem}; this {cfg.architecture} model ({cfg.num_heads} "
                f"heads, {cfg.num_kv_heads} KV heads, intermediate_size "
                f"{cfg.intermediate_size}) splits with --tp {', '.join(map(str, valid_tp(cfg)))}")
        kv = KV_SPLIT if cfg.num_kv_heads % tp == 0 else KV_REPLICATED
        padded = -(-cfg.vocab_size // tp) * tp
        return cls(tp, kv, padded)

    def with_shards(self) -> ParallelConfig:
        return dataclasses.replace(self, shards=tuple(shard_file(r, self.tp)
                                                      for r in range(self.tp)))

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """One rank's model: its query heads, KV heads, MLP share and vocabulary rows (the
        shapes of its shard; the runtime builds each rank's model from it)."""
        return dataclasses.replace(
            cfg, num_heads=cfg.num_heads // self.tp,
            num_kv_heads=max(cfg.num_kv_heads // self.tp, 1),
            intermediate_size=cfg.intermediate_size // self.tp,
            vocab_size=self.vocab_size_padded // self.tp)

    def _kv_head0(self, cfg: ModelConfig, rank: int) -> int:
        """The first KV head rank ``rank`` holds: the one its first query head reads."""
        return rank * (cfg.num_heads // self.tp) // (cfg.num_heads // cfg.num_kv_heads)

    def _rule(self, name: str, ndim: int) -> str:
        if ndim == 0 or name.endswith("norm.weight"):
            return "replicate"
        if name.startswith(("embed_tokens.", "lm_head.")):
            return "vocab"
        base = name.split(".", 2)[-1] if name.startswith("layers.") else name
        rules = {"qkv.weight": "qkv", "qkv.bias": "qkv", "gate_up.weight": "gate_up",
                 "o_proj.weight": "row", "down.weight": "row",
                 # per-channel FP8: one scale per output row, split like the rows
                 "qkv.weight_scale": "qkv", "gate_up.weight_scale": "gate_up",
                 "o_proj.weight_scale": "replicate", "down.weight_scale": "replicate"}
        if base in rules:
            return rules[base]
        kind = "scale" if is_scale_name(name) else "tensor"
        raise ValueError(f"no tensor-parallel shard rule for the {ndim}-d {kind} {name!r} "
                         "(kiln/artifact/parallel.py knows qkv, gate_up, o_proj, down, the "
                         "embedding, lm_head, norms and scalar scales)")

    def shard_shape(self, cfg: ModelConfig, name: str,
                    shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of ``name`` on every rank (the same on all of them)."""
        rule = self._rule(name, len(shape))
        local = self.local_config(cfg)
        if rule == "replicate":
            return tuple(shape)
        if rule == "vocab":
            return (local.vocab_size, *shape[1:])
        if rule == "qkv":
            return ((local.q_size + 2 * local.kv_size), *shape[1:])
        if rule == "gate_up":
            return (2 * local.intermediate_size, *shape[1:])
        return (shape[0], shape[1] // self.tp)  # row

    def shard(self, cfg: ModelConfig, name: str, t: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of the full runtime tensor ``name`` (a new contiguous
        tensor; FP8 e4m3 kept as is)."""
        rule = self._rule(name, t.dim())
        if rule == "replicate":
            return t.clone()
        local = self.local_config(cfg)
        hd = cfg.head_dim
        if rule == "vocab":
            rows = local.vocab_size
            part = t[rank * rows : (rank + 1) * rows]
            pad = rows - part.shape[0]
            if pad:  # the padded rows: zero weights, unit scales
                fill = torch.ones if is_scale_name(name) else torch.zeros
                part = _cat([part, fill((pad, *t.shape[1:]), dtype=t.dtype, device=t.device)])
            return part.contiguous()
        if rule == "qkv":
            q = local.q_size
            kv0 = cfg.q_size + self._kv_head0(cfg, rank) * hd
            return _cat([t[rank * q : (rank + 1) * q], t[kv0 : kv0 + local.kv_size],
                         t[kv0 + cfg.kv_size : kv0 + cfg.kv_size + local.kv_size]])
        if rule == "gate_up":
            i = local.intermediate_size
            return _cat([t[rank * i : (rank + 1) * i],
                         t[cfg.intermediate_size + rank * i :
                           cfg.intermediate_size + (rank + 1) * i]])
        k = t.shape[1] // self.tp  # row: input columns
        return t[:, rank * k : (rank + 1) * k].contiguous()

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "kv_heads": self.kv_heads,
                "vocab_size_padded": self.vocab_size_padded, "shards": list(self.shards),
                "layout": dict(LAYOUT)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParallelConfig:
        return cls(tp=d["tp"], kv_heads=d["kv_heads"], vocab_size_padded=d["vocab_size_padded"],
                   shards=tuple(d.get("shards") or ()))

    def check_model(self, cfg: ModelConfig) -> None:
        """ValueError when this section does not fit ``cfg`` (a hand-edited engine.json)."""
        expect = ParallelConfig.for_model(cfg, self.tp)
        if expect is None or (expect.kv_heads, expect.vocab_size_padded) != (
                self.kv_heads, self.vocab_size_padded):
            raise ValueError(
                f"parallel section (tp {self.tp}, kv_heads {self.kv_heads!r}, "
                f"vocab_size_padded {self.vocab_size_padded}) does not fit the model, which "
                f"needs kv_heads {expect and expect.kv_heads!r}, vocab_size_padded "
                f"{expect and expect.vocab_size_padded}; rebuild the engine")


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat on dim 0, also for e4m3 tensors (concatenated as bytes)."""
    if parts[0].dtype == torch.float8_e4m3fn:
        return torch.cat([p.view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn)
    return torch.cat(parts)
