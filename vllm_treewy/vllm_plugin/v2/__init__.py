"""vLLM's Model Runner V2 (`vllm/v1/worker/gpu/`, vLLM's default on CUDA): its hooks only. Reconstruct chains'
counts after sampling (`accepted_counts`), prefix caching (`prefix_caching`), draft trees (`runner`, the MTP
speculator `speculator`, the sampler `sampler` with its static-shape body `acceptance` and CUDA graphs
`accept_graphs`, the state across calls `run_state`). Never imports `v1`."""
