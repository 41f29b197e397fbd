"""Executable fused nodes.

A FUSED node of the graph becomes a *kernel*: a callable `kernel(inputs, scalars, outs=None)`
taking the node's input tensors in order and the flat dynamic-scalar list, and returning the
node's outputs in order. `outs` may hold preallocated tensors (the placeholders checked replay
handed to the host) that the kernel must fill; a None entry is allocated by the kernel.

`ReferenceKernel` runs the members one by one through aten: the `aten` backend, the fallback
when a backend cannot compile a group, and the oracle the compiled kernels are tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..ir.graph import Graph, Node, Op
from ..record.calls import rebuild_call
from .callables import resolve_callable


class ReferenceKernel:
    def __init__(self, graph: Graph, node: Node):
        self.name = node.target.name
        self.inputs = node.inputs
        self.outputs = node.outputs
        self.steps = []
        for member in node.members:
            metas = member.attr("input_metas") or ()
            function = resolve_callable(member.target, member.attr("statics", ()), tuple(metas),
                                        member.attr("scalars", ()))
            base = member.attr("scalar_base", 0)
            count = len(member.attr("scalars", ()))
            self.steps.append((function, member.attr("statics", ()), member.inputs, base, base + count,
                               member.outputs[0]))

    def __call__(self, inputs: Sequence[torch.Tensor], scalars: list, outs: Sequence | None = None) -> tuple:
        values = dict(zip(self.inputs, inputs))
        for function, statics, member_inputs, start, stop, output in self.steps:
            args, kwargs = rebuild_call(statics, [values[v] for v in member_inputs], scalars[start:stop])
            values[output] = function(*args, **kwargs)
        results = tuple(values[v] for v in self.outputs)
        if outs is None:
            return results
        return tuple(_fill(out, result) for out, result in zip(outs, results))

    def partial(self, inputs: Sequence[torch.Tensor], scalars: list, wanted: int) -> torch.Tensor:
        """The value `wanted` alone, computing only the members up to it (on-demand reads)."""
        values = dict(zip(self.inputs, inputs))
        for function, statics, member_inputs, start, stop, output in self.steps:
            args, kwargs = rebuild_call(statics, [values[v] for v in member_inputs], scalars[start:stop])
            values[output] = function(*args, **kwargs)
            if output == wanted:
                return values[output]
        raise KeyError(f"value {wanted} is not produced by {self.name}")


def _fill(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


KernelCompiler = Callable[[Graph, list[tuple[int, Node]]], dict[int, Any]]


def compile_fused_nodes(graph: Graph, compiler: KernelCompiler | None = None) -> dict[int, Any]:
    """node index -> kernel for every FUSED node; groups the compiler cannot take run by reference."""
    fused = [(index, node) for index, node in enumerate(graph.nodes) if node.op is Op.FUSED]
    kernels = compiler(graph, fused) if compiler is not None and fused else {}
    for index, node in fused:
        if index not in kernels:
            kernels[index] = ReferenceKernel(graph, node)
    return kernels
