"""The adapter: the only package of vllm_treewy that imports vllm.

`register()` is vLLM's general-plugin entry point (`vllm.general_plugins` in pyproject.toml); vLLM calls it once
in every process (front end, engine core, workers) before it builds configs and models.
"""


def register() -> None:
    from vllm.platforms import current_platform

    from vllm_treewy.vllm_plugin import (
        accepted_counts,
        config,
        full_graph_batches,
        gdn_layer,
        prefix_caching,
        pseudo_value_buffer,
        runner_v2,
        startup_memory,
        step_metadata,
        tree_admission,
        tree_budget,
        tree_runner,
        tree_runner_v2,
    )

    config.install()
    gdn_layer.install()
    pseudo_value_buffer.install()
    step_metadata.install()
    accepted_counts.install()  # V1 runner (vLLM's CPU backend runs V1)
    prefix_caching.install(runner_v2_hooks=current_platform.is_cuda())  # mamba_cache_mode "align": V1 and V2
    tree_budget.install()
    if current_platform.is_cpu():
        from vllm_treewy.vllm_plugin import cpu_rejection_expand, gdn_cpu

        gdn_cpu.install()
        cpu_rejection_expand.install()
    if current_platform.is_cuda():
        full_graph_batches.install()
        startup_memory.install()
        runner_v2.install()  # Model Runner V2, vLLM's default on CUDA: reconstruct chains
        tree_runner_v2.install()  # and draft trees
    if current_platform.is_cpu() or current_platform.is_cuda():
        tree_admission.install()  # draft trees: what each runner's tree path does not make exact, refused
        tree_runner.install()  # draft trees: vLLM's CPU attention, or TRITON_ATTN on CUDA
