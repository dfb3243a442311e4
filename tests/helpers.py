"""Helpers shared by the model and GPU tests (tests/ is on sys.path via conftest)."""

from __future__ import annotations

import torch


def mixed_prompts(seed: int = 1) -> list[list[int]]:
    """8 prompts of mixed lengths (3..40 tokens) of byte-tokenizer ids."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (k,), generator=g).tolist()
            for k in (5, 17, 30, 9, 40, 3, 22, 11)]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Exactly ``n`` greedy tokens from a transformers model (eos ignored)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, min_new_tokens=n)
    return out[0, len(prompt):].tolist()
