"""What the tests, benchmarks and demo run beside the plugin, not in serving: the tie-aware equivalence harness
against the no-speculation engine (`equivalence`), a deterministic draft-tree drafter that knows the target's
continuations (`continuation_drafter`, method custom_class) and the demo (`python -m
vllm_treewy.vllm_plugin.testing.demo`)."""
