"""Draft trees, on either runner: the step (`step`) and its metadata (`metadata`), the state across a step's calls
(`run_state`), tree attention (`attention`: the backends' hooks; `attention_cpu`, `attention_triton`,
`attention_flash`), what both runners' drafters and samplers share (`drafting`, `sampling`, `min_tokens_at_depth`),
admission (`admission`), the scheduler's token budget and its fallbacks (`budget`, `fallbacks`), and its choice of the
tree or the chain each step under `draft_tree_max_batch_size: "auto"` (`adaptive_shape`). No module here imports `v1`
or `v2`."""
