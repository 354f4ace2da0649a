"""vLLM's V1 logits processors as a tree node must see them: a node at depth d sits d tokens past its request's
committed output (`v1.sampler`'s module docstring). Of vLLM's processors only min-tokens reads that length (its
`apply` masks a request's stop tokens while the committed output is shorter than min_tokens); `at_depth` gives its
view at a depth (`MinTokensAtDepth`) and every other processor unchanged.
"""

from __future__ import annotations

import torch
from vllm.utils.torch_utils import async_tensor_h2d
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor


def per_column(processor, depths: list[int]) -> list:
    """`processor` for each column of the given depths (one min-tokens view per distinct depth)."""
    at = {depth: at_depth(processor, depth) for depth in set(depths)}
    return [at[depth] for depth in depths]


def at_depth(processor, depth: int):
    """The processor as rows `depth` tokens past each request's committed output must see it: vLLM's min-tokens
    processor reads the committed output length (`MinTokensAtDepth`); every other processor as it is."""
    if depth and type(processor) is MinTokensLogitsProcessor and processor.min_toks:
        return MinTokensAtDepth(processor, depth)
    return processor


def processors_at_depth(processors, depth: int):
    return LogitsProcessors(at_depth(p, depth) for p in processors.all)


class MinTokensAtDepth:
    """vLLM's `MinTokensLogitsProcessor` (row i = request i) for rows `depth` tokens past each request's committed
    output: request i's stop tokens masked while its committed output length + depth < its min_tokens, which is
    what plain decoding masks at that position (vLLM's `apply` is the case depth 0, and its rejection sampler's
    `apply_with_spec_decode` masks a chain's draft position i at depth i). A request with structured output gets
    vLLM's own restore (a row where masking its stop tokens would leave nothing keeps them), as vLLM's processor
    does (structured outputs are refused on trees at admission; the view stays the processor's at any depth). Read
    from the processor's host state at the first `apply` (one step's view: the state does not change within a
    step)."""

    def __init__(self, processor, depth: int):
        self.processor, self.depth = processor, depth
        self.slices = None

    def is_argmax_invariant(self) -> bool:
        return False

    def _build(self, device):
        rows, tokens, restore_rows, restore_tokens = [], [], [], []
        for index, (min_tokens, output, stop_tokens, structured) in self.processor.min_toks.items():
            if len(output) + self.depth >= min_tokens:
                continue
            stops = list(stop_tokens)
            rows += [index] * len(stops)
            tokens += stops
            if structured:
                restore_rows += [index] * len(stops)
                restore_tokens += stops

        def h2d(values):
            return async_tensor_h2d(values, device=device, dtype=torch.int64)

        masked = (h2d(rows), h2d(tokens)) if rows else None
        restore = (h2d(restore_rows), h2d(restore_tokens)) if restore_rows else None
        return masked, restore

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.slices is None:
            self.slices = self._build(logits.device)
        masked, restore = self.slices
        if masked is None:
            return logits
        if restore is None:
            logits.index_put_(masked, self.processor.neg_inf_tensor)
        else:
            self.processor._mask_stop_token_logits(logits, masked, restore)
        return logits
