"""What every generated kernel launcher does around the launch itself.

A launcher is a small generated Python function with the kernel calling convention
`kernel(inputs, s, outs=None)`. Around the backend-specific launch line it unpacks the node's
inputs as `x0, x1, ...`, checks that every tensor the kernel addresses has the strides it was
specialized for (another layout runs the group through the reference kernel, `FALLBACK`),
allocates the outputs the caller did not hand in as `o0, o1, ...`, and returns the node's outputs.
A dynamic scalar the kernel would convert to a type that cannot hold it (200 for an int8 tensor, 1e40
for a float32 one) also runs the group through the reference kernel: eager then raises, or wraps,
exactly as it does for that op (`clamp` raises, `where` wraps), where the kernel's conversion would
silently wrap.
"""

from __future__ import annotations

import torch

from .lower import KernelSpec


def addressed_inputs(spec: KernelSpec) -> list[int]:
    """Positions in node.inputs of the tensors the kernel reads or writes."""
    return sorted({i for lane in spec.lanes for i, _ in lane.loads} | set(spec.written_inputs))


def prologue(spec: KernelSpec, namespace: dict) -> list[str]:
    """Unpack inputs, check their layouts, allocate the outputs (names `EMPTY`, `FALLBACK` needed)."""
    addressed = addressed_inputs(spec)
    lines = []
    if spec.input_metas:
        names = ", ".join(f"x{i}" for i in range(len(spec.input_metas)))
        lines.append(f"{names}{',' if len(spec.input_metas) == 1 else ''} = inputs")
    if addressed:
        checks = " or ".join(f"x{i}.stride() != {tuple(spec.input_metas[i].stride)!r}" for i in addressed)
        lines.append(f"if {checks}: return FALLBACK(inputs, s, outs)")
    unrepresentable = _scalar_range_checks(spec)
    if unrepresentable:
        lines.append(f"if {' or '.join(unrepresentable)}: return FALLBACK(inputs, s, outs)")
    returned = {index: position for position, (kind, index) in enumerate(spec.output_sources) if kind == "new"}
    for a, meta in enumerate(spec.allocations):
        namespace[f"D{a}"] = meta.dtype
        namespace[f"V{a}"] = meta.device
        fresh = f"EMPTY({tuple(meta.shape)!r}, {tuple(meta.stride)!r}, dtype=D{a}, device=V{a})"
        if a in returned:
            p = returned[a]
            lines.append(f"o{a} = outs[{p}] if outs is not None and outs[{p}] is not None else {fresh}")
        else:
            lines.append(f"o{a} = {fresh}")
    return lines


def _scalar_range_checks(spec: KernelSpec) -> list[str]:
    """One condition per (dynamic scalar, narrower type it is converted to): true when the call's
    value does not fit that type. Scalars are bound as float64/int64; only narrowing casts can lose."""
    narrowed: dict[int, set[torch.dtype]] = {}
    for expr in spec.exprs:
        if expr.op == "cast" and spec.exprs[expr.args[0]].op == "scalar":
            narrowed.setdefault(spec.exprs[expr.args[0]].value, set()).add(expr.dtype)
    # A half-precision kernel computes in float32, but eager converts the scalar to the tensor's
    # type (`clamp(max=1e5)` of a float16 tensor raises): a float scalar must fit the narrowest
    # float type the kernel reads or writes as well. Too strict for ops that do not convert is only
    # slower: that call runs through aten.
    tensor_floats = [d for d in (*spec.load_dtypes, *(d for _, d in spec.store_exprs)) if d.is_floating_point]
    conditions = []
    # every int is bound as int64: one beyond it (2**63, a float tensor takes it) would wrap
    for k, kind in enumerate(spec.scalar_types):
        if kind is int:
            slots = sorted({lane.scalars[k] for lane in spec.lanes})
            conditions += [f"not ({-2 ** 63} <= s[{slot}] < {2 ** 63})" for slot in slots]
    for k, targets in sorted(narrowed.items()):
        slots = sorted({lane.scalars[k] for lane in spec.lanes})  # a list-wide scalar is one slot
        if any(t.is_floating_point for t in targets):
            targets = targets | set(tensor_floats)
        for target in sorted(targets, key=str):
            condition = _out_of_range(spec.scalar_types[k], target)
            conditions += [condition.format(v=f"s[{slot}]") for slot in slots if condition]
    return conditions


def _out_of_range(kind: type, target: torch.dtype) -> str | None:
    """A Python condition on `{v}`: the value does not fit `target` (eager's checked conversion:
    a float type takes infinities and NaN, an integer type neither)."""
    if target == torch.bool or target == torch.float64:
        return None
    if target.is_floating_point:
        largest = float(torch.finfo(target).max)
        if kind is not float:
            return None if target == torch.float32 else f"abs({{v}}) > {largest!r}"  # every int64 fits float32
        return f"(abs({{v}}) > {largest!r} and abs({{v}}) != float('inf'))"
    info = torch.iinfo(target)
    if kind is int and target == torch.int64:
        return None
    # negated so NaN counts as out of range; a float at 2**63 is out for int64 (the kernel's cast gives INT64_MIN)
    high = f"< {info.max + 1}" if target == torch.int64 else f"<= {info.max}"
    return f"not ({info.min} <= {{v}} {high})"


def returned(spec: KernelSpec) -> str:
    """The return line: each node output, allocated or written in place."""
    values = [f"o{index}" if kind == "new" else f"x{index}" for kind, index in spec.output_sources]
    return f"return ({', '.join(values)}{',' if len(values) == 1 else ''})"
