"""The adapter: the only package of vllm_treewy that imports vllm.

`register()` is vLLM's general-plugin entry point (`vllm.general_plugins` in pyproject.toml); vLLM calls it once
in every process (front end, engine core, workers) before it builds configs and models.

Layout (each sub-package's docstring says more):
- `config`: the speculative-config fields the plugin adds (`mamba_state_commit`, `draft_tree_widths`, ...);
  `patch_points`: every vLLM attribute the plugin wraps or replaces, checked against vLLM's source.
- `gdn/`: the GDN layer under reconstruct (and store_all trees), its pseudo-value buffer, the per-step metadata and
  commit, the GDN groups' count state, the block-boundary states of prefix caching: runner-independent.
- `trees/`: draft trees on either runner: the step and its metadata, attention (CPU, TRITON_ATTN, FLASH_ATTN), the
  drafting and sampling parts both runners share, admission, the token budget and its fallbacks, the adaptive shape.
- `v1/`, `v2/`: each model runner's hooks (vLLM's V1 runner; Model Runner V2), thin; neither imports the other.
- `compat/`: start-up fixes (vLLM's CPU wheel, start-up memory).
- `testing/`: helpers of the test suite and the demo.
"""


def register() -> None:
    # vLLM imports its plugins before its platform and configs are ready: the adapter's modules (which import vLLM's)
    # load here, when vLLM calls the entry point, not when this package is imported
    from vllm.platforms import current_platform

    from vllm_treewy.vllm_plugin import config
    from vllm_treewy.vllm_plugin.compat import cpu_rejection_expand, startup_memory
    from vllm_treewy.vllm_plugin.gdn import cpu as gdn_cpu
    from vllm_treewy.vllm_plugin.gdn import layer as gdn_layer
    from vllm_treewy.vllm_plugin.gdn import pseudo_value_buffer, step_metadata
    from vllm_treewy.vllm_plugin.trees import admission, attention, budget
    from vllm_treewy.vllm_plugin.v1 import accepted_counts as v1_accepted_counts
    from vllm_treewy.vllm_plugin.v1 import full_graph_batches
    from vllm_treewy.vllm_plugin.v1 import prefix_caching as v1_prefix_caching
    from vllm_treewy.vllm_plugin.v1 import runner as v1_runner
    from vllm_treewy.vllm_plugin.v2 import accepted_counts as v2_accepted_counts
    from vllm_treewy.vllm_plugin.v2 import prefix_caching as v2_prefix_caching
    from vllm_treewy.vllm_plugin.v2 import runner as v2_runner

    config.install()
    gdn_layer.install()
    pseudo_value_buffer.install()
    step_metadata.install()
    v1_accepted_counts.install()  # V1 runner (vLLM's CPU backend runs V1)
    # mamba_cache_mode "align": V2's feature check everywhere, V1's hooks, V2's model-state hooks where V2 runs
    v2_prefix_caching.install(model_state_hooks=current_platform.is_cuda())
    v1_prefix_caching.install()
    budget.install()
    if current_platform.is_cpu():
        gdn_cpu.install()
        cpu_rejection_expand.install()
    if current_platform.is_cuda():
        full_graph_batches.install()
        startup_memory.install()
        v2_accepted_counts.install()  # Model Runner V2, vLLM's default on CUDA: reconstruct chains
        v2_runner.install()  # and draft trees
    if current_platform.is_cpu() or current_platform.is_cuda():
        admission.install()  # draft trees: what each runner's tree path does not make exact, refused
        v1_runner.install()  # draft trees on the V1 runner: vLLM's CPU attention, or TRITON_ATTN / FLASH_ATTN on CUDA
        attention.install()  # and the attention backends' tree rows, for either runner
