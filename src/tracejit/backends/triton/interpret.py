"""Stand-ins for what Triton's interpreter (`TRITON_INTERPRET=1`) lacks, bound in interpreted kernels.

The interpreter runs a kernel as numpy code. It cannot call libdevice (`extern_elementwise` is not
implemented), its float32 -> bfloat16 conversion truncates where the GPU rounds to nearest even,
and its bfloat16 -> float32 conversion loses subnormals. The generated source calls these names
on the GPU too (jit.py binds the real ones there); here they are numpy functions on the
interpreter's tensors:
- libdevice math in float64 rounded once to the argument's type: within an ulp of the correctly
  rounded result, the ideal that CUDA's libdevice (<= 2 ulp, same special values) approximates;
- `f32_to_bf16` rounds to nearest even and keeps NaN a (quiet) NaN, as `cvt.rn.bf16.f32` does;
  `bf16_to_f32` widens by a shift; the float16 pair are numpy's (correct) conversions.
One interpreter bug is mended in place when this module is imported (only in interpreter mode):
a comparison's result carries its operands' type instead of int1, so a scalar comparison
broadcast against a block becomes float32 and `block_bool & scalar_bool` raises in numpy.

Only this module touches interpreter internals (`TensorHandle`, `tensor.handle.data`).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import triton.language as tl
from triton.runtime.interpreter import TensorHandle


def _wrap(x, data: np.ndarray, element: tl.dtype):
    block = x.type.with_element_ty(element) if x.type.is_block() else element
    return tl.core.tensor(TensorHandle(data, element), block)


def _math(function):
    def apply(x):
        data = x.handle.data
        with np.errstate(all="ignore"):
            result = function(data.astype(np.float64)).astype(data.dtype)
        return _wrap(x, result, x.dtype)
    apply.__name__ = function.__name__
    return apply


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    nearest_even = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    quiet_nan = ((bits >> 16) | 0x40).astype(np.uint16)
    return np.where(np.isnan(values), quiet_nan, nearest_even)


def f32_to_bf16(x):
    return _wrap(x, _bfloat16_bits(x.handle.data), tl.bfloat16)


def bf16_to_f32(x):
    bits = x.handle.data.view(np.uint16).astype(np.uint32) << 16  # exact, subnormals included
    return _wrap(x, bits.view(np.float32), tl.float32)


def f32_to_f16(x):
    with np.errstate(all="ignore"):
        return _wrap(x, x.handle.data.astype(np.float16), tl.float16)  # numpy rounds to nearest even


def f16_to_f32(x):
    return _wrap(x, x.handle.data.astype(np.float32), tl.float32)


libdevice = SimpleNamespace(
    exp=_math(np.exp), log=_math(np.log), log2=_math(np.log2), log10=_math(np.log10),
    log1p=_math(np.log1p), expm1=_math(np.expm1), tanh=_math(np.tanh),
    erf=_math(np.vectorize(math.erf, otypes=[np.float64])), trunc=_math(np.trunc), rint=_math(np.rint),
)

def _comparisons_give_int1() -> None:
    from triton.runtime.interpreter import InterpreterBuilder

    for name in dir(InterpreterBuilder):
        compare = getattr(InterpreterBuilder, name)
        if not name.startswith(("create_icmp", "create_fcmp")) or getattr(compare, "_int1", False):
            continue

        def typed(self, lhs, rhs, compare=compare):
            return TensorHandle(compare(self, lhs, rhs).data.astype(np.bool_), tl.int1)
        typed._int1 = True
        setattr(InterpreterBuilder, name, typed)


_comparisons_give_int1()

INTERPRETER_NAMES = {"libdevice": libdevice, "f32_to_bf16": f32_to_bf16, "bf16_to_f32": bf16_to_f32,
                     "f32_to_f16": f32_to_f16, "f16_to_f32": f16_to_f32}


def _reduction(function):
    """A row reduction (`row_max`, `row_min`, `row_sum` of row kernels) in the block's own type; the interpreter
    cannot run tl.max/tl.sum when triton was imported before TRITON_INTERPRET was set."""
    def apply(x):
        data = x.handle.data
        with np.errstate(all="ignore"):
            result = np.asarray(function(data), dtype=data.dtype).reshape(())
        return tl.core.tensor(TensorHandle(result, x.dtype), x.dtype)
    return apply


row_max = _reduction(np.max)  # NaN propagates (the kernels test for NaN themselves, as the GPU's does not)
row_min = _reduction(np.min)
def _tree_sum(data: np.ndarray) -> np.ndarray:
    """Neighbours added pairwise, as a GPU's tree reduction over a block (a power of two long) does;
    numpy's own sum starts at +0.0, which turns a sum of -0.0 into +0.0."""
    data = data.reshape(-1)
    if not data.size:
        return np.zeros((), data.dtype)
    while data.size > 1:
        if data.size % 2:
            data = np.concatenate([data, np.array([-0.0]).astype(data.dtype)])
        data = data[0::2] + data[1::2]
    return data[0]


row_sum = _reduction(_tree_sum)
INTERPRETER_NAMES.update(row_max=row_max, row_min=row_min, row_sum=row_sum)
