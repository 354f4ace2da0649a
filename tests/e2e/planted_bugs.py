"""State-commit bugs planted into vLLM's own store_all path, to show the equivalence check can fail."""

import contextlib
import dataclasses

import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as cpu_gdn


def _resume_from_previous_position(num_accepted):
    """Off by one: resumes from the state one position before the last accepted token."""
    return (num_accepted - 1).clamp(min=1)


def _resume_from_last_draft(num_accepted, num_columns):
    """No rollback: resumes from the state after the last draft, as if every draft had been accepted."""
    return num_accepted * 0 + num_columns


@contextlib.contextmanager
def planted_state_commit_bug(kind: str):
    """Rewrites `num_accepted_tokens` (which selects the GDN state and conv offset to resume from)."""
    original = cpu_gdn._spec_forward

    def buggy_spec_forward(layer, metadata, *args, **kwargs):
        num_accepted = metadata.num_accepted_tokens
        if kind == "off_by_one":
            wrong = _resume_from_previous_position(num_accepted)
        elif kind == "no_rollback":
            wrong = _resume_from_last_draft(num_accepted, metadata.spec_state_indices_tensor.shape[1])
        else:
            raise ValueError(kind)
        return original(layer, dataclasses.replace(metadata, num_accepted_tokens=wrong), *args, **kwargs)

    cpu_gdn._spec_forward = buggy_spec_forward
    try:
        yield
    finally:
        cpu_gdn._spec_forward = original
