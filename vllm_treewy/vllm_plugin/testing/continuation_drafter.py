"""A deterministic draft-tree proposer for tests: vLLM loads it with method="custom_class" and
model="vllm_treewy.vllm_plugin.testing.continuation_drafter.ContinuationTreeDrafter".

It knows the target's own greedy continuations (sequences computed with the no-speculation engine, read from a
JSON file that `write_drafts_file` writes: {"sequences": [prompt + continuation, ...], "true_branch": b,
"perturbed_branch": c or null}). It reads the file named by `$VLLM_TREEWY_TEST_DRAFTS` when the engine starts, and
another one whenever a test names it with `serve_drafts(llm, path)` (between `generate` calls): from the next step
on it serves that file's drafts only, so one engine can run several tests' drafts, one `generate` after another.
For a request whose tokens so far are a prefix of a known sequence, the next `depth` true tokens go on one path of
the tree: child `min(b, width - 1)` at every level. Every other node carries a token that differs from its level's
true token (and from its siblings'), so only that path can be accepted. Unknown requests (or ones that left the
known continuation, e.g. at a bf16 tie) get only such wrong tokens. Drafts come in node order
(`DraftTree.from_widths`), N per request, so every speculative step verifies the whole tree. `perturbed_branch`
(sibling-isolation tests): the subtree under root child c gets other tokens (shifted by `PERTURBATION`), unless it
holds the true path.
"""

from __future__ import annotations

import json
import os

import numpy as np

from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.trees.run_state import TreeRunState

DRAFTS_ENV = "VLLM_TREEWY_TEST_DRAFTS"
PERTURBATION = 7  # > any sibling rank: a perturbed node's token still differs from its siblings'


def write_drafts_file(path, sequences: list[list[int]], true_branch: int = 0,
                      perturbed_branch: int | None = None) -> str:
    """Writes what `ContinuationTreeDrafter` reads; returns the path (for `$VLLM_TREEWY_TEST_DRAFTS`)."""
    with open(path, "w") as f:
        json.dump({"sequences": [list(map(int, s)) for s in sequences], "true_branch": true_branch,
                   "perturbed_branch": perturbed_branch}, f)
    return str(path)


def serve_drafts(llm, path) -> None:
    """A running engine's `ContinuationTreeDrafter` serves the drafts of this file from its next step on (call it
    between `generate` calls)."""
    llm.collective_rpc(_load_drafts, args=(str(path),))


def _load_drafts(worker, path: str) -> None:
    worker.model_runner.drafter.load_drafts(path)


def tree_drafts(widths: list[int], truth: list[int] | None, true_branch: int, vocab_size: int, filler: int,
                perturbed_branch: int | None = None) -> list[int]:
    """The N draft tokens of one request in node order: `truth` (length = depth, or None) on the true path, tokens
    that differ from their level's true token elsewhere (`filler` stands in for an unknown truth)."""
    tree = DraftTree.from_widths(widths)
    tokens, on_true_path, sibling_rank, branch = [], [], {}, []
    for node, parent in enumerate(tree.parents):
        level = tree.depth[node] - 1
        rank = sibling_rank[parent] = sibling_rank.get(parent, -1) + 1
        branch.append(rank if parent < 0 else branch[parent])
        true_node = truth is not None and (parent < 0 or on_true_path[parent]) and rank == min(true_branch,
                                                                                              widths[level] - 1)
        on_true_path.append(true_node)
        level_truth = truth[level] if truth is not None else filler
        shift = PERTURBATION if branch[node] == perturbed_branch else 0
        tokens.append(level_truth if true_node else (level_truth + 1 + rank + shift) % vocab_size)
    return tokens


class ContinuationTreeDrafter:
    """vLLM custom_class proposer (`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)`)."""

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.widths = list(spec.draft_tree_widths or [1] * spec.num_speculative_tokens)
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.max_model_len = vllm_config.model_config.max_model_len
        path = os.environ.get(DRAFTS_ENV)
        if not path:
            raise ValueError(f"ContinuationTreeDrafter reads the target's continuations from ${DRAFTS_ENV}")
        self.load_drafts(path)
        tree = DraftTree.from_widths(self.widths)
        self.tree_state = TreeRunState(tree) if any(w > 1 for w in self.widths) else None  # the runner's tree state

    def load_drafts(self, path) -> None:
        """The drafts of this file (`write_drafts_file`) replace those served so far."""
        with open(path) as f:
            known = json.load(f)
        self.sequences = [np.asarray(s, dtype=np.int64) for s in known["sequences"]]
        self.true_branch = int(known.get("true_branch", 0))
        self.perturbed_branch = known.get("perturbed_branch")

    def _truth(self, tokens: np.ndarray) -> list[int] | None:
        depth = len(self.widths)
        for sequence in self.sequences:
            if len(sequence) >= len(tokens) + depth and np.array_equal(sequence[: len(tokens)], tokens):
                return sequence[len(tokens) : len(tokens) + depth].tolist()
        return None

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        drafts = []
        for i, sampled in enumerate(sampled_token_ids):
            num_tokens = int(num_tokens_no_spec[i])
            if not sampled or num_tokens >= self.max_model_len:  # a partial prefill, or no room left
                drafts.append([])
                continue
            tokens = token_ids_cpu[i, :num_tokens]
            drafts.append(tree_drafts(self.widths, self._truth(tokens), self.true_branch, self.vocab_size,
                                      filler=int(tokens[-1]), perturbed_branch=self.perturbed_branch))
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        pass
