"""Triton 3.6's interpreter made to do bf16 as the GPU does, for every test (tests/conftest.py): it casts float32 to
bfloat16 by truncation (the GPU's `cvt.rn.bf16.f32` and torch round to nearest even), and it adds and multiplies two
bf16 tensors as integers, on their bit patterns (the GPU computes the exact result rounded to bf16), and so their
`tl.dot` (the tensor cores multiply bf16 exactly and accumulate in fp32)."""

import numpy as np
import torch
import triton.language as tl


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even (torch's rounding, and the GPU's)."""
    values = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return values.bfloat16().view(torch.int16).numpy().view(np.uint16)


def _float32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_bf16_as_the_gpu(monkeypatch) -> None:
    """For one test, Triton 3.6's interpreter made to do bf16 as the GPU does: it casts float32 to bfloat16 by
    truncation (the GPU's `cvt.rn.bf16.f32` and torch round to nearest even), and it adds and multiplies two bf16
    tensors as integers, on their bit patterns (the GPU computes the exact result rounded to bf16)."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_bf16_bits(src.data), dst_type.scalar)
        return cast(self, src, dst_type)

    monkeypatch.setattr(builder, "cast_impl", cast_impl)
    for name, op in (("create_fadd", np.add), ("create_fsub", np.subtract), ("create_fmul", np.multiply),
                     ("create_fdiv", np.divide)):
        original = getattr(builder, name)

        def bf16_op(self, lhs, rhs, op=op, original=original):
            if lhs.dtype.scalar != tl.bfloat16:
                return original(self, lhs, rhs)
            # in float32, rounded to bf16 (as sm80 emulates bf16 arithmetic; a product of two bf16 is exact there)
            return interpreter.TensorHandle(_bf16_bits(op(_float32(lhs.data), _float32(rhs.data))), tl.bfloat16)

        monkeypatch.setattr(builder, name, bf16_op)
    dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = (_float32(x.data) if x.dtype.scalar == tl.bfloat16 else x.data for x in (a, b))
        return interpreter.TensorHandle(np.matmul(a_data, b_data, dtype=d.data.dtype) + d.data, d.dtype.scalar)

    monkeypatch.setattr(builder, "create_dot", create_dot)
