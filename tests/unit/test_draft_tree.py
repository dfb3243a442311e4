"""DraftTree: a token tree of drafts after x, as a step lays it out (rows, offsets, mask)."""

from __future__ import annotations

import torch

from kiln.runtime.speculative.draft import DraftTree


def test_a_tree_lays_out_rows_at_their_depths_seeing_their_ancestors():
    #        x
    #      /   \
    #     5     6        nodes 0, 1
    #    / \     \
    #   7   8     9      nodes 2, 3, 4
    #   |
    #   4                node 5
    tree = DraftTree([5, 6, 7, 8, 9, 4], [-1, -1, 0, 0, 1, 2])
    assert not tree.is_chain
    assert tree.depths() == [1, 1, 2, 2, 2, 3]
    assert tree.children() == {0: {5: 1, 6: 2}, 1: {7: 3, 8: 4}, 2: {9: 5}, 3: {4: 6}}
    assert tree.paths() == [[5, 8], [6, 9], [5, 7, 4]]
    offsets, mask = tree.layout()
    assert offsets.tolist() == [0, 1, 1, 2, 2, 2, 3]
    sees = {r: set(torch.nonzero(mask[r])[:, 0].tolist()) for r in range(7)}
    assert sees == {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5},
                    6: {0, 1, 3, 6}}


def test_a_chain_is_the_causal_step_and_padding_extends_a_leaf():
    chain = DraftTree.chain([3, 4, 5])
    assert chain.is_chain and chain.parents == [-1, 0, 1]
    assert chain.layout() == (None, None)  # causal rows at offsets 0..T-1
    assert chain.paths() == [[3, 4, 5]]
    tree = DraftTree([5, 6], [-1, -1]).padded(4, 0)
    assert (tree.tokens, tree.parents) == ([5, 6, 0, 0], [-1, -1, 1, 2])
    assert DraftTree([], []).padded(2, 9) == DraftTree([9, 9], [-1, 0])


def test_a_branching_pad_takes_the_masked_path():
    """The break-even's worst case for a proposer of trees: a pad that would be a chain
    hangs its last node from x with a token its sibling lacks, so the step is masked."""
    chain = DraftTree([], []).padded(4, 9, branch=True)
    assert (chain.tokens, chain.parents) == ([9, 9, 9, 8], [-1, 0, 1, -1])
    offsets, mask = chain.layout()
    assert offsets.tolist() == [0, 1, 2, 3, 1] and not mask[4, 1]
    assert DraftTree([0, 5], [-1, 0]).padded(3, 7, branch=True).tokens == [0, 5, 1]
    tree = DraftTree([5, 6], [-1, -1])  # already branching: padded as without branch
    assert tree.padded(4, 0, branch=True) == tree.padded(4, 0)
    assert DraftTree([], []).padded(1, 9, branch=True) == DraftTree([9], [-1])
