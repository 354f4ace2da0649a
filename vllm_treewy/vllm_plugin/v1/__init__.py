"""vLLM's V1 model runner (`vllm/v1/worker/gpu_model_runner.py`; vLLM's CPU backend, or CUDA with
VLLM_USE_V2_MODEL_RUNNER=0): its hooks only. Draft trees (`runner`, the MTP proposer `proposer`, the sampler
`sampler`), each step's accepted counts (`accepted_counts`), prefix caching (`prefix_caching`) and the FULL-graph
dispatch (`full_graph_batches`). Never imports `v2`."""
