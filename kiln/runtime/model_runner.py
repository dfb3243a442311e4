"""Turns a scheduled batch into model inputs, runs the model, returns sampling logits."""

from __future__ import annotations

import torch

from kiln.runtime.kv_cache import KVCache
from kiln.runtime.layers.attention import AttentionMetadata, SeqAttention
from kiln.runtime.models.llama import LlamaModel
from kiln.runtime.request import Request
from kiln.runtime.scheduler import ScheduledBatch


class ModelRunner:
    """Owns the model and the KV cache tensors; one ``execute`` per engine step."""

    def __init__(self, model: LlamaModel, cache: KVCache, device: torch.device):
        self.model = model
        self.cache = cache
        self.device = device
        self.block_size = cache.block_size

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of token indices [start, end) of a request (CPU LongTensor)."""
        idx = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[idx // self.block_size] * self.block_size + idx % self.block_size

    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Request]]:
        """Run one forward over the batch.

        Returns logits [num_sampling, vocab] (float32) and the requests they belong to:
        those whose scheduled tokens reach their last token (partial prefill chunks do not
        sample).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slot_chunks: list[torch.Tensor] = []
        seqs: list[SeqAttention] = []
        logit_rows: list[int] = []
        sampling: list[Request] = []
        for req, n in batch.items:
            start = req.num_computed_tokens
            end = start + n
            q0 = len(input_ids)
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            key_slots = self._slots(req.block_table, 0, end)
            slot_chunks.append(key_slots[start:end])
            seqs.append(SeqAttention(q0, n, end, key_slots.to(self.device, non_blocking=True)))
            if end == req.num_tokens:
                logit_rows.append(q0 + n - 1)
                sampling.append(req)
        dev = self.device
        meta = AttentionMetadata(torch.cat(slot_chunks).to(dev), seqs)
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.cache, meta,
            torch.tensor(logit_rows, dtype=torch.long, device=dev),
        )
        return logits, sampling
