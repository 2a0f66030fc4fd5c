"""bf16 in Triton's interpreter as the GPU computes it, for tests that run someone else's kernels.

Triton 3.6's interpreter stores bf16 as uint16 bit patterns and then:
- does bf16 arithmetic and comparisons on those integers (``bf16 * bf16`` multiplies the bit
  patterns);
- truncates fp32 -> bf16 casts and mangles subnormals in bf16 -> fp32 ones.

Our kernels avoid all three (kernels/_device.py casts on the bits under the interpreter), but
vLLM's do not: its causal_conv1d_update multiplies bf16 by bf16 and stores fp32 into bf16.
``install()`` makes the interpreter do what the GPU does:
- bf16 arithmetic in fp32, rounded to nearest even (``mul.rn.bf16`` gives the same bits: the
  fp32 product of two bf16 values is exact);
- comparisons on the values;
- casts that round to nearest even, with exact widening.

Process-wide and irreversible: call it only in a process of its own (the vLLM state test does).
"""

from __future__ import annotations

import numpy as np
import triton.language as tl
from triton.runtime import interpreter

_ARITHMETIC = {np.add, np.subtract, np.multiply, np.divide, np.fmod, np.minimum, np.maximum}
_COMPARISONS = {np.less, np.less_equal, np.greater, np.greater_equal, np.equal, np.not_equal}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round to nearest even; a NaN stays a (quiet) NaN."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), ((bits >> 16) | 0x40).astype(np.uint16), rounded)


def _is_bf16(handle) -> bool:
    return handle.dtype.scalar == tl.bfloat16


def install() -> None:
    builder = interpreter.InterpreterBuilder
    binary_op, unary_op, cast_impl = builder.binary_op, builder.unary_op, builder.cast_impl

    def _binary_op(self, lhs, rhs, op):
        if not (_is_bf16(lhs) and _is_bf16(rhs)) or op not in _ARITHMETIC | _COMPARISONS:
            return binary_op(self, lhs, rhs, op)
        out = op(bf16_bits_to_f32(lhs.data), bf16_bits_to_f32(rhs.data))
        if op in _COMPARISONS:
            return interpreter.TensorHandle(out, tl.int1)
        return interpreter.TensorHandle(f32_to_bf16_bits(out), tl.bfloat16)

    def _unary_op(self, arg, op):
        if not _is_bf16(arg):
            return unary_op(self, arg, op)
        return interpreter.TensorHandle(f32_to_bf16_bits(op(bf16_bits_to_f32(arg.data))), tl.bfloat16)

    def _cast_impl(self, src, dst_type):
        src_bf16, dst_bf16 = src.dtype.scalar == tl.bfloat16, dst_type.scalar == tl.bfloat16
        if src_bf16 == dst_bf16 or not (src.dtype.scalar.is_floating() or dst_type.scalar.is_floating()):
            return cast_impl(self, src, dst_type)
        if src_bf16:
            widened = bf16_bits_to_f32(src.data)
            return interpreter.TensorHandle(widened.astype(interpreter._get_np_dtype(dst_type)), dst_type.scalar)
        return interpreter.TensorHandle(f32_to_bf16_bits(src.data.astype(np.float32)), tl.bfloat16)

    builder.binary_op, builder.unary_op, builder.cast_impl = _binary_op, _unary_op, _cast_impl
