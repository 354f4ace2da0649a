"""`SpeculativeConfig` with the two options of vllm-treewy.

- `mamba_state_commit`: "store_all" (vLLM's behaviour: one GDN state snapshot per draft position) or
  "reconstruct" (verify every draft from the one committed state, rebuild only the accepted state on commit).
- `draft_tree_widths`: children per node at each draft level; `[1] * num_speculative_tokens` is vLLM's chain.
  A tree (a width > 1) has N = w1 + w1*w2 + ... draft nodes, all verified in one target pass (with store_all, the
  baseline on CPU: a GDN state per node, each from its parent's, in 1 + N blocks per request): the user writes
  num_speculative_tokens = depth, and the config then holds N there, so that vLLM's scheduler and runner
  schedule, verify and account N draft tokens per request (`draft_tree_depth` keeps the depth).
- `draft_tree_max_batch_size` (draft trees under reconstruct, method "mtp"): T >= 0, the largest batch whose steps
  verify the tree; larger batches verify the MTP chain of the tree's depth D, which costs less verify compute (a
  tree is never used where it is slower than the chain). The rule rides on vLLM's dynamic speculative decoding: the
  config holds the schedule `[(1, T, N), (T + 1, ..., D)]` in `num_speculative_tokens_per_batch_size` (T = 0: the
  chain at every batch size), so vLLM's scheduler asks the drafter for N or D drafts per step. None (the default):
  the tree at every batch size. The user sets T from a device measurement of tree vs chain tokens/s per batch size.
  "auto": the engine picks per step, for the whole batch, the shape with more expected accepted tokens a second,
  from the acceptance it learns per request and the step times it measures per batch size (`trees.adaptive_shape`);
  the config holds a schedule with both draft counts, so that vLLM captures decode graphs for both shapes at every
  batch size (`threshold_schedule(AUTO)`), and the scheduler's hook replaces the schedule's choice each step.

The subclass lives in an importable module because the engine core unpickles `VllmConfig` before it loads
plugins. Invalid values fail while the config is built, in the front end, with one message.
"""

# No `from __future__ import annotations`: vLLM's CLI builds its arguments from these field types at run time.
from dataclasses import dataclass
from typing import Literal

import torch
from vllm.config.speculative import SpeculativeConfig
from vllm.config.utils import config
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.hashing import safe_hash

from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin import patch_points
from vllm_treewy.vllm_plugin.trees.synthetic import (
    FIRST_CHILD_KEY,
    SIBLING_KEY,
    checked_rates,
    unconditional_chain_rates,
)

MambaStateCommit = Literal["store_all", "reconstruct"]
AUTO = "auto"  # draft_tree_max_batch_size: the shape chosen per step (`trees.adaptive_shape`)
RECONSTRUCT_METHODS = ("mtp", "custom_class")
TREE_METHODS = ("mtp", "custom_class")  # drafters that propose a whole tree in node order (custom_class: tests)
GDN_LAYER_TYPE = "linear_attention"

logger = init_logger(f"vllm.{__name__}")  # under vLLM's logger: printed with its lines


def tree_metrics_note(widths: list[int], depth: int, num_nodes: int) -> str:
    """What vLLM's figures count once a tree's config holds its N nodes in num_speculative_tokens (logged once at
    start-up, where vLLM prints that config)."""
    return (f"draft_tree_widths={widths}: a draft tree of depth {depth} with {num_nodes} nodes. vLLM's config and "
            f"spec-decode figures count nodes from here on: num_speculative_tokens={num_nodes} (the drafts each "
            f"verify holds); 'Avg Draft acceptance rate' is accepted tokens over {num_nodes} nodes per verify (a path "
            f"accepts at most {depth}); the per-position acceptance has {num_nodes} positions, of which 0..{depth - 1}"
            f" are depths 1..{depth} and the rest stay 0. Acceptance at depth d: accepted at position d - 1 / drafts; "
            f"the mean acceptance length reads as for a chain of depth {depth}")


def _has_gdn_layers(model_config) -> bool:
    text_config = model_config.hf_text_config
    return GDN_LAYER_TYPE in (getattr(text_config, "layer_types", None) or ())


@config
class TreewySpeculativeConfig(SpeculativeConfig):
    """vLLM's speculative config plus vllm-treewy's GDN state commit strategy and draft tree shape."""

    mamba_state_commit: MambaStateCommit = "store_all"
    """How GDN (Gated DeltaNet) layers keep state across draft positions: "store_all" writes a full state per
    draft position (vLLM's default); "reconstruct" keeps one state per request and rebuilds the accepted one."""

    draft_tree_widths: list[int] | None = None
    """Children per node at each draft level (one entry per speculative token). None or all 1: a chain."""

    draft_tree_max_batch_size: int | str | None = None  # str: "auto" only (checked here, with one clear error)
    """Draft trees only: the largest batch (requests per step) that verifies the tree; larger batches verify the
    MTP chain of the tree's depth. None: the tree at every batch size; 0: the chain at every batch size; "auto": per
    step, whichever of the two the engine expects to accept more tokens a second with (learned acceptance, measured
    step times)."""

    synthetic_tree_acceptance_rates: list[float] | None = None
    """Synthetic tree acceptance (benchmarks only, with rejection_sample_method='synthetic' and a draft tree): per
    draft depth, the probability that a node's first child (the drafter's top candidate) is accepted given its
    parent was (conditional, unlike vLLM's synthetic_acceptance_rates; those of the chain with these rates are set
    from them). Requests may set their own in SamplingParams.extra_args under the same key."""

    synthetic_tree_sibling_rates: list[float] | None = None
    """Synthetic tree acceptance: per draft depth, the probability that a later child (rank r >= 1) is accepted given
    its parent was and the children before it were not (one rate for every rank >= 1). Required with
    synthetic_tree_acceptance_rates; requests may set their own in SamplingParams.extra_args under the same key."""

    def __post_init__(self):
        self._fill_chain_synthetic_rates()
        super().__post_init__()
        self._validate_draft_tree_widths()
        if self.mamba_state_commit == "reconstruct":
            self._validate_reconstruct()
        self._validate_draft_tree_max_batch_size()
        if self.is_draft_tree:
            self._validate_tree_drafting()
            # vLLM schedules, verifies and accounts num_speculative_tokens drafts per request: all N nodes.
            self.num_speculative_tokens = self.draft_tree.num_nodes
            logger.info_once(tree_metrics_note(self.draft_tree_widths, self.draft_tree_depth,
                                               self.num_speculative_tokens))
            if self.draft_tree_max_batch_size is not None:
                self.num_speculative_tokens_per_batch_size = threshold_schedule(
                    self.draft_tree_max_batch_size, self.draft_tree.num_nodes, self.draft_tree_depth)
        self._validate_synthetic_tree_rates()

    def _fill_chain_synthetic_rates(self) -> None:
        """Before vLLM's checks: a synthetic tree given only its tree rates gets vLLM's synthetic_acceptance_rates of
        the chain with the same rank-0 rates (what vLLM's sampler accepts the chain steps of
        draft_tree_max_batch_size with), which vLLM requires with rejection_sample_method='synthetic'."""
        first = self.synthetic_tree_acceptance_rates
        if (self.rejection_sample_method == "synthetic" and first is not None and self.draft_tree_widths
                and self.synthetic_acceptance_rates is None and self.synthetic_acceptance_length is None):
            self.synthetic_acceptance_rates = unconditional_chain_rates(
                checked_rates(FIRST_CHILD_KEY, first, len(self.draft_tree_widths)))

    def _validate_synthetic_tree_rates(self) -> None:
        first, sibling = self.synthetic_tree_acceptance_rates, self.synthetic_tree_sibling_rates
        if first is None and sibling is None:
            if self.rejection_sample_method == "synthetic" and self.is_draft_tree:
                raise ValueError(
                    f"rejection_sample_method='synthetic' with draft_tree_widths={self.draft_tree_widths} needs "
                    f"{FIRST_CHILD_KEY} and {SIBLING_KEY} (one conditional probability per draft depth each); "
                    "vLLM's synthetic_acceptance_rates / synthetic_acceptance_length describe chains only")
            return
        if self.rejection_sample_method != "synthetic" or not self.is_draft_tree:
            raise ValueError(
                f"{FIRST_CHILD_KEY} / {SIBLING_KEY} need rejection_sample_method='synthetic' and a draft tree "
                f"(draft_tree_widths with a width > 1), got rejection_sample_method={self.rejection_sample_method!r}, "
                f"draft_tree_widths={self.draft_tree_widths}; for chains use vLLM's synthetic_acceptance_rates")
        if first is None or sibling is None:
            raise ValueError(f"synthetic tree acceptance needs both {FIRST_CHILD_KEY} and {SIBLING_KEY}, got "
                             f"{FIRST_CHILD_KEY}={first}, {SIBLING_KEY}={sibling}")
        depth = self.draft_tree_depth
        self.synthetic_tree_acceptance_rates = checked_rates(FIRST_CHILD_KEY, first, depth)
        self.synthetic_tree_sibling_rates = checked_rates(SIBLING_KEY, sibling, depth)
        if current_platform.is_cpu():
            raise ValueError(f"{FIRST_CHILD_KEY}: synthetic tree acceptance runs on Model Runner V2 (CUDA); vLLM's "
                             "CPU backend runs the V1 runner, whose tree sampler has no synthetic path (and vLLM's CPU "
                             "sampler refuses synthetic chains): serve without rejection_sample_method='synthetic'")
        # vLLM's rates for the chain steps: those of the chain with the tree's rank-0 rates (set above, or given),
        # padded with zeros to the N draft tokens the config now holds (vLLM checks their count against it)
        chain = unconditional_chain_rates(self.synthetic_tree_acceptance_rates)
        given = list(self.synthetic_acceptance_rates or [])
        if len(given) < depth or any(abs(a - b) > 1e-6 for a, b in zip(given, chain)):
            raise ValueError(
                f"synthetic_acceptance_rates={given} with {FIRST_CHILD_KEY}={first}: a draft tree's synthetic "
                f"acceptance is given by {FIRST_CHILD_KEY} and {SIBLING_KEY} only (vLLM's per-position rates of "
                f"its chain steps are set from them: {chain}); leave synthetic_acceptance_rates and "
                "synthetic_acceptance_length unset")
        self.synthetic_acceptance_rates = chain + [0.0] * (self.num_speculative_tokens - depth)

    def _validate_draft_tree_max_batch_size(self) -> None:
        threshold = self.draft_tree_max_batch_size
        user_schedule = self.num_speculative_tokens_per_batch_size
        if threshold is None:
            if self.is_draft_tree and user_schedule is not None:
                raise ValueError(
                    f"num_speculative_tokens_per_batch_size={user_schedule} with draft_tree_widths="
                    f"{self.draft_tree_widths}: a draft tree verifies one static shape; to verify the chain at large "
                    "batches, set draft_tree_max_batch_size instead")
            return
        if threshold != AUTO and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0):
            raise ValueError(f"draft_tree_max_batch_size must be an integer >= 0, {AUTO!r} or None, got {threshold!r}")
        if not self.is_draft_tree:
            raise ValueError(f"draft_tree_max_batch_size={threshold} needs a draft tree (draft_tree_widths with a "
                             f"width > 1), got draft_tree_widths={self.draft_tree_widths}")
        if self.mamba_state_commit != "reconstruct" or self.method != "mtp":
            raise ValueError(f"draft_tree_max_batch_size={threshold} needs method 'mtp' and "
                             f"mamba_state_commit='reconstruct', got method={self.method!r}, "
                             f"mamba_state_commit={self.mamba_state_commit!r}")
        # A rebuilt copy arrives with the schedule this config set; any other is the user's.
        expected = threshold_schedule(threshold, self.draft_tree.num_nodes, self.draft_tree_depth)
        if user_schedule is not None and [tuple(entry) for entry in user_schedule] != expected:
            raise ValueError(
                f"num_speculative_tokens_per_batch_size={user_schedule} with draft_tree_widths="
                f"{self.draft_tree_widths}: draft_tree_max_batch_size={threshold} sets the schedule itself; "
                "give one or the other")

    def _validate_draft_tree_widths(self) -> None:
        widths = self.draft_tree_widths
        if widths is None:
            return
        if not widths or any(w < 1 for w in widths):
            raise ValueError(f"draft_tree_widths must be a non-empty list of positive integers, got {widths}")
        # A tree's config holds N there once built (see the module docstring); a rebuilt copy arrives with N.
        already_expanded = any(w > 1 for w in widths) and self.num_speculative_tokens == self.draft_tree.num_nodes
        if len(widths) != self.num_speculative_tokens and not already_expanded:
            raise ValueError(
                f"draft_tree_widths has {len(widths)} levels but num_speculative_tokens is "
                f"{self.num_speculative_tokens}: give one width per draft level"
            )

    def _validate_tree_drafting(self) -> None:
        widths = self.draft_tree_widths
        if self.method not in TREE_METHODS:
            raise ValueError(f"draft_tree_widths={widths}: draft trees (a width > 1) need method "
                             f"{' or '.join(TREE_METHODS)}, got method={self.method!r}")
        if self.target_model_config is not None and self.target_model_config.uses_mrope:
            raise ValueError(f"draft_tree_widths={widths}: models with M-RoPE positions are not supported yet (tree "
                             "tokens take depth positions on one axis)")
        if not (current_platform.is_cpu() or current_platform.is_cuda()):
            raise ValueError(f"draft_tree_widths={widths}: draft trees run on vLLM's CPU backend or on CUDA with "
                             "attention_backend 'FLASH_ATTN' or 'TRITON_ATTN' (tree attention reads those paged KV "
                             "layouts)")
        if self.draft_sample_method != "greedy" or self.use_local_argmax_reduction:
            raise ValueError(f"draft_tree_widths={widths}: a tree drafts each node's most likely tokens from the "
                             "head's logits; draft_sample_method must be 'greedy' (got "
                             f"{self.draft_sample_method!r}) and use_local_argmax_reduction off (got "
                             f"{self.use_local_argmax_reduction})")
        if self.mamba_state_commit == "store_all" and not current_platform.is_cpu():
            raise ValueError(f"draft_tree_widths={widths}: the store_all tree (a GDN state per node, the baseline "
                             "reconstruct is compared with) runs on vLLM's CPU backend only; use 'reconstruct'")

    def _validate_reconstruct(self) -> None:
        if self.method not in RECONSTRUCT_METHODS:
            raise ValueError(
                f"mamba_state_commit='reconstruct' supports method {' or '.join(RECONSTRUCT_METHODS)!s}, "
                f"got method={self.method!r}"
            )
        if self.target_model_config is not None and not _has_gdn_layers(self.target_model_config):
            architectures = getattr(self.target_model_config.hf_config, "architectures", None)
            raise ValueError(
                "mamba_state_commit='reconstruct' needs a model with Gated DeltaNet (linear_attention) layers "
                f"such as Qwen3.5 or Qwen3-Next; {architectures} has none"
            )

    @property
    def is_draft_tree(self) -> bool:
        return self.draft_tree_widths is not None and any(w > 1 for w in self.draft_tree_widths)

    @property
    def draft_tree(self) -> DraftTree:
        return DraftTree.from_widths(self.draft_tree_widths)

    @property
    def draft_tree_depth(self) -> int:
        return len(self.draft_tree_widths)

    @property
    def reconstructs_mamba_state(self) -> bool:
        return self.mamba_state_commit == "reconstruct"

    def compute_hash(self) -> str:
        # Both options change what the GDN layers compute and which state slots exist.
        factors = [super().compute_hash(), self.mamba_state_commit, self.draft_tree_widths,
                   self.draft_tree_max_batch_size]
        return safe_hash(str(factors).encode(), usedforsecurity=False).hexdigest()


# The schedule's last range ends past any batch: vLLM clamps it to max_num_seqs (`build_dynamic_sd_schedule_lookup`).
UNBOUNDED_BATCH = 1 << 30


def threshold_schedule(max_tree_batch: int | str, num_nodes: int, depth: int) -> list[tuple[int, int, int]]:
    """vLLM's dynamic speculative decoding schedule of `draft_tree_max_batch_size`: batches of 1 .. T requests
    draft the tree's N nodes, larger ones the chain of depth D. For "auto", a schedule holding both counts (vLLM
    captures decode graphs for every count a schedule holds, at every batch size); the scheduler's hook
    (`trees.adaptive_shape`) replaces its choice every step."""
    if max_tree_batch == AUTO:
        max_tree_batch = 1
    if max_tree_batch == 0:
        return [(1, UNBOUNDED_BATCH, depth)]
    return [(1, max_tree_batch, num_nodes), (max_tree_batch + 1, max(UNBOUNDED_BATCH, max_tree_batch + 1), depth)]


def reconstructs_mamba_state(speculative_config) -> bool:
    """True if this (possibly stock) speculative config asks for reconstruct-on-commit."""
    return getattr(speculative_config, "mamba_state_commit", "store_all") == "reconstruct"


def keeps_slot_counts(speculative_config) -> bool:
    """True if the GDN layers keep a per-slot count of the last verified block (`gdn.step_metadata`): reconstruct (the
    node to commit), and a store_all draft tree (the block of the accepted node, where the next step starts: vLLM's
    accepted count says how deep, not which branch)."""
    return reconstructs_mamba_state(speculative_config) or draft_tree_of(speculative_config) is not None


def draft_tree_of(speculative_config) -> DraftTree | None:
    """The static draft tree this (possibly stock) speculative config verifies; None for chains."""
    return speculative_config.draft_tree if getattr(speculative_config, "is_draft_tree", False) else None


@dataclass(frozen=True)
class DraftShape:
    """The draft shape a speculative config verifies, read from it once (`draft_shape_of`) by the object that owns
    it for the engine's life and handed down from there: the GDN counts layer (`gdn.layer`, for the step metadata,
    the commit tables and both runners' count hooks), the scheduler's `trees.budget.TreeSchedulerState`, and the
    tree drafters (`v1.proposer`, `v2.speculator`).

    - `tree`: the static draft tree (`draft_tree_widths`); None for chains.
    - `chain_count_offset`: what a chain row's recorded count (1 + its accepted block index) is offset by: 1 + N
      with a tree's `draft_tree_max_batch_size` (its steps verify the tree or the chain of the tree's depth; the
      chain's rows of `gdn.step_metadata.commit_ancestor_table` follow the tree's), else 0.
    - `adaptive`: `draft_tree_max_batch_size: "auto"`: the scheduler chooses each step's shape
      (`trees.adaptive_shape`).
    """

    tree: DraftTree | None
    chain_count_offset: int = 0
    adaptive: bool = False

    @property
    def has_chain_steps(self) -> bool:
        """A tree config with `draft_tree_max_batch_size`: some steps verify chains of the tree's depth."""
        return self.chain_count_offset > 0

    def verifies_tree(self, draft_counts, num_spec_rows: int = 0, num_spec_tokens: int = 0) -> bool:
        """Whether a step verifies the tree: always for a tree without `draft_tree_max_batch_size`; with it, when
        some row has the tree's N drafts (`trees.budget`: a step holds tree rows or chain rows, never both), or when
        the speculative rows hold more tokens than chains of the tree's depth D can (`num_spec_rows` rows,
        `num_spec_tokens` tokens, where the caller has them: the GDN metadata build). The one rule for the step's
        shape on the host: `draft_counts` are the step's per-row draft counts, a host tensor (vLLM's
        `num_decode_draft_tokens_cpu`, -1: not a decode) or a sequence of ints; None: no speculative row.

        The token rule is for vLLM's capture dummies: a piecewise graph's dummy batch splits its tokens evenly over
        its rows (1 + N tokens a row at the largest size) with draft counts of 0, and a chain step's GDN launch is
        sized for 1 + D tokens a row (its products workspace, `gdn_step_triton`'s `max_nodes`), so those rows verify
        as the tree, whose launch covers any row of up to 1 + N tokens. It applies only where no row has drafts (a
        real step's rows hold 1 + their drafts tokens, at most 1 + D in a chain step) and catches evenly split rows
        exactly: they exceed 1 + D only if their mean does."""
        if self.tree is None:
            return False
        if not self.has_chain_steps:
            return True
        if draft_counts is None:
            return False
        counts = torch.as_tensor(draft_counts)
        if num_spec_tokens > num_spec_rows * (1 + self.tree.max_depth) and not bool((counts > 0).any()):
            return True
        return bool((counts == self.tree.num_nodes).any())


def draft_shape_of(speculative_config) -> DraftShape:
    """The `DraftShape` of this (possibly stock) speculative config."""
    tree = draft_tree_of(speculative_config)
    threshold = getattr(speculative_config, "draft_tree_max_batch_size", None)
    if tree is None or threshold is None:
        return DraftShape(tree)
    return DraftShape(tree, 1 + tree.num_nodes, adaptive=threshold == AUTO)


def install() -> None:
    """Makes every place that builds a SpeculativeConfig build ours (which runner vLLM picks: `v2.accepted_counts`)."""
    for point in patch_points.SPECULATIVE_CONFIG:
        point.replace(TreewySpeculativeConfig)
