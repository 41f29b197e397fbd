"""The element expression language of fused kernels.

A fused kernel computes, for every element of its iteration space, a small DAG of *primitives*
over the loaded input elements and the kernel's scalar arguments. Every backend renders the same
primitives (C in `backends/c/render.py`, Triton in `backends/triton/render.py`); the op table
(`optable.py`) says how each aten op is built from them.

Semantics every backend must keep (and the op-table tests check against eager PyTorch):
- arithmetic is IEEE in the expression's dtype, one rounding per primitive, no contraction into
  fused multiply-adds, NaN and signed zeros as in PyTorch;
- `maximum`/`minimum` propagate NaN from either side; `where` selects without evaluating order;
- comparisons produce `bool`; `cast` converts like a C cast (float -> int truncates);
- transcendentals (`exp`, `log`, `log2`, `log10`, `log1p`, `expm1`, `tanh`, `sigmoid`, `erf`) are
  within a few ulp of the correctly rounded result, with exact special values (0, -0, +-inf, NaN);
  `log2` and `log10` are exact at powers of their base, as eager's are (`floor(log2(x))` counts bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

UNARY_FLOAT = frozenset({
    "neg", "abs", "reciprocal", "sqrt", "rsqrt", "exp", "log", "log2", "log10", "log1p", "expm1", "tanh",
    "sigmoid", "erf", "floor", "ceil", "trunc", "round", "sign",
})
BINARY = frozenset({"add", "sub", "mul", "div", "maximum", "minimum"})
COMPARE = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})
LOGICAL = frozenset({"and", "or", "xor", "not"})
# every primitive a backend must render, besides the leaves load/scalar/const
PRIMITIVES = UNARY_FLOAT | BINARY | COMPARE | LOGICAL | {"isnan", "where", "cast"}
TRANSCENDENTAL = frozenset({"exp", "log", "log2", "log10", "log1p", "expm1", "tanh", "sigmoid", "erf"})


@dataclass(frozen=True)
class Expr:
    """One node of the element DAG. `args` index earlier nodes of the same kernel.

    Leaves: `load` (value = operand index), `scalar` (value = scalar-argument index), `const`
    (value = a Python number). `cast` converts its argument to `dtype`.
    """

    op: str
    args: tuple[int, ...]
    dtype: torch.dtype
    value: Any = None


class Ref(int):
    """An index into the expression list, told apart from Python numbers in lowering code."""


class ScalarArg:
    """A dynamic scalar argument of the kernel: its index among the kernel's scalars and its type."""

    __slots__ = ("index", "type")

    def __init__(self, index: int, type_: type):
        self.index = index
        self.type = type_


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The type arithmetic happens in: PyTorch computes half-precision ops in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class ExprBuilder:
    """Builds a deduplicated expression list (identical nodes are created once)."""

    def __init__(self) -> None:
        self.exprs: list[Expr] = []
        self._index: dict[tuple, Ref] = {}

    def emit(self, op: str, args: tuple[int, ...], dtype: torch.dtype, value: Any = None) -> Ref:
        expr = Expr(op, tuple(args), dtype, value)
        # floats by their bits: -0.0 == 0.0 in Python, and NaN equals nothing
        key = (op, expr.args, dtype, value.hex() if isinstance(value, float) else value)
        found = self._index.get(key)
        if found is None:
            found = Ref(len(self.exprs))
            self.exprs.append(expr)
            self._index[key] = found
        return found

    def dtype(self, ref: Ref) -> torch.dtype:
        return self.exprs[ref].dtype

    def cast(self, ref: Ref, dtype: torch.dtype) -> Ref:
        return ref if self.exprs[ref].dtype == dtype else self.emit("cast", (ref,), dtype)


class Compute:
    """Lowering helpers bound to one op's compute dtype: every operand is converted to it first.

    Operands are `Ref`s (tensor elements or earlier results), `ScalarArg`s (dynamic scalars) or
    Python numbers (constants of the op's definition). `device_type` is the device whose eager
    kernels the result must equal, for the few edge values where eager's CPU and CUDA kernels differ.
    """

    def __init__(self, builder: ExprBuilder, dtype: torch.dtype, device_type: str = "cpu"):
        self.b = builder
        self.dtype = dtype
        self.device_type = device_type

    def value(self, operand: Any) -> Ref:
        if isinstance(operand, Ref):
            return self.b.cast(operand, self.dtype)
        if isinstance(operand, ScalarArg):
            raw = self.b.emit("scalar", (), torch.float64 if operand.type is float else torch.int64, operand.index)
            return self.b.cast(raw, self.dtype)
        if isinstance(operand, bool):
            operand = int(operand)  # `x.clamp(max=True)`, `x + True`: eager takes a bool as 1 or 0
        if not isinstance(operand, (int, float)):
            raise TypeError(f"not an element operand: {operand!r}")
        return self.b.emit("const", (), self.dtype, _typed_constant(operand, self.dtype))

    def _op(self, op: str, *operands: Any) -> Ref:
        return self.b.emit(op, tuple(self.value(o) for o in operands), self.dtype)

    def __getattr__(self, name: str):
        if name in UNARY_FLOAT or name in BINARY:
            return lambda *operands: self._op(name, *operands)
        if name in COMPARE or name == "isnan":
            return lambda *operands: self.b.emit(name, tuple(self.value(o) for o in operands), torch.bool)
        raise AttributeError(name)

    def where(self, condition: Ref, a: Any, b: Any) -> Ref:
        return self.b.emit("where", (self.b.cast(condition, torch.bool), self.value(a), self.value(b)), self.dtype)

    def logical(self, op: str, *operands: Any) -> Ref:
        return self.b.emit(op, tuple(self.b.cast(self.value(o), torch.bool) for o in operands), torch.bool)


def _typed_constant(value: float, dtype: torch.dtype) -> int | float | bool:
    if dtype == torch.bool:
        return bool(value)
    if dtype.is_floating_point:
        return float(value)
    return int(value)
