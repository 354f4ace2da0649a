"""Model Runner V2 on vLLM's CPU backend, for host-side measurements. vLLM's CPU build picks V2 only where Triton has
a CPU backend (`vllm.triton_utils.importing.HAS_TRITON`: triton-cpu, which this machine lacks); the adapter installs
its V2 hooks on CUDA only; vLLM's GDN builder re-gathers further GDN groups from the first (`update_block_table`) on
CUDA devices only.

- `force()`, before anything imports vLLM: every Triton kernel (vLLM's and the adapter's) runs in Triton's
  interpreter, a stand-in "cpu" Triton backend lets vLLM's check pass, and VLLM_USE_V2_MODEL_RUNNER=1.
- `install_hooks()`, after the plugin's `register()`: the V2 hooks of reconstruct chains (`v2.accepted_counts`: the
  further GDN groups' commit nodes, the after-sampling hook), and the GDN builder as CUDA runs it in FULL-graph decode
  steps: its re-gather on (one `build` and one `update_block_table` a step for two GDN groups) and its decode batches
  staged into its persistent buffers (`use_full_cuda_graph`; no graph is captured or replayed here).

A measurement aid only: the interpreter makes each Triton launch take milliseconds, so wall time per step says
nothing; the adapter's own Python time and the number of launches per step carry over to CUDA.
"""

from __future__ import annotations

import os
import sys


class _StandInDriver:
    """Enough of a Triton driver for vLLM's backend check (`is_active`); nothing is compiled through it."""

    @staticmethod
    def is_active() -> bool:
        return True


def force() -> None:
    """Interpreted Triton, a "cpu" backend entry for vLLM's check, and V2 selected; before vLLM is imported."""
    if "vllm.triton_utils.importing" in sys.modules:
        raise RuntimeError("v2_cpu.force() must run before vLLM is imported (it reads Triton's backends at import)")
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    from triton.backends import Backend, backends

    backends.setdefault("cpu", Backend(compiler=None, driver=_StandInDriver))


def install_hooks() -> None:
    """The V2 hooks that reconstruct chains need (the plugin installs them on CUDA only); vLLM's GDN builders re-gather
    further groups (`update_block_table`, which vLLM turns on for CUDA devices only) and stage decode batches into their
    FULL-graph buffers, as on CUDA."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    from vllm_treewy.vllm_plugin.v2 import accepted_counts

    accepted_counts.install()
    init = GDNAttentionMetadataBuilder.__init__

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        init(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        if vllm_config.use_v2_model_runner and type(self) is GDNAttentionMetadataBuilder:
            self.supports_update_block_table = True  # vLLM's condition, less `device.type == "cuda"`
            self.mamba_aligned_state_indices = None
            self.use_full_cuda_graph = True

    GDNAttentionMetadataBuilder.__init__ = __init__
