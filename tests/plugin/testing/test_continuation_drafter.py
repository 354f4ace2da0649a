"""The test drafter: the true continuation on exactly one root-to-leaf path, wrong tokens everywhere else."""

import numpy as np
import pytest

from vllm_treewy.spec_decode.acceptance import greedy_tree_acceptance_reference
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.testing.continuation_drafter import tree_drafts

VOCAB = 512


@pytest.mark.parametrize("widths", [[2, 1, 1], [2, 2, 1], [3, 2, 2], [4, 2], [1, 1, 1]])
@pytest.mark.parametrize("branch", [0, 1, 5])
def test_only_the_true_path_is_accepted(widths, branch):
    tree = DraftTree.from_widths(widths)
    truth = [7, 11, 13][: len(widths)]
    tokens = tree_drafts(widths, truth, branch, VOCAB, filler=0)
    assert len(tokens) == tree.num_nodes
    # A target that predicts the truth at the root and along the true path accepts the whole depth there.
    argmax = [truth[0]] + [truth[tree.depth[n]] if tree.depth[n] < len(truth) else 99 for n in range(tree.num_nodes)]
    path, _ = greedy_tree_acceptance_reference(tree.parents, tokens, argmax)
    assert [tokens[n] for n in path] == truth
    assert path[0] == min(branch, widths[0] - 1)
    for parent in set(tree.parents):  # siblings carry distinct tokens
        children = [tokens[n] for n, p in enumerate(tree.parents) if p == parent]
        assert len(children) == len(set(children))


def test_unknown_continuation_drafts_only_wrong_tokens():
    tokens = tree_drafts([2, 2], None, 0, VOCAB, filler=40)
    assert 40 not in tokens and len(tokens) == 6
    assert np.all(np.asarray(tokens) < VOCAB)


def test_perturbed_branch_changes_only_its_subtree():
    widths = [3, 2]
    tree = DraftTree.from_widths(widths)
    plain = tree_drafts(widths, [5, 9], 0, VOCAB, filler=0)
    perturbed = tree_drafts(widths, [5, 9], 0, VOCAB, filler=0, perturbed_branch=2)
    subtree = {2} | {n for n, p in enumerate(tree.parents) if p == 2}
    assert [n for n in range(tree.num_nodes) if plain[n] != perturbed[n]] == sorted(subtree)
