"""Runner bookkeeping kernels: the per-step updates that keep the GDN slots' counts (`slot_counts_*`: the node each
slot's next step commits) and, under prefix caching, the states at block boundaries (`boundary_states_*`) in step
with what the runner sampled. Each as a torch twin (`*_torch`: the CPU path and the specification) and a Triton
kernel (`*_triton`: CUDA, one launch); `dispatch` picks. No vllm: the adapter hands in vLLM's tensors."""
