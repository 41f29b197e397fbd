"""Element expressions of a Triton kernel: one statement per primitive of the spec's DAG (expr.py).

Each primitive becomes Triton code with the semantics expr.py states: half types are converted to
float32 before arithmetic and rounded back where the spec casts; conversions to and from half types
go through named helpers (`f32_to_bf16`, `bf16_to_f32`, `f32_to_f16`, `f16_to_f32`) that jit.py
binds per mode; float32 division and sqrt are IEEE (`div_rn`, `sqrt_rn`; plain `/` and `tl.sqrt`
are approximate on NVIDIA GPUs); transcendentals call libdevice (CUDA's accurate functions, not
`tl.exp`'s approximation); maximum/minimum propagate NaN; arithmetic on bool is logic (int1 would
wrap). Constants are typed 0-d tensors (`tl.full([], 0.5, tl.float32)`), so Triton's promotion of
Python numbers never decides a type.
"""

from __future__ import annotations

import math

import torch

from ..expr import TRANSCENDENTAL, Expr
from ..lower import KernelSpec, live_exprs

TL_TYPES = {
    torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16", torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16",
    torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}
# Triton's signature names of the same types (pointers get a leading "*")
SIGNATURE_TYPES = {
    torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "i1",
}
HALF_TYPES = (torch.float16, torch.bfloat16)
_HALF_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "and": "&", "or": "|", "xor": "^"}
_BOOL_ARITHMETIC = {"add": "|", "mul": "&", "maximum": "|", "minimum": "&"}  # int1 would wrap
_LIBDEVICE = {"exp": "exp", "log": "log", "log2": "log2", "log10": "log10",
              "log1p": "log1p", "expm1": "expm1", "tanh": "tanh", "erf": "erf",
              "trunc": "trunc", "round": "rint"}


class NotRenderable(ValueError):
    """The spec has something the Triton renderer does not express (the group runs op by op)."""


def _literal(value, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        text = "True" if value else "False"
    elif not dtype.is_floating_point:
        text = str(int(value))
    elif math.isnan(value):
        text = "NAN"
    elif math.isinf(value):
        text = "INF" if value > 0 else "-INF"
    else:
        text = repr(float(value))
    return f"tl.full([], {text}, {TL_TYPES[dtype]})"


def convert(value: str, source: torch.dtype, target: torch.dtype) -> str:
    """`value` (of type `source`) as `target`, rounding like PyTorch's element conversions."""
    if source == target:
        return value
    if target == torch.bool and source not in HALF_TYPES:
        zero = "0.0" if source.is_floating_point else "0"
        return f"({value} != {zero})"
    if source in HALF_TYPES:  # a half value is compared widened: -0.0's bits are not zero
        value = f"{_HALF_NAMES[source]}_to_f32({value})"
        source = torch.float32
        if target == torch.bool:
            return f"({value} != 0.0)"
        if target == torch.float32:
            return value
    if target in HALF_TYPES:
        wide = value if source == torch.float32 else f"{value}.to(tl.float32)"
        return f"f32_to_{_HALF_NAMES[target]}({wide})"
    if source.is_floating_point and not target.is_floating_point:
        # as eager on x86 (see the C backend's _cast): through int32 (int64 for int64), out-of-range
        # values and NaN giving the minimum, then truncated to the target's bits; GPUs saturate
        # instead, and an out-of-range conversion is not defined in C++ either
        wide, bits = ("tl.int64", 63) if target == torch.int64 else ("tl.int32", 31)
        inside = f"(({value} >= -{float(2 ** bits)!r}) & ({value} < {float(2 ** bits)!r}))"
        whole = f"tl.where({inside}, {value}, -{float(2 ** bits)!r}).to({wide})"
        return whole if TL_TYPES[target] == wide else f"{whole}.to({TL_TYPES[target]})"
    return f"{value}.to({TL_TYPES[target]})"


def expression(expr: Expr, a: list[str], source_types: list[torch.dtype]) -> str:
    op, dtype = expr.op, expr.dtype
    floating = dtype.is_floating_point
    if op == "const":
        return _literal(expr.value, dtype)
    if op == "cast":
        return convert(a[0], source_types[0], dtype)
    if dtype == torch.bool and op in _BOOL_ARITHMETIC:
        return f"({a[0]} {_BOOL_ARITHMETIC[op]} {a[1]})"
    if op == "div":
        if not floating:
            raise NotRenderable(f"integer division on {dtype}")  # Triton's `/` on ints is true division
        return _divide(a[0], a[1], dtype)
    if op in _INFIX:
        return f"({a[0]} {_INFIX[op]} {a[1]})"
    one = _literal(1, dtype)
    simple = {
        "neg": f"(-{a[0]})",
        "not": f"({a[0]} == 0)",
        "abs": f"tl.abs({a[0]})",
        "isnan": f"({a[0]} != {a[0]})",
        "where": f"tl.where({', '.join(a)})",
        "sign": f"(({a[0]} > 0).to({TL_TYPES[dtype]}) - ({a[0]} < 0).to({TL_TYPES[dtype]}))",
        "reciprocal": _divide(one, a[0], dtype),
        "sqrt": _sqrt(a[0], dtype),
        "rsqrt": _divide(one, _sqrt(a[0], dtype), dtype),
        "sigmoid": _divide(one, f"({one} + libdevice.exp(-{a[0]}))", dtype),
    }
    if op in simple:
        return simple[op]
    if op in ("maximum", "minimum"):
        # NaN wins; equal operands (+0.0, -0.0) give the second, as eager's vectorized loops do
        pick = ">" if op == "maximum" else "<"
        chosen = f"tl.where({a[0]} {pick} {a[1]}, {a[0]}, {a[1]})"
        if not floating:
            return chosen
        return f"tl.where({a[0]} != {a[0]}, {a[0]}, tl.where({a[1]} != {a[1]}, {a[1]}, {chosen}))"
    if op in ("floor", "ceil", "trunc", "round"):
        if not floating:
            return a[0]
        return f"tl.{op}({a[0]})" if op in ("floor", "ceil") else f"libdevice.{_LIBDEVICE[op]}({a[0]})"
    if op in TRANSCENDENTAL:
        return f"libdevice.{_LIBDEVICE[op]}({a[0]})"
    raise NotRenderable(f"the Triton backend cannot render primitive {op!r} on {dtype}")


def _divide(x: str, y: str, dtype: torch.dtype) -> str:
    # float32 `/` compiles to div.full.f32 (2 ulp); div_rn is IEEE (float64 division always is)
    return f"tl.div_rn({x}, {y})" if dtype == torch.float32 else f"({x} / {y})"


def _sqrt(x: str, dtype: torch.dtype) -> str:
    # tl.sqrt is approximate in float32; sqrt_rn is IEEE (float64 sqrt is always correctly rounded)
    return f"tl.sqrt_rn({x})" if dtype == torch.float32 else f"tl.sqrt({x})"



def element_statements(spec: KernelSpec, load, scalar, store) -> list[str]:
    """Statements of one block: every needed load first, then the arithmetic, then the stores."""
    needed = live_exprs(spec)
    lines = [f"v{i} = {load(e.value)}" for i, e in enumerate(spec.exprs) if i in needed and e.op == "load"]
    for index, expr in enumerate(spec.exprs):
        if index not in needed or expr.op == "load":
            continue
        if expr.op == "scalar":
            lines.append(f"v{index} = {scalar(expr.value, expr.dtype)}")
            continue
        args = [f"v{i}" for i in expr.args]
        lines.append(f"v{index} = {expression(expr, args, [spec.exprs[i].dtype for i in expr.args])}")
    for k, (ref, dtype) in enumerate(spec.store_exprs):
        lines.append(store(k, convert(f"v{ref}", spec.exprs[ref].dtype, dtype)))
    return lines
