"""The adapter: the only package of vllm_treewy that imports vllm."""


def register() -> None:
    """vLLM general-plugin entry point (runs once in every vLLM process)."""
