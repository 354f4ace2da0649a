"""Sampling of a step with draft-tree rows: tree acceptance with vLLM's own sampler, then the accepted path made into
what vLLM expects of a chain.

Tree acceptance (`spec_decode.tree_sampling`, whose docstring proves that the emitted tokens follow the target's
sampling distribution) draws with vLLM's `Sampler` and the request's own sampling parameters (temperature, top-k,
top-p, min-p, allowed tokens, logits processors; greedy requests take the argmax, so greedy trees accept as
`greedy_tree_acceptance` does). One production path per kind of batch, chosen by what the batch needs:

- Every node at once (`_sample_every_node`; batches without penalties, bad words, per-request seeds or logprobs of
  chosen token ids): ONE sampler call over every logits row of the step (each tree row's
  root and N nodes, every other request's one row), with the per-request metadata expanded to the rows as vLLM's
  rejection sampler expands it to draft tokens (temperature, top-k, top-p and the allowed-token mask gathered by
  each row's request; a logits processor that is not idle applied once per verified-block column over one row per
  request, as it expects). The walk then reads the draws at the nodes it visits (`uniform_tree_acceptance`, a
  fixed number of ops). No host syncs.
- Level by level (`_LevelSampler`; the other batches): at each of the depth + 1 levels one sampler call over one
  logits row per request (a tree row: its walk's current node; any other request: its one row), because their draw
  depends on the path: penalties and bad words see the committed output plus the path walked so far
  (`spec_token_ids`), and a seeded request draws once per emitted token, as without speculation (at a level where
  it is not walking, because it has no tree this step or its walk stopped, its generator gets its state back after
  the level's call, so its seeded stream is the one it would have without speculation). Both need the path on the
  host: one device sync per level.

A thinking-token budget is refused at admission on V1 trees (`v1.runner.REFUSED_ON_V1_TREES`): vLLM's tracker
(`ThinkingBudgetStateHolder`, called inside its sampler) counts a row's context as the committed output plus
`spec_token_ids` (a tree row's drafts in node order, not the path walked) and advances its state on every call (the
level path would call it once per level), so it would force the end of thinking at the wrong node. A batch whose
tracker holds requests raises here instead of being sampled.

What depends on how many tokens a request has emitted sees each row at its own position: a node at depth d sits
d tokens past the committed output, as plain decoding would there. vLLM's min-tokens processor reads the committed
output length (its `apply` masks a request's stop tokens at every row while that length is short); both paths give
it each row's depth (`trees.min_tokens_at_depth`: the one-call path per verified-block column, whose depth
`block_depths` gives; the level path per level), so a stop token is masked exactly while committed + depth < min_tokens,
at the root, at every node and at the bonus (vLLM's own chain masks its draft rows so, `apply_with_spec_decode`, but its
bonus row at the committed length). Stop tokens, EOS and max_tokens act after sampling, in vLLM's scheduler, token by
token over the emitted row, as for a chain.

Each tree row's output becomes `[accepted path tokens..., bonus, -1...]`, so vLLM's bookkeeping counts
num_accepted_tokens = accepted + 1 and advances num_computed_tokens past the root and the accepted path; its
logprobs (when asked) are the sampler's at each emitted position (the row of the node the token was drawn at), laid
out as vLLM's rejection sampler lays out a chain's (`[num_reqs * (1 + N), k + 1]`, position i of request r at row
r * (1 + N) + i). For that to hold, right after acceptance:

- full-attention K/V of the accepted path move behind the root (`trees.sampling.commit_accepted_path`, every layer the
  step's forward recorded), where vLLM's next steps read positions num_computed .. ;
- each GDN slot's count state (in vLLM's KV cache, `gdn.pseudo_value_buffer`) records 1 + the verified-block index of
  the accepted leaf, which the next step's GDN metadata turns into the node its commit follows (`gdn.step_metadata`).
"""

from __future__ import annotations

import dataclasses

import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)

from vllm_treewy.kernels.tree_acceptance_torch import PLACEHOLDER_TOKEN
from vllm_treewy.spec_decode.acceptance import TreeAcceptance
from vllm_treewy.spec_decode.tree_sampling import sampled_tree_acceptance, sampled_tree_acceptance_of_draws
from vllm_treewy.vllm_plugin.trees.min_tokens_at_depth import at_depth, per_column, processors_at_depth
from vllm_treewy.vllm_plugin.trees.sampling import (
    commit_accepted_path,
    tree_output_rows,
    walk_tables,
)
from vllm_treewy.vllm_plugin.trees.step import TreeStep, block_depths

LOGPROBS_FIELDS = ("logprob_token_ids", "logprobs", "selected_token_ranks")  # vLLM's LogprobsTensors, per row


def _needs_path_on_host(sampling_metadata) -> bool:
    """Whether a request's draw depends on the path walked before it (penalties, bad words) or must come from its own
    seeded stream once per emitted token: the level-by-level path."""
    return (not sampling_metadata.no_penalties or bool(sampling_metadata.bad_words_token_ids)
            or bool(sampling_metadata.generators))


def _needs_level_path(sampling_metadata) -> bool:
    """The batch's draws must be made level by level: the path on the host or logprobs of chosen token ids (keyed
    by request row)."""
    return _needs_path_on_host(sampling_metadata) or bool(sampling_metadata.logprob_token_ids)


class _LevelSampler:
    """vLLM's sampler over one row per request, once per level; keeps each level's draws and logprobs."""

    def __init__(self, sampler, sampling_metadata, logits, sampled_end, step, draft_tokens):
        self.sampler, self.sampling_metadata, self.logits = sampler, sampling_metadata, logits
        self.step, self.drafts = step, draft_tokens.long().view(step.num_requests, step.tree.num_nodes)
        self.rows = sampled_end - 1  # every request's last logits row; a tree row's is replaced per level
        self.block_starts = sampled_end[step.request_indices] - step.block_len  # [R] each tree row's root row
        self.draws, self.logprobs = [], []
        self.path_on_host = _needs_path_on_host(sampling_metadata)
        self.path: list[list[int]] = [[] for _ in range(sampled_end.numel())]  # per request, on the host
        self.tree_rows = set(step.request_indices.tolist()) if self.path_on_host else set()
        self.depth_keyed = any(at_depth(p, 1) is not p for p in sampling_metadata.logitsprocs.all)

    def __call__(self, level: int, block_rows: torch.Tensor) -> torch.Tensor:
        # block_rows: each tree row's current token in the packed verified blocks (walk_tree's numbering); its
        # index inside the request's block is block_rows - request * block_len.
        within = block_rows - torch.arange(self.step.num_requests, device=block_rows.device) * self.step.block_len
        rows = self.rows.clone()
        rows[self.step.request_indices] = self.block_starts + within
        metadata = self.sampling_metadata
        if self.path_on_host:
            metadata = dataclasses.replace(metadata, spec_token_ids=[list(p) for p in self.path])
        if self.depth_keyed:
            # a walking tree row sits `level` tokens past its committed output (any other row's draw at a level > 0
            # is not read)
            metadata = dataclasses.replace(metadata, logitsprocs=processors_at_depth(metadata.logitsprocs, level))
        # Seeded requests that do not walk this level: their generators' states, to give back after the draw.
        held = {request: generator.get_state() for request, generator in metadata.generators.items()
                if level > 0 and not self._walking(request, level)}
        output = self.sampler(self.logits[rows], metadata, predict_bonus_token=True)
        for request, state in held.items():
            metadata.generators[request].set_state(state)
        draws = output.sampled_token_ids.view(-1).long()
        self.draws.append(draws)
        self.logprobs.append(output.logprobs_tensors)
        tree_draws = draws[self.step.request_indices]
        if self.path_on_host and level < self.step.depth:
            self._extend_paths(level, within, tree_draws)
        return tree_draws

    def _walking(self, request: int, level: int) -> bool:
        """Whether a request's walk reached this level (it moved at every level before)."""
        return request in self.tree_rows and len(self.path[request]) == level

    def _extend_paths(self, level: int, within: torch.Tensor, tree_draws: torch.Tensor) -> None:
        """The path each tree row walks next level: its tokens so far plus this level's draw where a child carries
        it (the walk's own test, repeated on the host)."""
        tree = self.step.tree
        current = (within - 1).tolist()
        drawn = tree_draws.tolist()
        drafts = self.drafts.tolist()
        for i, request in enumerate(self.step.request_indices.tolist()):
            if len(self.path[request]) != level:
                continue  # stopped earlier
            children = [n for n, parent in enumerate(tree.parents) if parent == current[i]]
            if any(drafts[i][n] == drawn[i] for n in children):
                self.path[request].append(drawn[i])


def refuse_thinking_budget(sampling_metadata) -> None:
    """Raises when vLLM's thinking-budget tracker holds a request of the batch: refused at admission on V1 trees
    (module docstring), so one that reaches the tree sampler is not sampled with the wrong context."""
    holder = sampling_metadata.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        raise NotImplementedError("draft_tree_widths on the V1 model runner: thinking_token_budget is refused at "
                                  "admission (vLLM's budget tracker reads a tree row's drafts as a chain), yet a "
                                  "batch with a tracked budget reached the tree sampler")


def sample_with_trees(logits: torch.Tensor, spec_decode_metadata, step: TreeStep, sampler, sampling_metadata
                      ) -> tuple[torch.Tensor, TreeAcceptance, object]:
    """`sampled_token_ids [num_reqs, 1 + N]` of a step with tree rows (other rows: one token), after the accepted
    paths' K/V compaction; the tree rows' acceptance; and the logprobs tensors (None unless asked). The path by what
    the batch needs (module docstring). A thinking budget raises (`refuse_thinking_budget`)."""
    refuse_thinking_budget(sampling_metadata)
    sampled_end = spec_decode_metadata.cu_num_sampled_tokens.long()  # each row's drafts + 1, summed: on the device
    draft_tokens = spec_decode_metadata.draft_token_ids  # only tree rows have drafts (partial trees are refused)
    sample = _sample_by_levels if _needs_level_path(sampling_metadata) else _sample_every_node
    out, acceptance, logprobs = sample(logits, sampled_end, draft_tokens, step, sampler, sampling_metadata)
    commit_accepted_path(step, acceptance)
    return out, acceptance, logprobs


def _sample_by_levels(logits, sampled_end, draft_tokens, step: TreeStep, sampler, sampling_metadata):
    levels = _LevelSampler(sampler, sampling_metadata, logits, sampled_end, step, draft_tokens)
    acceptance = sampled_tree_acceptance(step.parents, step.cu_nodes, draft_tokens, step.depth, levels)
    out = torch.full((sampled_end.numel(), step.block_len), PLACEHOLDER_TOKEN, dtype=torch.long, device=logits.device)
    out[:, 0] = levels.draws[0]
    out[step.request_indices, : step.depth + 1] = tree_output_rows(step, draft_tokens, acceptance)
    return out, acceptance, _chain_layout_logprobs(levels.logprobs, step.block_len)


def _sample_every_node(logits, sampled_end, draft_tokens, step: TreeStep, sampler, sampling_metadata):
    """One draw at every logits row in one sampler call, then the walk over the tree rows' draws (module
    docstring)."""
    device = logits.device
    num_reqs, num_rows, block_len = sampled_end.numel(), logits.shape[0], step.block_len
    last_rows = sampled_end - 1  # every request's last logits row: a non-tree request's only one
    block_starts = sampled_end[step.request_indices] - block_len
    block_rows = block_starts[:, None] + torch.arange(block_len, device=device)  # [R, 1 + N]
    metadata = _node_rows_metadata(sampling_metadata, lambda: _row_requests(sampled_end, num_rows),
                                   lambda: _block_columns(last_rows, block_rows, step.request_indices,
                                                          block_depths(step.tree).tolist()))
    output = sampler(logits, metadata, predict_bonus_token=True)
    draws = output.sampled_token_ids.view(-1)
    acceptance = sampled_tree_acceptance_of_draws(walk_tables(step.tree.parents, device),
                                                  draft_tokens.view(step.num_requests, -1), draws[block_rows])
    out = torch.full((num_reqs, block_len), PLACEHOLDER_TOKEN, dtype=torch.long, device=device)
    out[:, 0] = draws[last_rows]
    out[step.request_indices, : step.depth + 1] = tree_output_rows(step, draft_tokens, acceptance)
    logprobs = output.logprobs_tensors
    if logprobs is not None:
        # Position i of a tree row: the row its i-th emitted token was drawn at (the root, then the accepted nodes;
        # past the path, rows whose values vLLM drops with the placeholder tokens).
        emitted_rows = last_rows[:, None].repeat(1, block_len)
        emitted_rows[step.request_indices, : step.depth + 1] = block_rows[:, :1] + torch.nn.functional.pad(
            acceptance.accepted_nodes + 1, (1, 0))
        index = emitted_rows.view(-1)
        logprobs = logprobs._replace(**{name: getattr(logprobs, name)[index] for name in LOGPROBS_FIELDS})
    return out, acceptance, logprobs


def _row_requests(sampled_end: torch.Tensor, num_rows: int) -> torch.Tensor:
    """`[num_rows]` int64: the request of every logits row (`sampled_end [num_reqs]`: each request's rows end)."""
    return torch.searchsorted(sampled_end, torch.arange(num_rows, device=sampled_end.device), right=True)


def _node_rows_metadata(sampling_metadata, row_requests, columns):
    """vLLM's per-request sampling metadata for every logits row (`row_requests()`: `[rows]` each row's request,
    built only if a field needs it), as vLLM's rejection sampler expands it to draft tokens; logits processors that
    are not idle wrapped to run once per verified-block column (`columns()`: `_block_columns`), min-tokens at the
    column's depth (`trees.min_tokens_at_depth`). Only for batches
    `_needs_level_path` lets through (no penalties, bad words, generators: nothing else keyed by request row is
    read)."""
    rows = []

    def by_row(values):
        if values is None:
            return None
        if not rows:
            rows.append(row_requests())
        return values[rows[0]]

    processors = sampling_metadata.logitsprocs
    active = [p for p in processors.all if not _idle(p)]
    if active:
        rows_of_columns, valid, depths = columns()
        processors = LogitsProcessors(_ColumnwiseProcessor(per_column(p, depths), rows_of_columns, valid)
                                      for p in active)
    return dataclasses.replace(
        sampling_metadata, temperature=by_row(sampling_metadata.temperature), top_p=by_row(sampling_metadata.top_p),
        top_k=by_row(sampling_metadata.top_k), allowed_token_ids_mask=by_row(sampling_metadata.allowed_token_ids_mask),
        logitsprocs=processors)


def _idle(processor) -> bool:
    """vLLM's built-in logits processors that no request of the batch uses (their `apply` returns the logits as
    they are); any other processor counts as in use."""
    if type(processor) is MinPLogitsProcessor:
        return not processor.min_p_count
    if type(processor) is LogitBiasLogitsProcessor:
        return not processor.biases
    if type(processor) is MinTokensLogitsProcessor:
        return not processor.min_toks
    return False


def _block_columns(last_rows: torch.Tensor, block_rows: torch.Tensor, tree_requests: torch.Tensor,
                   depths: list[int]):
    """`(rows [1 + N, num_reqs], valid [1 + N, num_reqs], depths)`: column j holds one logits row per request, a tree
    row's verified-block token j or any other request's one row (valid only in column 0); `depths [1 + N]` (host
    ints, `block_depths`): how many tokens past the committed output column j's valid rows sit."""
    block_len = block_rows.shape[1]
    rows = last_rows[None, :].repeat(block_len, 1)
    rows[:, tree_requests] = block_rows.T
    valid = torch.zeros_like(rows, dtype=torch.bool)
    valid[0] = True
    valid[:, tree_requests] = True
    return rows, valid, depths


class _ColumnwiseProcessor:
    """A vLLM logits processor (row i of its logits = request i) applied to every logits row of the step: once per
    verified-block column, over one row per request (`processors[j]`: column j's, the processor itself or, for
    min-tokens, its view at the column's depth); rows that a column repeats for a request without that column (a
    non-tree request's one row) are left as they were."""

    def __init__(self, processors: list, rows: torch.Tensor, valid: torch.Tensor):
        self.processors, self.rows, self.valid = processors, rows, valid

    def is_argmax_invariant(self) -> bool:
        return self.processors[0].is_argmax_invariant()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for processor, rows, valid in zip(self.processors, self.rows, self.valid):
            processed = processor.apply(logits[rows])
            logits[rows] = torch.where(valid[:, None], processed, logits[rows])
        return logits


def _chain_layout_logprobs(per_level: list, block_len: int):
    """Each level's `[num_reqs, k + 1]` logprobs as vLLM's chain layout `[num_reqs * block_len, k + 1]` (positions
    past the levels are zeros; vLLM's parse keeps only the emitted positions)."""
    if per_level[0] is None:
        return None
    fields = []
    for name in LOGPROBS_FIELDS:
        stacked = torch.stack([getattr(level, name) for level in per_level], dim=1)  # [num_reqs, levels, ...]
        padded = stacked.new_zeros(stacked.shape[0], block_len, *stacked.shape[2:])
        padded[:, : stacked.shape[1]] = stacked
        fields.append(padded.flatten(0, 1))
    return type(per_level[0])(*fields)


