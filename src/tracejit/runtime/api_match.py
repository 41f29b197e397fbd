"""Generated checks of the torch-level calls the API level matches (runtime/api_replay.py):
lines that return FAIL unless a value matches what the record holds, and expressions for the
recorded answers. `program` gives the names of constants and locals in the generated code."""

from __future__ import annotations

import cmath
from typing import Any

import numpy as np
import torch

from ..record.api import RefKind, StructSeq, TensorRef
from ..record.names import differs_expression

FAIL = object()  # what a generated check returns when the call differs from the recorded one


class Numbers:
    """The Python numbers of one call: a top-level argument that reaches a dynamic scalar of the one
    aten op the call binds directly is passed on to the program (`S[slot] = value`); every other
    number must equal the recorded one."""

    def __init__(self, slots: dict, links: dict | None = None):
        self.slots = slots  # ("arg", index) or ("kw", name) -> scalar slot
        self.links = links or {}  # slot -> the slots of backward ops that take the same number
        self.key: tuple | None = None  # the top-level argument being matched

    def line(self, expr: str, value: Any, program: Any) -> str | None:
        slot = self.slots.get(self.key) if self.key is not None else None
        if slot is None:
            return None
        stores = "".join(f"\nS[{s}] = {expr}" for s in (slot, *self.links.get(slot, ())))
        kind = type(value).__name__ if type(value) in (int, float) else program.constant(type(value), "ty")
        return f"if type({expr}) is not {kind}: return FAIL{stores}"


def same_literal(tensor: Any, recorded: torch.Tensor) -> bool:
    """A tensor made from Python data in this call holds what the recorded one held (the program
    has the recorded value built in)."""
    return (isinstance(tensor, torch.Tensor) and tensor.dtype == recorded.dtype and tensor.shape == recorded.shape
            and tensor.device == recorded.device and bool(torch.equal(_bits(tensor), _bits(recorded))))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a literal: equal values bit for bit (a NaN is a NaN; -0.0 is not 0.0)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def source_of(value: Any, constant: Any) -> str:
    """Python source for a number or string; an infinity has none (`inf` is no name), so it is a
    constant of the generated code's namespace."""
    if type(value) in (float, complex) and not cmath.isfinite(value):
        return constant(value, "c")
    return repr(value)


def ref_expr(ref: TensorRef) -> str:
    return {RefKind.INPUT: "A", RefKind.EXTERNAL: "E", RefKind.VALUE: "P"}[ref.kind] + f"[{ref.key}]"


def match_lines(expr: str, template: Any, program: Any, numbers: Numbers | None = None) -> list[str]:
    """Lines that return FAIL unless `expr` matches the recorded `template`."""
    if isinstance(template, TensorRef):
        if template.kind is RefKind.LITERAL:
            literal = program.constant(program.record.constants[template.key], "lit")
            return [f"if not SAME_LITERAL({expr}, {literal}): return FAIL"]
        if template.kind is RefKind.EXTERNAL and template.key in getattr(program, "_rebinding", ()):
            return [f"if {expr} is not E[{template.key}] and not REBIND({expr}, A, E, {template.key}): return FAIL"]
        return [f"if {expr} is not {ref_expr(template)}: return FAIL"]
    if template is None or type(template) is bool:
        return [f"if {expr} is not {template}: return FAIL"]
    if type(template) in (list, tuple) or isinstance(template, torch.Size):
        mapped = numbers is not None and numbers.key is not None and any(
            (*numbers.key, j) in numbers.slots for j in range(len(template)))
        if mapped:
            local = program.local()
            lines = [f"{local} = {expr}",
                     f"if type({local}) not in (list, tuple) or len({local}) != {len(template)}: return FAIL"]
            for j, item in enumerate(template):
                slot = numbers.slots.get((*numbers.key, j))
                if slot is None:
                    lines += match_lines(f"{local}[{j}]", item, program)
                else:
                    lines += [f"if type({local}[{j}]) is not {type(item).__name__}: return FAIL",
                              f"S[{slot}] = {local}[{j}]"]
            return lines
        if all(not isinstance(t, (TensorRef, list, tuple)) for t in template):
            if all(type(t) in (int, bool, str, type(None)) for t in template):
                return [f"if {expr} != {program.constant(tuple(template), 't')} and {expr} != "
                        f"{program.constant(list(template), 'l')}: return FAIL"]
        local = program.local()
        lines = [f"{local} = {expr}", f"if type({local}) not in (list, tuple) or len({local}) != {len(template)}: "
                                      f"return FAIL"]
        for i, item in enumerate(template):
            lines += match_lines(f"{local}[{i}]", item, program)  # nested numbers are matched exactly
        return lines
    if type(template) is dict:
        local = program.local()
        lines = [f"{local} = {expr}",
                 f"if type({local}) is not dict or {local}.keys() != {program.constant(set(template), 'k')}: return FAIL"]
        for key, item in template.items():
            lines += match_lines(f"{local}[{key!r}]", item, program)
        return lines
    if type(template) in (int, float, np.float64) and numbers is not None:
        line = numbers.line(expr, template, program)
        if line is not None:
            return line.split("\n")
    if type(template) in (int, float, str):  # a float bit for bit: -0.0 is not 0.0 (`threshold(x, 1, -0.0)`)
        return [f"if {differs_expression(expr, template, program.constant)}: return FAIL"]
    if type(template) is complex:
        return [f"if type({expr}) is not {type(template).__name__} or {expr} != {source_of(template, program.constant)}: "
                f"return FAIL"]
    if isinstance(template, (torch.dtype, torch.layout, torch.memory_format)):
        return [f"if {expr} is not {program.constant(template, 'd')}: return FAIL"]
    # devices, slices, Ellipsis and the like compare by value
    return [f"if {expr} != {program.constant(template, 'x')}: return FAIL"]


def answer_expr(template: Any, program: Any) -> str:
    if isinstance(template, TensorRef):
        if template.kind is RefKind.LITERAL:
            # the call's own copy of the recorded literal, the same object for every answer in one
            # call (`c.add_(1)` returns `c`): the record's copy is never handed out
            return f"LIT({template.key}, {program.constant(program.record.constants[template.key], 'lit')})"
        return ref_expr(template)
    if isinstance(template, StructSeq):
        items = "".join(f"{answer_expr(t, program)}, " for t in template.items)
        return f"{program.constant(template.type, 'T')}(({items}))"
    if type(template) is list:
        return "[" + ", ".join(answer_expr(t, program) for t in template) + "]"
    if type(template) is tuple:
        return "(" + "".join(f"{answer_expr(t, program)}, " for t in template) + ")"
    if template is None or type(template) in (bool, int):
        return repr(template)
    return program.constant(template, "r")


def template_refs(template: Any, kind: str, found: set) -> set:
    """The keys of a template's references of `kind` (handles of values, slots of externals)."""
    if isinstance(template, TensorRef):
        if template.kind == kind:
            found.add(template.key)
    elif isinstance(template, (list, tuple)):
        for item in template:
            template_refs(item, kind, found)
    elif isinstance(template, StructSeq):
        template_refs(template.items, kind, found)
    elif isinstance(template, dict):
        template_refs(list(template.values()), kind, found)
    return found
