"""The GDN layers under vllm-treewy's state commit, on either runner: the layer (`layer`; the CPU path's dispatch,
`cpu`), the page's pseudo-value buffer and count state (`pseudo_value_buffer`), the per-step metadata with each
slot's commit (`step_metadata`), the commit and verify launches (`reconstruct`, `store_all_tree`), the runner's GDN
groups and their count state (`groups`), the after-sampling tables (`sampling_tables`) and prefix caching's
block-boundary states (`prefix_caching`). Nothing here depends on which model runner runs."""
