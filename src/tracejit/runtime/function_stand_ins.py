"""Gradient clipping and `model.zero_grad()` answered as a whole in checked calls at the API level.

The record notes where each call of torch.nn.utils' `clip_grad_norm_` and `clip_grad_value_`, and
of nn.Module's `zero_grad`, begins and ends among the torch-level calls
(record/function_calls.py). While a checked call runs, the cell torch's wrapper calls (the class
attribute) holds a stand-in: called where the record has such a span, with
the recorded arguments (the parameters by identity and in order, numbers and flags by type and
value) under the recorded autocast state and default dtype, with torch's functions and helpers
still in place, it moves the checker past the span and returns the recorded result, which the
program computes with the rest of the call. Otherwise torch's function runs, matched call by call
as before: a new max norm, another parameter list, another thread's call.

What the span reads besides its arguments is answered by the record in the matched path too:
the gradients (`p.grad` answers the recorded value) and their grouping by device and dtype.
"""

from __future__ import annotations

import types
from _thread import get_ident
from typing import Any

import torch

from ..record.api import ApiCall, CallKind, RefKind, TensorRef
from ..record.function_calls import Answerable, FunctionCall
from .api_match import FAIL, answer_expr, match_lines
from .stand_ins import _span_refusal, span_checks

_STACK_DEPTH = torch._C._len_torch_function_stack
_STACK_AT = torch._C._get_function_stack_at
_GRAD_ENABLED = torch._C.is_grad_enabled


class _FunctionStandIn:
    """What the holder of one ANSWERABLE function holds during one checked call."""

    __slots__ = ("answerable", "checker", "regions")

    def __init__(self, answerable: Answerable, regions: dict[int, tuple[Any, int]]):
        self.answerable = answerable
        self.regions = regions  # checker position where the span starts -> (answer, end)
        self.checker = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        checker, answerable = self.checker, self.answerable
        function = answerable.function
        # this thread's call under the checker itself (not another trace's call inside the function),
        # in torch's wrapper where it has one (which turned grad mode off), not diverged
        if (checker is None or checker.diverged is not None or checker.continued or checker.thread != get_ident()
                or _STACK_DEPTH() == 0 or _STACK_AT(_STACK_DEPTH() - 1) is not checker
                or answerable.without_grad and _GRAD_ENABLED()):
            return function(*args, **kwargs)
        try:
            arguments = answerable.arguments(*args, **kwargs)
            listed, passed = answerable.listing(arguments[0])  # as when the trace was noted: before the span
        except TypeError:  # torch's function raises it, or takes it otherwise
            return function(*args, **kwargs)
        region = checker.region(self.regions)
        result = FAIL
        if region is not None and not answerable.helpers_changed():
            answer, end = region
            result = answer((listed, *arguments[1:]), checker.inputs, checker.externals, checker.placeholders,
                            checker.scalars)
        if result is FAIL:
            return function(passed, *arguments[1:])
        checker.position = end
        checker.stood_in_functions += 1
        return result

    def __get__(self, instance: Any, owner: type) -> Any:
        """Held as a class attribute (nn.Module.zero_grad), bound as the method it stands for."""
        return self if instance is None else types.MethodType(self, instance)


class FunctionStandIns:
    """The stand-ins of one API program; `install` before the function runs and `remove` after."""

    def __init__(self, stand_ins: list[_FunctionStandIn]):
        self.stand_ins = stand_ins

    def install(self, checker: Any) -> list:
        installed = []
        for stand_in in self.stand_ins:
            answerable = stand_in.answerable
            if answerable.held() is answerable.function:  # not another trace's stand-in, nor a patch
                stand_in.checker = checker
                answerable.hold(stand_in)
                installed.append(stand_in)
        return installed

    @staticmethod
    def remove(installed: list) -> None:
        for stand_in in installed:
            answerable = stand_in.answerable
            if answerable.held() is stand_in:
                answerable.hold(answerable.function)
            stand_in.checker = None


def _refusal(program: Any, calls: list[ApiCall], call: FunctionCall) -> str | None:
    if call.refused is not None:
        return call.refused
    if call.end <= call.start:
        return "it makes no torch call"
    reason = _span_refusal(calls, call)
    if reason is not None:
        return reason
    for inner in calls[call.start:call.end]:
        if inner.index in program.rebind_at:
            return f"a tensor it reaches may be another one on each call ({inner.name} at {inner.source})"
        short = inner.name.rsplit(".", 1)[-1]
        # its helpers' own no_grad changes nothing under the wrapper's; anything else run for real
        # (grad mode on, a profiler range) must happen
        if inner.kind is CallKind.REAL and (short == "_set_grad_enabled" and inner.args != (False,)
                                            or short.startswith("_record_function")):
            return f"it calls {inner.name}"
    return None


def build_function_stand_ins(program: Any, calls: list[ApiCall], function_calls: list[FunctionCall]
                             ) -> tuple[FunctionStandIns | None, dict[str, str]]:
    """The stand-ins of the clipping calls the record allows, and why the others run for real."""
    refused: dict[str, str] = {}
    regions: dict[str, tuple[Answerable, dict]] = {}
    for call in function_calls:
        where = f"{call.answerable.name}() at {calls[call.start].source}" if call.start < len(calls) \
            else f"{call.answerable.name}()"
        reason = _refusal(program, calls, call)
        if reason is None:
            try:
                answer = _answer(program, calls, call)
            except ValueError as why:
                reason = str(why)
        if reason is not None:
            refused[where] = reason
            continue
        regions.setdefault(call.answerable.name, (call.answerable, {}))[1][call.start] = (answer, call.end)
    stand_ins = [_FunctionStandIn(answerable, found) for answerable, found in regions.values()]
    return (FunctionStandIns(stand_ins) if stand_ins else None), refused


# the argument whose number reaches the program through one call of the span, passed on as that
# call would pass it (a max norm that follows a schedule): clip_grad_norm_'s `max_norm`, as
# `max_norm / (total_norm + 1e-6)` after `max_norm = float(max_norm)`
_PASSED_NUMBERS = {"clip_grad_norm_": (1, "__rdiv__")}


def _answer(program: Any, calls: list[ApiCall], call: FunctionCall) -> Any:
    """`answer(a, A, E, P, S)`: FAIL unless the arguments `a` (the parameters listed) are the
    recorded ones and the span would dispatch what it did; else the recorded result. A gradient the
    span reads first (api_replay._located_externals) is taken from where it is, as its call would."""
    inner = calls[call.start:call.end]
    lines = [*span_checks(program, inner, strict=True), f"if len(a) != {len(call.args)}: return FAIL"]
    passed = _passed_number(program, inner, call)
    for i, template in enumerate(call.args):
        if passed is not None and i == passed[0]:
            stores = "".join(f"; S[{slot}] = v" for slot in passed[1])
            lines += [f"v = a[{i}]", "if type(v) is not float and type(v) is not int: return FAIL", f"v = float(v){stores}"]
        else:
            lines += match_lines(f"a[{i}]", template, program)
    located = [c for c in inner if c.index in program.located.values()]
    if located:
        program.namespace["NO_TORCH_FUNCTION"] = torch._C.DisableTorchFunction
        lines.append("with NO_TORCH_FUNCTION():")
        for found in located:
            owner = found.args[0]
            if not isinstance(owner, TensorRef) or owner.kind not in (RefKind.EXTERNAL, RefKind.INPUT):
                raise ValueError("it reads the gradient of a tensor the trace computes")
            lines.append(f"    g{found.index} = {'E' if owner.kind == RefKind.EXTERNAL else 'A'}[{owner.key}].grad")
        for found in located:
            lines += [f"if not isinstance(g{found.index}, TENSOR): return FAIL", f"E[{found.result.key}] = g{found.index}"]
    lines.append(f"return {answer_expr(call.result, program)}")
    return program._function(f"{call.answerable.name}_{call.start}", "a, A, E, P, S", lines)


def _passed_number(program: Any, inner: list[ApiCall], call: FunctionCall) -> tuple[int, tuple] | None:
    """(argument index, the program's scalar slots) for the argument _PASSED_NUMBERS names, when the
    one call of the span it reaches passes it on to the program (api_replay.Numbers), else None:
    the number is then compared as any argument."""
    index, name = _PASSED_NUMBERS.get(call.answerable.name, (None, None))
    reaching = [c for c in inner if c.kind is CallKind.COMPUTE and c.name.rsplit(".", 1)[-1] == name]
    if index is None or len(reaching) != 1 or index >= len(call.args):
        return None
    recorded, target = call.args[index], reaching[0]
    if type(recorded) not in (int, float) or len(target.args) < 2 or target.args[1] != float(recorded):
        return None
    slot = program._direct_slots(target).get(("arg", 1))
    if slot is None:
        return None
    return index, (slot, *(program.backward_links or {}).get(slot, ()))
