"""Tree drafting from MTP logits, tree acceptance and the verification budget (no vllm import). Not written yet:
MTP chains need nothing here, vLLM drafts and verifies them."""
