"""The op table: how each fusable aten op computes one element.

One entry per aten op family (`add` covers `add.Tensor`, `add.Scalar`, `add_.Tensor` and every
`_foreach_add*` variant). An entry lowers the op into the primitives of `expr.py`, which every
backend renders, and carries an eager `example` that the op-table tests run through each backend.
Lowering functions receive the op's arguments in schema order: tensor elements as `Ref`s, dynamic
scalars as `ScalarArg`s, structural values as they are.

Types follow PyTorch's elementwise type promotion (`promotion` names the rule): every operand is
converted to the compute type first (float32 for half types), the result is rounded to the op's
result type, so a fused chain rounds exactly where the eager ops would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Promotion

from .expr import Compute, Ref, ScalarArg

F = torch.nn.functional


class Unsupported(Exception):
    """This call of the op cannot be fused (an argument value the table does not handle)."""


@dataclass(frozen=True)
class OpEntry:
    name: str
    lower: Callable[..., Ref]
    promotion: Promotion
    dtypes: str  # which tensors the op accepts: "float", "number" (float and int) or "bool"
    # eager reference for the tests: (x, y, z) -> tensor, from float tensors x, y and z > 0
    example: Callable[..., torch.Tensor]
    # schema positions of the arguments that take part in type promotion (None: every tensor and
    # scalar); `masked_fill(int_tensor, mask, 2.5)` computes in the tensor's type, not in float
    promote_args: tuple[int, ...] | None = None


OP_TABLE: dict[str, OpEntry] = {}


def _op(name: str, promotion: Promotion = Promotion.DEFAULT, dtypes: str = "float",
        example: Callable[..., torch.Tensor] | None = None, promote_args: tuple[int, ...] | None = None):
    def register(lower: Callable[..., Ref]) -> Callable[..., Ref]:
        OP_TABLE[name] = OpEntry(name, lower, promotion, dtypes, example, promote_args)
        return lower
    return register


def _unary(name: str, promotion: Promotion = Promotion.INT_TO_FLOAT, dtypes: str = "float",
           primitive: str | None = None, example: Callable | None = None) -> None:
    primitive = primitive or name
    eager = example or (lambda x, y, z, fn=getattr(torch, name): fn(x))
    _op(name, promotion, dtypes, eager)(lambda c, x: getattr(c, primitive)(x))


# -- unary arithmetic ----------------------------------------------------------------------------
for _name in ("exp", "log", "log1p", "expm1", "tanh", "sigmoid", "erf", "sqrt", "rsqrt", "reciprocal"):
    _unary(_name, example=(lambda x, y, z, fn=getattr(torch, _name): fn(z)) if _name in (
        "log", "sqrt", "rsqrt", "log1p") else None)
for _name in ("neg", "abs", "floor", "ceil", "trunc", "sign"):
    _unary(_name, Promotion.DEFAULT, "number")


@_op("round", Promotion.DEFAULT, "number", example=lambda x, y, z: torch.round(x))
def _round(c: Compute, x, decimals=0):
    if decimals == 0:
        return c.round(x)
    if not c.dtype.is_floating_point:
        raise Unsupported("round(decimals=...) of integers")
    if abs(decimals) > 308:  # 10 ** 309 overflows a Python float; eager's std::pow gives inf (NaN results)
        raise Unsupported(f"round(decimals={decimals})")
    # eager's rule: round(x * 10^d) / 10^d, with 10^-d for negative d (the same roundings)
    scale = 10.0 ** abs(decimals)
    if decimals > 0:
        return c.div(c.round(c.mul(x, scale)), scale)
    return c.mul(c.round(c.div(x, scale)), scale)


# primitives of their own, not log(x) * (1 / ln b): that product misses the exact integer at powers of
# the base (log2(8.0) gave 2.9999999999999996), so floor/ceil of it were off by one
_unary("log2", example=lambda x, y, z: torch.log2(z))
_unary("log10", example=lambda x, y, z: torch.log10(z))


# -- binary arithmetic -----------------------------------------------------------------------------
def _scaled(c: Compute, x, alpha):
    """alpha * x; a dynamic alpha is always multiplied (its value may change), a default 1 never."""
    return x if alpha == 1 and not isinstance(alpha, ScalarArg) else c.mul(x, alpha)


@_op("add", dtypes="number", example=lambda x, y, z: torch.add(x, y, alpha=0.75))
def _add(c: Compute, x, other, alpha=1):
    return c.add(x, _scaled(c, other, alpha))


@_op("sub", dtypes="number", example=lambda x, y, z: torch.sub(x, y, alpha=0.5))
def _sub(c: Compute, x, other, alpha=1):
    return c.sub(x, _scaled(c, other, alpha))


@_op("rsub", dtypes="number", example=lambda x, y, z: torch.rsub(x, 2.0))
def _rsub(c: Compute, x, other, alpha=1):
    return c.sub(other, _scaled(c, x, alpha))


@_op("mul", dtypes="number", example=lambda x, y, z: x * y)
def _mul(c: Compute, x, other):
    return c.mul(x, other)


@_op("div", Promotion.INT_TO_FLOAT, "number", example=lambda x, y, z: x / z)
def _div(c: Compute, x, other, rounding_mode=None):
    # true division: integer operands compute in the default float type, as eager's does
    if rounding_mode is not None:
        raise Unsupported(f"div with rounding_mode={rounding_mode!r}")
    return c.div(x, other)


@_op("maximum", dtypes="number", example=lambda x, y, z: torch.maximum(x, y))
def _maximum(c: Compute, x, other):
    return c.maximum(x, other)


@_op("minimum", dtypes="number", example=lambda x, y, z: torch.minimum(x, y))
def _minimum(c: Compute, x, other):
    return c.minimum(x, other)


@_op("lerp", example=lambda x, y, z: torch.lerp(x, y, 0.3))
def _lerp(c: Compute, x, end, weight):
    # PyTorch's two-sided form: exact at both ends
    diff = c.sub(end, x)
    small = c.lt(c.abs(weight), 0.5)
    return c.where(small, c.add(x, c.mul(weight, diff)), c.sub(end, c.mul(diff, c.sub(1.0, weight))))


@_op("addcmul", example=lambda x, y, z: torch.addcmul(x, y, z, value=0.5))
def _addcmul(c: Compute, x, tensor1, tensor2, value=1):
    return c.add(x, c.mul(c.mul(value, tensor1), tensor2))


@_op("addcdiv", example=lambda x, y, z: torch.addcdiv(x, y, z, value=-0.5))
def _addcdiv(c: Compute, x, tensor1, tensor2, value=1):
    return c.add(x, c.div(c.mul(value, tensor1), tensor2))


# -- comparisons, selection, logic ------------------------------------------------------------------
for _name, _primitive in (("eq", "eq"), ("ne", "ne"), ("lt", "lt"), ("le", "le"), ("gt", "gt"), ("ge", "ge")):
    _op(_name, Promotion.ALWAYS_BOOL, "number", lambda x, y, z, n=_name: getattr(torch, n)(x, y))(
        lambda c, x, other, p=_primitive: getattr(c, p)(x, other))


@_op("isnan", Promotion.ALWAYS_BOOL, example=lambda x, y, z: torch.isnan(x / (x - x)))
def _isnan(c: Compute, x):
    return c.isnan(x)


@_op("where", Promotion.NO_OPMATH, "number", example=lambda x, y, z: torch.where(x > y, x, z))
def _where(c: Compute, condition, x, other):
    return c.where(condition, x, other)


@_op("masked_fill", Promotion.NO_OPMATH, "number", example=lambda x, y, z: x.masked_fill(y > 0, 2.5),
     promote_args=(0,))
def _masked_fill(c: Compute, x, mask, value):
    # A 0-dim tensor value is converted as eager converts `value.item()`: with an overflow check
    # that raises (300 into uint8, 1e39 into float32, a NaN into an integer). A kernel's cast
    # would wrap silently, so only a value whose dtype always fits is fused
    if isinstance(value, Ref) and not always_fits(c.b.dtype(value), c.b.dtype(x)):
        raise Unsupported("masked_fill with a tensor value whose dtype may not fit the filled tensor's")
    return c.where(mask, value, x)


def always_fits(source: torch.dtype, target: torch.dtype) -> bool:
    """Every value of `source` converts to `target` without the overflow check raising."""
    if source == target or source == torch.bool:
        return True
    if source.is_complex or target.is_complex or target == torch.bool:
        return False
    if target.is_floating_point:
        largest = torch.finfo(target).max
        return (torch.finfo(source).max <= largest if source.is_floating_point
                else torch.iinfo(source).max <= largest)
    if source.is_floating_point:
        return False  # NaN, infinities and fractions' range
    low, high = torch.iinfo(source), torch.iinfo(target)
    return high.min <= low.min and low.max <= high.max


def _bools_only(c: Compute, *operands):
    """Bitwise ops are logic on bool tensors; on integers they are bit operations the table lacks."""
    if any(not isinstance(o, Ref) or c.b.dtype(o) != torch.bool for o in operands):
        raise Unsupported("bitwise ops on integers")


for _name, _primitive in (("logical_and", "and"), ("logical_or", "or"), ("logical_xor", "xor")):
    _op(_name, Promotion.ALWAYS_BOOL, "bool", lambda x, y, z, n=_name: getattr(torch, n)(x > 0, y > 0))(
        lambda c, x, other, p=_primitive: c.logical(p, x, other))
for _name, _primitive in (("bitwise_and", "and"), ("bitwise_or", "or"), ("bitwise_xor", "xor")):
    _op(_name, Promotion.DEFAULT, "bool", lambda x, y, z, n=_name: getattr(torch, n)(x > 0, y > 0))(
        lambda c, x, other, p=_primitive: _bools_only(c, x, other) or c.logical(p, x, other))
_op("logical_not", Promotion.ALWAYS_BOOL, "bool", lambda x, y, z: torch.logical_not(x > 0))(
    lambda c, x: c.logical("not", x))
_op("bitwise_not", Promotion.DEFAULT, "bool", lambda x, y, z: torch.bitwise_not(x > 0))(
    lambda c, x: _bools_only(c, x) or c.logical("not", x))


# -- clamping and activations -------------------------------------------------------------------------
@_op("clamp", dtypes="number", example=lambda x, y, z: torch.clamp(x, -0.5, 0.5))
def _clamp(c: Compute, x, min=None, max=None):
    if min is not None:
        x = _at_least(c, x, min)
    if max is not None:
        x = _at_most(c, x, max)
    return c.value(x)


@_op("clamp_min", dtypes="number", example=lambda x, y, z: torch.clamp_min(x, 0.25))
def _clamp_min(c: Compute, x, min):
    return _at_least(c, x, min)


@_op("clamp_max", dtypes="number", example=lambda x, y, z: torch.clamp_max(x, 0.25))
def _clamp_max(c: Compute, x, max):
    return _at_most(c, x, max)


def _at_least(c: Compute, x, low):
    """A tensor bound is `maximum` (eager's clamp.Tensor is); a number bound keeps `x` when the two
    are equal, as eager does in every loop (clamp(-0.0, min=0.0) is -0.0), and a NaN bound gives NaN."""
    if isinstance(low, Ref):
        return c.maximum(x, low)
    return _number_bound(c, c.where(c.lt(x, low), low, x), low)


def _at_most(c: Compute, x, high):
    if isinstance(high, Ref):
        return c.minimum(x, high)
    return _number_bound(c, c.where(c.gt(x, high), high, x), high)


def _number_bound(c: Compute, clamped: Ref, bound) -> Ref:
    return c.where(c.isnan(bound), bound, clamped) if c.dtype.is_floating_point else clamped


@_op("relu", dtypes="number", example=lambda x, y, z: torch.relu(x))
def _relu(c: Compute, x):
    return c.where(c.lt(x, 0), 0, x)  # keeps -0.0 and NaN, like PyTorch


@_op("threshold", dtypes="number", example=lambda x, y, z: F.threshold(x, 0.1, 20.0), promote_args=(0,))
def _threshold(c: Compute, x, threshold, value):
    return c.where(c.le(x, threshold), value, x)


@_op("threshold_backward", dtypes="number",
     example=lambda x, y, z: torch.ops.aten.threshold_backward(x, y, 0.0), promote_args=(0, 1))
def _threshold_backward(c: Compute, grad, x, threshold):
    return c.where(c.le(x, threshold), 0, grad)


@_op("sigmoid_backward", example=lambda x, y, z: torch.ops.aten.sigmoid_backward(x, torch.sigmoid(y)))
def _sigmoid_backward(c: Compute, grad, out):
    return c.mul(c.mul(grad, c.sub(1, out)), out)


@_op("tanh_backward", example=lambda x, y, z: torch.ops.aten.tanh_backward(x, torch.tanh(y)))
def _tanh_backward(c: Compute, grad, out):
    return c.mul(grad, c.sub(1, c.mul(out, out)))


_SQRT1_2 = 1.0 / math.sqrt(2.0)
_SQRT_2_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _gelu_tanh_inner(c: Compute, x):
    return c.mul(_SQRT_2_PI, c.add(x, c.mul(0.044715, c.mul(x, c.mul(x, x)))))


@_op("gelu", example=lambda x, y, z: F.gelu(x))
def _gelu(c: Compute, x, approximate="none"):
    if approximate == "tanh":
        return c.mul(c.mul(0.5, x), c.add(1, c.tanh(_gelu_tanh_inner(c, x))))
    if c.device_type == "cpu" and isinstance(x, Ref) and c.b.dtype(x) in (torch.float32, torch.bfloat16):
        # eager's float32 CPU kernel (torch 2.13, every ATEN_CPU_CAPABILITY), which bfloat16 runs
        # too, halves last, so x above FLT_MAX / 2 gives inf, and gives NaN at +inf; its float64,
        # float16 and CUDA kernels give inf there, as the formula below does
        halved_last = c.mul(c.mul(x, c.add(1, c.erf(c.mul(x, _SQRT1_2)))), 0.5)
        return c.where(c.eq(x, math.inf), math.nan, halved_last)
    return c.mul(c.mul(x, 0.5), c.add(1, c.erf(c.mul(x, _SQRT1_2))))


@_op("gelu_backward", example=lambda x, y, z: torch.ops.aten.gelu_backward(x, y))
def _gelu_backward(c: Compute, grad, x, approximate="none"):
    if approximate == "tanh":
        inner = _gelu_tanh_inner(c, x)
        t = c.tanh(inner)
        d_inner = c.mul(_SQRT_2_PI, c.add(1, c.mul(3 * 0.044715, c.mul(x, x))))
        d = c.add(c.mul(0.5, c.add(1, t)), c.mul(c.mul(0.5, x), c.mul(c.sub(1, c.mul(t, t)), d_inner)))
        return c.mul(grad, d)
    cdf = c.mul(0.5, c.add(1, c.erf(c.mul(x, _SQRT1_2))))
    pdf = c.mul(_INV_SQRT_2PI, c.exp(c.mul(-0.5, c.mul(x, x))))
    return c.mul(grad, c.add(cdf, c.mul(x, pdf)))


@_op("silu", example=lambda x, y, z: F.silu(x))
def _silu(c: Compute, x):
    return c.div(x, c.add(1, c.exp(c.neg(x))))


@_op("silu_backward", example=lambda x, y, z: torch.ops.aten.silu_backward(x, y))
def _silu_backward(c: Compute, grad, x):
    s = c.div(1, c.add(1, c.exp(c.neg(x))))
    return c.mul(grad, c.mul(s, c.add(1, c.mul(x, c.sub(1, s)))))


@_op("softplus", example=lambda x, y, z: F.softplus(x * 10, beta=2.0, threshold=15.0))
def _softplus(c: Compute, x, beta=1, threshold=20):
    scaled = c.mul(x, beta)
    return c.where(c.gt(scaled, threshold), x, c.div(c.log1p(c.exp(scaled)), beta))


@_op("softplus_backward", example=lambda x, y, z: torch.ops.aten.softplus_backward(x, y * 10, 2.0, 15.0))
def _softplus_backward(c: Compute, grad, x, beta, threshold):
    scaled = c.mul(x, beta)
    z = c.exp(scaled)
    return c.where(c.gt(scaled, threshold), grad, c.div(c.mul(grad, z), c.add(z, 1)))


@_op("leaky_relu", example=lambda x, y, z: F.leaky_relu(x, 0.2))
def _leaky_relu(c: Compute, x, negative_slope=0.01):
    return c.where(c.gt(x, 0), x, c.mul(x, negative_slope))


@_op("leaky_relu_backward", example=lambda x, y, z: torch.ops.aten.leaky_relu_backward(x, y, 0.2, False))
def _leaky_relu_backward(c: Compute, grad, x, negative_slope, self_is_result):
    return c.where(c.gt(x, 0), grad, c.mul(grad, negative_slope))


@_op("hardtanh", example=lambda x, y, z: F.hardtanh(x * 2, -1.5, 1.25))
def _hardtanh(c: Compute, x, min_val=-1, max_val=1):
    return _at_most(c, _at_least(c, x, min_val), max_val)  # eager's is clamp: x kept at a tie (relu6(-0.0) is -0.0)


@_op("hardtanh_backward", example=lambda x, y, z: torch.ops.aten.hardtanh_backward(x, y * 2, -1.5, 1.25))
def _hardtanh_backward(c: Compute, grad, x, min_val, max_val):
    return c.where(c.logical("or", c.le(x, min_val), c.ge(x, max_val)), 0, grad)


@_op("hardsigmoid", example=lambda x, y, z: F.hardsigmoid(x * 4))
def _hardsigmoid(c: Compute, x):
    return c.div(c.minimum(c.maximum(c.add(x, 3), 0), 6), 6)


@_op("hardswish", example=lambda x, y, z: F.hardswish(x * 4))
def _hardswish(c: Compute, x):
    return c.div(c.mul(x, c.minimum(c.maximum(c.add(x, 3), 0), 6)), 6)


# -- copies and fills ---------------------------------------------------------------------------------
@_op("_to_copy", Promotion.NO_OPMATH, "number",
     example=lambda x, y, z: (x * 100).to(torch.float32 if x.dtype == torch.float64 else torch.float64))
def _to_copy(c: Compute, x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    if layout not in (None, torch.strided) or device is not None or pin_memory:
        raise Unsupported("_to_copy that changes layout, device or pinning")
    if memory_format not in (None, torch.preserve_format):
        raise Unsupported(f"_to_copy to {memory_format}")
    return x  # the store converts to the output's dtype


@_op("clone", Promotion.NO_OPMATH, "number", example=lambda x, y, z: x.t().clone(memory_format=torch.contiguous_format))
def _clone(c: Compute, x, memory_format=None):
    return x  # the store lays the copy out as eager did (the recorded strides)


@_op("copy", Promotion.NO_OPMATH, "number", example=lambda x, y, z: x.clone().copy_(y))
def _copy(c: Compute, x, src, non_blocking=False):
    return src


# the value converts straight to the tensor's type (int32 fill_(16777217.0) is exact), not through
# the promotion of (int tensor, float), float32
@_op("fill", Promotion.NO_OPMATH, "number", example=lambda x, y, z: x.clone().fill_(0.5), promote_args=(0,))
def _fill(c: Compute, x, value):
    return c.value(value)


@_op("zero", Promotion.NO_OPMATH, "number", example=lambda x, y, z: x.clone().zero_())
def _zero(c: Compute, x):
    return c.value(0)


def entry_for(op: Any) -> tuple[OpEntry, bool] | None:
    """(entry, is_foreach) for an aten overload the table covers, else None."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten" or _has_out_argument(op):
        return None
    name = op._schema.name.split("::")[-1]
    foreach = name.startswith("_foreach_")
    if foreach:
        name = name[len("_foreach_"):]
    if name.endswith("_") and op._schema.arguments and _writes_first_argument(op):
        name = name[:-1]
    entry = OP_TABLE.get(name)
    return (entry, foreach) if entry is not None else None


def _has_out_argument(op: torch._ops.OpOverload) -> bool:
    """An `.out` overload (DDP's reducer writes `mul.out(grad, 1/world, out=bucket_view)`): its
    result goes to a tensor it was handed, which the entries' functional lowering does not model."""
    return any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def _writes_first_argument(op: torch._ops.OpOverload) -> bool:
    info = op._schema.arguments[0].alias_info
    return info is not None and info.is_write
