"""The slot factor rows' layout (`vllm_treewy.kernels.factor_rows`) on the Triton side: a value head's column
pointers in a slot's rows, for the kernels that write them (the GDN step's epilogues) and read them (the commit in
the state pass, the boundary states)."""

import triton
import triton.language as tl


@triton.jit
def _factor_columns(factors, slot, stride_fslot, i_hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Pointers to value head i_hv's columns of the slot's row 0 (`split_slot_factors`' order): its key [K], key
    scale, pseudo-value [V] and log decay; row r at + r * the row stride."""
    f_slot = factors + slot * stride_fslot
    return (f_slot + i_hv * K, f_slot + HV * K + i_hv, f_slot + HV * (K + 1) + i_hv * V,
            f_slot + HV * (K + 1 + V) + i_hv)
