"""Messages of `TraceMismatchError`: what was recorded, where, and what came instead."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import TraceMismatchError
from ..record.record import KwargStatic, OpRecord, Record, ScalarSlot, TensorMeta, render_statics
from ..record.source import SourceLocation


def _recorded(record: Record, op: OpRecord) -> str:
    return f"  recorded: {record.format_op(op)}\n            at {op.source}" + _code(op.source)


def _code(source: SourceLocation) -> str:
    code = source.code
    return f": {code}" if code else ""


def _header(record: Record, position: int, what: str) -> str:
    return f"{record.function_name}() diverged from its trace at op #{position}: {what}\n"


def _came(call: str, source: SourceLocation) -> str:
    return f"\n  got:      {call}\n            at {source}" + _code(source)


def _render_call(func: Any, statics: tuple, tensor_names: list[str], scalars: list) -> str:
    return f"{func}({render_statics(statics, tensor_names, scalars)})"


def different_op(record: Record, position: int, func: Any, statics: tuple, tensor_names: list[str],
                 scalars: list, source: SourceLocation) -> TraceMismatchError:
    op = record.ops[position]
    return TraceMismatchError(
        _header(record, position, f"a different op ran ({func} instead of {op.name})")
        + _recorded(record, op)
        + _came(_render_call(func, statics, tensor_names, scalars), source)
        + _tensor_or_number(op.op, func)
        + _gradient_presence_hint(record, op, func)
    )


def other_default_dtype(record: Record, position: int, now: torch.dtype, source: SourceLocation) -> TraceMismatchError:
    op = record.ops[position]
    made = record.tensors[op.outputs[0]].meta.dtype
    return TraceMismatchError(
        _header(record, position, f"{op.name} makes a tensor of the default dtype, {now} now and {made} when "
                                  f"recorded (torch.set_default_dtype inside the call)")
        + _recorded(record, op)
        + f"\n  reached at {source}; pass dtype= to the factory (convert an integer tensor explicitly: "
          f"`x.double() * 0.1`), or set the default dtype outside the traced call"
    )


def _tensor_or_number(recorded: Any, got: Any) -> str:
    """A note for another overload of the recorded op that takes a tensor where it took a number or
    the other way round (`_fused_adam_.tensor_lr` and `.default`): an optimizer setting in
    `param_groups` given as the other kind, most likely."""
    if getattr(recorded, "overloadpacket", None) is None or getattr(got, "overloadpacket", None) is not recorded.overloadpacket:
        return ""
    numbers = (torch.FloatType, torch.IntType, torch.NumberType)
    for before in recorded._schema.arguments:
        now = next((a for a in got._schema.arguments if a.name == before.name), None)
        if now is None:
            continue
        kinds = (isinstance(before.type, torch.TensorType), isinstance(now.type, torch.TensorType))
        if kinds[0] != kinds[1] and isinstance(now.type if kinds[0] else before.type, numbers):
            was, came = ("a tensor", "a number") if kinds[0] else ("a number", "a tensor")
            return (f"\n  its `{before.name}` was {was} when recorded and is {came} now: an optimizer setting in "
                    f"param_groups (`lr`) switched between a tensor and a Python number? Keep each setting the kind "
                    f"it was (change a tensor setting in place, `group['lr'].fill_(0.1)`), or trace the function anew.")
    return ""


_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"


def _gradient_presence_hint(record: Record, op: OpRecord, func: Any) -> str:
    """Why autograd's AccumulateGrad ran another op than recorded: it stores a leaf's first gradient
    (a detach or a copy) but adds into a `.grad` the leaf has, so a `.grad` cleared or set between
    calls changes its ops."""
    node = torch._C._current_autograd_node()
    if op.backward_of != _ACCUMULATE_GRAD and (node is None or node.name() != _ACCUMULATE_GRAD):
        return ""
    adds = {"aten.add_.Tensor", "aten.add.Tensor"}
    got = str(func)
    if op.name in adds and got not in adds:
        change = "a `.grad` was None where the recorded call had one (cleared between calls: `zero_grad()`, `.grad = None`?)"
    elif got in adds and op.name not in adds:
        change = "a `.grad` held a gradient where the recorded call's was None"
    else:
        change = "a `.grad` is not as it was when the trace was recorded"
    grads = [record.tensors[h].name for h in op.inputs if record.tensors[h].name.endswith(".grad")]
    which = f" ({grads[0]})" if grads else ""
    return (f"\n  autograd's AccumulateGrad stores a leaf's first gradient but adds into a `.grad` it has: {change}"
            f"{which}. Which `.grad` exist selects a trace for the parameters of keyword modules and those the "
            f"function reaches otherwise, and for inputs that require grad; for another tensor (a plain tensor "
            f"that requires grad, reached through a global or a closure) make it an nn.Parameter or pass it as "
            f"an argument, or clear or keep its `.grad` alike before every call.")


def different_arguments(record: Record, position: int, statics: tuple, tensor_names: list[str],
                        scalars: list, source: SourceLocation) -> TraceMismatchError:
    op = record.ops[position]
    detail = _defaulted_difference(op, statics, scalars) or _first_difference(op.statics, statics)
    return TraceMismatchError(
        _header(record, position, f"{op.name} got different non-tensor arguments ({detail})")
        + _recorded(record, op)
        + _came(_render_call(op.op, statics, tensor_names, scalars), source)
    )


def _first_difference(recorded: tuple, got: tuple) -> str:
    if len(recorded) != len(got):
        return f"{len(got)} arguments instead of {len(recorded)}"
    for i, (a, b) in enumerate(zip(recorded, got)):
        if a != b:
            name = a.name if isinstance(a, KwargStatic) else f"argument {i}"
            va = a.value if isinstance(a, KwargStatic) else a
            vb = b.value if isinstance(b, KwargStatic) else b
            if isinstance(va, ScalarSlot) or isinstance(vb, ScalarSlot):
                return f"{name}: a scalar of another type, {vb!r} instead of {va!r}"
            return f"{name}: {_short(vb)} instead of {_short(va)}"
    return "unknown difference"


def _defaulted_difference(op: OpRecord, statics: tuple, scalars: list) -> str | None:
    """Name an argument one call passed and the other left at its default (the dispatcher drops
    arguments equal to their default: `F.hardshrink(x, 0.5)` records `hardshrink(x)`)."""
    schema = getattr(op.op, "_schema", None)
    if schema is None:
        return None
    recorded = _by_name(schema, op.statics, list(op.scalars))
    got = _by_name(schema, statics, list(scalars))
    for argument in schema.arguments:
        name = argument.name
        if (name in recorded) == (name in got) or not argument.has_default_value():
            continue
        default = argument.default_value
        if _equal(recorded.get(name, got.get(name)), default):
            # passed at its default only to reach a later argument (the dispatcher drops trailing
            # defaults together: huber_loss(x, y, 1, 0.7) against huber_loss(x, y)): not what changed
            continue
        if name in got:
            return (f"{name}={_short(got[name])} where the recorded call left it at its default {_short(default)}; "
                    f"the trace holds the default as a constant, so another value needs a trace of its own")
        return f"{name} left at its default {_short(default)} where the recorded call passed {_short(recorded[name])}"
    return None


def _equal(value: Any, default: Any) -> bool:
    try:
        return bool(value == default)
    except Exception:  # a value that does not compare with the default (a tensor-like one) differs
        return False


def _by_name(schema: Any, statics: tuple, scalars: list) -> dict[str, Any]:
    """The arguments of a call by schema name, dynamic scalars replaced by their values."""
    values = iter(scalars)

    def value(static: Any) -> Any:
        if isinstance(static, ScalarSlot):
            return next(values, static)
        if isinstance(static, tuple):
            return tuple(value(v) for v in static)
        return static

    named = {}
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    index = 0
    for static in statics:
        if isinstance(static, KwargStatic):
            named[static.name] = value(static.value)
        elif index < len(positional):
            named[positional[index]] = value(static)
            index += 1
    return named


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


def extra_op(record: Record, func: Any, statics: tuple, tensor_names: list[str], scalars: list,
             source: SourceLocation) -> TraceMismatchError:
    position = len(record.ops)
    last = record.ops[-1] if record.ops else None
    after = (f"\n  the trace ended after {record.format_op(last)}\n            at {last.source}{_code(last.source)}"
             if last else "")
    return TraceMismatchError(
        _header(record, position, f"more ops than recorded (the trace has {position})")
        + after.lstrip("\n") + _came(_render_call(func, statics, tensor_names, scalars), source)
    )


def premature_end(record: Record, position: int, source: SourceLocation) -> TraceMismatchError:
    op = record.ops[position]
    return TraceMismatchError(
        _header(record, position, f"premature end: the function returned after {position} of "
                                  f"{len(record.ops)} recorded ops")
        + _recorded(record, op)
        + f"\n  got:      the function returned instead (traced call at {source}{_code(source)})"
    )


def wrong_input(record: Record, position: int, slot: int, expected: int, got: str, reason: str,
                source: SourceLocation) -> TraceMismatchError:
    op = record.ops[position]
    return TraceMismatchError(
        _header(record, position, f"tensor input {slot} of {op.name} {reason}")
        + f"  expected: {record.describe_handle(expected)}\n  got:      {got}\n"
        + _recorded(record, op) + f"\n  replayed at {source}" + _code(source)
    )


def const_violated(record: Record, position: int, handle: int, detail: str,
                   source: SourceLocation) -> TraceMismatchError:
    op = record.ops[position]
    return TraceMismatchError(
        _header(record, position, f"captured constant t{handle} ({record.tensors[handle].name}) {detail}")
        + "  capture_as_const=True froze this tensor when the trace was recorded; a traced call must "
          "see the same tensor object, unmodified (version counter unchanged).\n"
        + _recorded(record, op) + f"\n  replayed at {source}" + _code(source)
    )


def output_mismatch(record: Record, detail: str, source: SourceLocation) -> TraceMismatchError:
    handles = list(dict.fromkeys(record.output.handles()))
    described = "".join(f"\n    {record.describe_handle(h)}" for h in handles[:4])
    more = f"\n    ... and {len(handles) - 4} more" if len(handles) > 4 else ""
    return TraceMismatchError(
        f"{record.function_name}() returned a different output than recorded: {detail}\n"
        f"  recorded output: {record.output.describe()}{described}{more}\n"
        f"  traced call at {source}" + _code(source)
    )


def shape_changed(record: Record, position: int, got: list, source: SourceLocation) -> TraceMismatchError:
    op = record.ops[position]
    recorded = ", ".join(str(m) for m in op.out_metas)
    got_text = ", ".join(str(m) for m in got)
    return TraceMismatchError(
        _header(record, position, f"{op.name} produced outputs of another shape (data-dependent shape)")
        + f"  recorded outputs: {recorded}\n  got:              {got_text}\n" + _recorded(record, op)
        + f"\n  replayed at {source}"
    )


def describe_tensor(tensor: torch.Tensor) -> str:
    return str(TensorMeta.of(tensor))
