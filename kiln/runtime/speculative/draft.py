"""What a speculative worker proposes for one request's next step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

NO_WARP = (0.0, 1.0, 0.0)  # a plan's (top_k, top_p, min_p) without any of them


@dataclass
class DraftPlan:
    """The tokens one request feeds in its next step: x (the last committed token) first.

    ``position_offsets`` [T] (offset from x's position; None = 0..T-1, a chain) and
    ``step_mask`` [T, T] bool (None = causal) describe the in-step tree. Row ``r`` writes
    its KV at the request's token index ``p + r`` (p = x's position); the worker moves the
    accepted rows' KV to their final indices afterwards. ``data`` is the worker's own.

    ``device_slot``: the plan is proposed and verified on the device, from this slot of
    the engine's ``DeviceLookahead``, around the step's forward (the model runner's
    ``DeviceSpecStep``); ``token_ids`` then holds x and placeholders, and ``inv_temp`` (0:
    greedy), ``key`` and ``warp`` (top_k, top_p, min_p) say how the device verifies it
    (``SpecEntries``).
    """

    token_ids: list[int]
    position_offsets: torch.Tensor | None = None
    step_mask: torch.Tensor | None = None
    data: Any = None
    device_slot: int | None = None
    inv_temp: float = 0.0
    key: int = 0
    warp: tuple[float, float, float] = NO_WARP

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class DraftTree:
    """Draft tokens after x as a token tree: node i holds ``tokens[i]`` and hangs from node
    ``parents[i]`` (-1: from x), parents before children, siblings holding distinct tokens.
    In a step, x is row 0 and node i is row i + 1, at its depth's offset from x, seeing
    its ancestors and itself. A chain is the tree whose node i hangs from node i - 1."""

    tokens: list[int]
    parents: list[int]

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Each node's offset from x (1 for x's children)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self) -> dict[int, dict[int, int]]:
        """Per row with children (0: x, i + 1: node i), their rows by their tokens."""
        kids: dict[int, dict[int, int]] = {}
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            kids.setdefault(p + 1, {})[t] = i + 1
        return kids

    def paths(self) -> list[list[int]]:
        """The tokens from x's child to each leaf."""
        kids = self.children()
        out = []
        for i in range(len(self.tokens)):
            if i + 1 not in kids:
                path, j = [], i
                while j >= 0:
                    path.append(self.tokens[j])
                    j = self.parents[j]
                out.append(path[::-1])
        return out

    def layout(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's ``position_offsets`` [T] and ``step_mask`` [T, T] (None, None for a
        chain: causal rows at offsets 0..T-1)."""
        if self.is_chain:
            return None, None
        t = len(self.tokens) + 1
        mask = torch.zeros(t, t, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            mask[i + 1] = mask[p + 1]
            mask[i + 1, i + 1] = True
        return torch.tensor([0, *self.depths()], dtype=torch.long), mask

    def padded(self, size: int, token: int, branch: bool = False) -> DraftTree:
        """The tree grown to ``size`` nodes by a chain of ``token`` under its last node (a
        leaf: parents come before children), or under x when it is empty. ``branch``: a
        padded tree that would be a chain hangs its last node from x instead, with a token
        its sibling does not hold, so the step takes the masked (tree) path, as a proposer
        of trees may."""
        tokens, parents = list(self.tokens), list(self.parents)
        while len(tokens) < size:
            parents.append(len(tokens) - 1)
            tokens.append(token)
        tree = DraftTree(tokens, parents)
        if branch and size >= 2 and tree.is_chain:
            first = tokens[0]
            tokens[-1] = first - 1 if first > 0 else first + 1
            parents[-1] = -1
            tree = DraftTree(tokens, parents)
        return tree
