"""What vLLM must be told on the gpu-vllm site (../shared/tools/gpu-vllm/README.md): FlashAttention's and
FlashInfer's compiled kernels do not travel, so the target and the MTP drafter both run Triton attention and the
GDN prefill runs its Triton kernel. Everything else stays vLLM's default."""

ENGINE = {"attention_backend": "TRITON_ATTN", "gdn_prefill_backend": "triton"}
# The drafter picks its own backend (FLASH_ATTN first on CUDA) unless told.
SPECULATIVE = {"attention_backend": "TRITON_ATTN"}
