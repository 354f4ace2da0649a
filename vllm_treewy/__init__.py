"""vllm-treewy: reconstruct-on-commit GDN state and draft trees for speculative decoding in vLLM.

The math and kernels (`vllm_treewy.tree`, `vllm_treewy.kernels`, `vllm_treewy.spec_decode`) are plain torch and
Triton; `vllm_treewy.vllm_plugin` is the only package that imports vllm.
"""
