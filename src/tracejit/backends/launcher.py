"""What every generated kernel launcher does around the launch itself.

A launcher is a small generated Python function with the kernel calling convention
`kernel(inputs, s, outs=None)`. Around the backend-specific launch line it unpacks the node's
inputs as `x0, x1, ...`, checks that every tensor the kernel addresses has the strides it was
specialized for (another layout runs the group through the reference kernel, `FALLBACK`),
allocates the outputs the caller did not hand in as `o0, o1, ...`, and returns the node's outputs.
"""

from __future__ import annotations

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


def returned(spec: KernelSpec) -> str:
    """The return line: each node output, allocated or written in place."""
    values = [f"o{index}" if kind == "new" else f"x{index}" for kind, index in spec.output_sources]
    return f"return ({', '.join(values)}{',' if len(values) == 1 else ''})"
