"""The slot factor rows: what a verify leaves for the commit of its accepted node, one row per draft node in the
request's state slot. The one owner of the layout: the torch views (`split_slot_factors`) and the Triton kernels' column
pointers (`factor_rows_triton._factor_columns`) both follow `slot_factor_width`'s order.

``factors [S, T, F]`` fp32 (state slot, node row, F = `slot_factor_width`); strides of the first two dims free (the
rows may be a view into vLLM's KV-cache page), last dim contiguous. A node's row holds, per VALUE head:

- ``keys [HV, K]``: the raw post-conv key row (value head hv holds a copy of its key head's row), so the program of
  (value head, request) owns every column it reads and writes: no two programs share a row segment;
- ``key_scales [HV]``: the keys' inverse L2 norms (the normalised keys are never stored: the commit folds the scale
  into u, h_a = exp(c_a) h0 + sum_j exp(c_a - c_j) (u_j key_scale_j) key_j^T);
- ``pseudo_values [HV, V]``: u;
- ``log_decays [HV]``: g.
"""

import torch


def slot_factor_width(num_v_heads: int, head_k_dim: int, head_v_dim: int) -> int:
    """F, the floats of one node's factors: keys [HV, K], key scales [HV], pseudo-values [HV, V], log decays [HV]."""
    return num_v_heads * (head_k_dim + 1 + head_v_dim + 1)


def split_slot_factors(factors: torch.Tensor, num_v_heads: int, head_k_dim: int, head_v_dim: int):
    """``[..., F]`` -> views (keys [..., HV, K], key_scales [..., HV], pseudo_values [..., HV, V], log_decays
    [..., HV])."""
    hv, kd, vd = num_v_heads, head_k_dim, head_v_dim
    assert factors.shape[-1] == slot_factor_width(hv, kd, vd)
    keys = factors[..., : hv * kd].unflatten(-1, (hv, kd))
    key_scales = factors[..., hv * kd: hv * (kd + 1)]
    pseudo_values = factors[..., hv * (kd + 1): hv * (kd + 1 + vd)].unflatten(-1, (hv, vd))
    log_decays = factors[..., hv * (kd + 1 + vd):]
    return keys, key_scales, pseudo_values, log_decays
