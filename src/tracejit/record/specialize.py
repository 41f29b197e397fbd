"""One concrete record per input size, made from a symbolic-shape record without recording again.

A symbolic-shape record holds `torch.SymInt`s (and the odd `SymFloat`/`SymBool`) wherever a size
appears: in the tensors' metadata, in op arguments (view shapes, expand sizes, slice bounds),
in the outputs' metadata. `specialize` evaluates every such expression for one binding of the
symbols and returns an ordinary record, which the rest of tracejit (checked replay, the compiler,
the host-free program) runs like any recorded one. Each distinct expression is evaluated once per
binding.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import sympy
import torch

from ..errors import SymbolicTraceError
from .record import KwargStatic, OpRecord, Record, TensorInfo, TensorMeta
from .symbolic_shapes import is_symbolic_number


class _Evaluator:
    def __init__(self, values: dict[sympy.Symbol, int]):
        self._values = {symbol: sympy.Integer(v) for symbol, v in values.items()}
        self._cache: dict[Any, Any] = {}

    def number(self, value: Any) -> Any:
        expr = value.node.expr
        known = self._cache.get(expr)
        if known is not None:
            return known
        result = expr.xreplace(self._values)
        if result.free_symbols:
            raise SymbolicTraceError(
                f"tracejit: the size expression {expr} depends on {sorted(map(str, result.free_symbols))}, "
                f"which no input size binds (a size computed from tensor values?): symbolic_shape cannot "
                f"evaluate it for a call")
        if isinstance(value, torch.SymBool):
            concrete = bool(result)
        elif isinstance(value, torch.SymFloat):
            concrete = float(result)
        else:
            concrete = int(result)
        self._cache[expr] = concrete
        return concrete

    def value(self, value: Any) -> Any:
        if is_symbolic_number(value):
            return self.number(value)
        if isinstance(value, tuple):
            return tuple(self.value(v) for v in value)
        if isinstance(value, list):
            return [self.value(v) for v in value]
        if isinstance(value, KwargStatic):
            return KwargStatic(value.name, self.value(value.value))
        if isinstance(value, torch.Size):
            return torch.Size(self.value(tuple(value)))
        return value

    def meta(self, meta: TensorMeta | None) -> TensorMeta | None:
        if meta is None:
            return None
        return TensorMeta(self.value(meta.shape), self.value(meta.stride), meta.dtype, meta.device, meta.math_bits)


def specialize(record: Record, values: dict[sympy.Symbol, int]) -> Record:
    """`record` with every size expression evaluated for `values` (symbol -> size)."""
    evaluate = _Evaluator(values)
    tensors = [TensorInfo(i.handle, i.kind, evaluate.meta(i.meta), i.name, i.producer, i.base, i.flags, i.literal,
                          i.cut) for i in record.tensors]
    ops = [_specialize_op(op, evaluate) for op in record.ops]
    return replace(record, tensors=tensors, ops=ops, kwarg_handles=dict(record.kwarg_handles))


def _specialize_op(op: OpRecord, evaluate: _Evaluator) -> OpRecord:
    return replace(op, statics=evaluate.value(op.statics), scalars=evaluate.value(op.scalars),
                   out_metas=tuple(evaluate.meta(m) for m in op.out_metas))


def record_symbols(record: Record) -> set[sympy.Symbol]:
    """Every symbol the record's size expressions use."""
    found: set[sympy.Symbol] = set()

    def visit(value: Any) -> None:
        if is_symbolic_number(value):
            found.update(value.node.expr.free_symbols)
        elif isinstance(value, (tuple, list)):
            for v in value:
                visit(v)
        elif isinstance(value, KwargStatic):
            visit(value.value)

    for info in record.tensors:
        visit(info.meta.shape)
        visit(info.meta.stride)
    for op in record.ops:
        visit(op.statics)
        visit(op.scalars)
    return found
