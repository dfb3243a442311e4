"""A rank's layers of a tensor-parallel model: its shard's plain layers plus the collectives
that make their outputs the full model's (kiln.artifact.parallel has the shard layout).

qkv and gate_up are column-parallel and need nothing: a rank's attention runs on its own
query and KV heads, and its MLP on its rows of the intermediate activations. o_proj and
down are row-parallel: each rank's product is a partial sum, all-reduced. The embedding is
vocab-parallel: each rank looks up the ids in its rows (zeros elsewhere), all-reduced. The
head's logits are gathered on every rank (rank 0 samples; each rank's device speculation
verifies), and its vocabulary pad is dropped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.runtime.layers.linear import Linear
from kiln.runtime.parallel.group import TPGroup


class RowParallel:
    """A row-parallel linear: this rank's partial product, summed over the ranks."""

    def __init__(self, linear: Linear, group: TPGroup):
        self.linear, self.group = linear, group

    def __call__(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x, **kwargs))


class VocabParallelHead:
    """The output projection over this rank's vocabulary rows; the full logits
    [rows, vocab_size] on every rank (the ranks' columns gathered, the pad dropped): rank 0
    samples from them, and every rank's device speculation verifies on them."""

    def __init__(self, linear: Linear, group: TPGroup, vocab_size: int):
        self.linear, self.group, self.vocab_size = linear, group, vocab_size

    def __call__(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.group.gather_columns(self.linear(x, **kwargs))[:, : self.vocab_size]


class VocabParallelEmbedding:
    """Embedding rows of token ids [T] → [T, hidden], from this rank's vocabulary rows
    ``weight`` [V'/tp, hidden]: each rank fills the ids it holds, zeros the rest, and the
    sum over ranks is exact (one non-zero term per row)."""

    def __init__(self, weight: torch.Tensor, group: TPGroup):
        self.weight, self.group = weight, group
        self.first = group.rank * weight.shape[0]

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(h)


def parallelize(linears: dict[str, Linear | Callable], embedding: torch.Tensor, head: str,
                group: TPGroup, vocab_size: int
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor], dict[str, Callable]]:
    """The embedding and the linears of a rank's model (``LlamaModel``): o_proj and down
    row-parallel, ``head`` (lm_head or the tied embedding) vocab-parallel, the rest as they
    are."""
    out: dict[str, Callable] = {}
    for prefix, linear in linears.items():
        if prefix == head:
            out[prefix] = VocabParallelHead(linear, group, vocab_size)
        elif prefix.endswith((".o_proj", ".down")):
            out[prefix] = RowParallel(linear, group)
        else:
            out[prefix] = linear
    return VocabParallelEmbedding(embedding, group), out
