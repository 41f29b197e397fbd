"""Generated per-position steps of checked replay: the hot path of a replayed op.

For each recorded op a small function is generated that checks exactly what the record says
(argument count, each structural value, each tensor's handle, each scalar's type), executes the
op through its verified callable on the arguments the host passed, and maps the outputs to their
handles. It returns `MISS` at the first surprise, and the replayer's generic path then redoes the
work slowly: it either finds a legitimate case (an external seen for the first time in an odd
way) or produces the precise mismatch error. The generated code never raises on a mismatch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..record.record import TENSOR, Kind, KwargStatic, OpRecord, Record, ScalarSlot, TensorMeta
from .profile import CLOCK

MISS = object()
_INLINE = (int, bool, str, type(None))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.namespace: dict[str, Any] = {"MISS": MISS, "REF": weakref.ref, "TENSOR": torch.Tensor}
        self.counter = 0

    def name(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def constant(self, value: Any) -> str:
        name = self.name("k")
        self.namespace[name] = value
        return name

    def literal(self, value: Any) -> str:
        if type(value) in _INLINE:
            return repr(value)
        return self.constant(value)


def _tensor_check(w: _Writer, expr: str, handle: int, external: TensorMeta | None, bindable: bool,
                  indent: str) -> list[str]:
    """Check that the tensor at `expr` is the one mapped to `handle`. A tensor seen for the first
    time is bound where the record has an external: inline for a plain external of this metadata
    not bound to another object yet (`B`, the replayer's bound externals) and in memory of its own
    (`OVERLAPS`, the replayer's check: a global made a view of another after recording), through
    the replayer's `BIND` for constants; anything else is a MISS for the generic path to explain."""
    t, e = w.name("t"), w.name("e")
    if external is not None:
        r = w.name("r")
        meta_differs = (f"{t}.shape != {w.constant(external.shape)} or {t}.stride() != {w.constant(external.stride)}"
                        f" or {t}.dtype is not {w.constant(external.dtype)} or {_other_device(w, t, external.device)}"
                        f" or {t}.is_neg() or {t}.is_conj()")
        # a Python number where the record had a tensor (LBFGS's state["t"]): the generic path says so
        unknown = [f"if {handle} in B or not isinstance({t}, TENSOR) or {meta_differs} or OVERLAPS({t}, {handle}):"
                   f" return MISS",
                   f"{r} = REF({t})", f"E[id({t})] = ({handle}, {r})", f"B[{handle}] = {r}"]
    else:
        unknown = [f"if not BIND({t}, {handle}): return MISS" if bindable else "return MISS"]
    return [
        f"{indent}{t} = {expr}",
        f"{indent}{e} = E.get(id({t}))",
        f"{indent}if {e} is None or {e}[1]() is not {t}:",
        *(f"{indent}    {line}" for line in unknown),
        f"{indent}elif {e}[0] != {handle}: return MISS",
    ]


def _value_check(w: _Writer, expr: str, static: Any, handles: list[int], bindable: dict[int, TensorMeta | None],
                 slots: list[int], indent: str) -> list[str]:
    if static is TENSOR:
        handle = handles.pop(0)
        return _tensor_check(w, expr, handle, bindable.get(handle), handle in bindable, indent)
    if isinstance(static, ScalarSlot):  # its value is kept: the host-free program binds from it
        return [f"{indent}if type({expr}) is not {static.type.__name__}: return MISS",
                f"{indent}S[{slots.pop(0)}] = {expr}"]
    if isinstance(static, tuple):
        if not any(_is_slot(v) for v in static):
            return [f"{indent}if {expr} != {w.constant(list(static))} and {expr} != {w.constant(static)}: return MISS"]
        seq = w.name("l")
        lines = [f"{indent}{seq} = {expr}", f"{indent}if len({seq}) != {len(static)}: return MISS"]
        for i, item in enumerate(static):
            lines += _value_check(w, f"{seq}[{i}]", item, handles, bindable, slots, indent)
        return lines
    if static is None:
        return [f"{indent}if {expr} is not None: return MISS"]
    literal = w.literal(static)
    return [f"{indent}if type({expr}) is not {w.constant(type(static))} or {expr} != {literal}: return MISS"]


def _is_slot(value: Any) -> bool:
    """Tensors and dynamic scalars are checked one by one; plain values compare as a whole."""
    if value is TENSOR or isinstance(value, ScalarSlot):
        return True
    return isinstance(value, tuple) and any(_is_slot(v) for v in value)


def _other_device(w: _Writer, expr: str, device: Any) -> str:
    return f"not {expr}.is_cpu" if device.type == "cpu" else f"{expr}.device != {w.constant(device)}"


def _inline_binding(info: Any) -> TensorMeta | None:
    """The metadata a first-seen tensor must have to be bound as this external inline (see
    Replayer._first_seen_error); None where binding needs the replayer (constants, literals, and
    the rare negative or conjugate view)."""
    return info.meta if info.kind is Kind.EXTERNAL and not info.literal and not info.meta.math_bits else None


def _step_source(w: _Writer, record: Record, op: OpRecord, function: Callable, profile_row: int | None,
                 scalar_offset: int) -> list[str]:
    positional = [s for s in op.statics if not isinstance(s, KwargStatic)]
    keywords = [s for s in op.statics if isinstance(s, KwargStatic)]
    # handle -> the metadata to bind a first-seen plain external with inline; None: bind through BIND
    bindable = {h: _inline_binding(record.tensors[h]) for h in op.inputs
                if record.tensors[h].kind in (Kind.EXTERNAL, Kind.CONST)}
    handles = list(op.inputs)
    slots = list(range(scalar_offset, scalar_offset + len(op.scalars)))
    body = [f"if len(args) != {len(positional)} or len(kwargs) != {len(keywords)}: return MISS"]
    for i, static in enumerate(positional):
        body += _value_check(w, f"args[{i}]", static, handles, bindable, slots, "")
    for item in keywords:
        body.append(f"if {item.name!r} not in kwargs: return MISS")
        body += _value_check(w, f"kwargs[{item.name!r}]", item.value, handles, bindable, slots, "")
    call = f"r = {w.constant(function)}(*args, **kwargs)"
    if profile_row is None:
        body.append(call)
    else:
        body += ["_t = CLOCK()", call, f"STOP({profile_row}, _t)"]
    if op.out_kind == "tensor":
        body.append(f"E[id(r)] = ({op.outputs[0]}, REF(r))")
    elif op.out_kind in ("tuple", "list"):
        for i, handle in enumerate(op.outputs):
            if handle is not None:
                body.append(f"E[id(r[{i}])] = ({handle}, REF(r[{i}]))")
    body.append("return r")
    return body


def generate_steps(record: Record, callables: list[Callable | None], fast: list[bool],
                   profile_rows: list[int] | None = None, profiler: Any = None) -> list[Callable | None]:
    """One step function per position (None where the position needs the generic path).

    A step is called as `step(args, kwargs, E, BIND, B, S, OVERLAPS)` with E the replay's id ->
    (handle, ref) table, BIND(tensor, handle) -> bool the replayer's binding of a first-seen external
    or constant, B its handle -> weak reference of the externals bound so far in the call, S the
    call's flat list of dynamic scalars, where the step stores the values it sees, and
    OVERLAPS(tensor, handle) -> bool the replayer's check that a first-seen external is in memory
    the record saw apart from the inputs' and the other externals' (noting it when it is).
    """
    w = _Writer()
    if profiler is not None:
        w.namespace.update(CLOCK=CLOCK, STOP=profiler.stop)
    source = []
    offset = 0
    for op in record.ops:
        scalar_offset, offset = offset, offset + len(op.scalars)
        if not fast[op.index] or callables[op.index] is None:
            continue
        row = profile_rows[op.index] if profile_rows is not None else None
        body = _step_source(w, record, op, callables[op.index], row, scalar_offset)
        source.append(f"def step{op.index}(args, kwargs, E, BIND, B, S, OVERLAPS):\n" + "\n".join(f"    {line}" for line in body))
    exec(compile("\n\n".join(source) + "\n", f"<tracejit replay steps {record.function_name}>", "exec"), w.namespace)
    return [w.namespace.get(f"step{op.index}") for op in record.ops]
