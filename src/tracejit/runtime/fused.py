"""Executable fused nodes: every FUSED node of a graph gets a kernel.

A kernel is a callable `kernel(inputs, scalars, outs=None)` (see backends/reference.py). Groups
the backend cannot compile run through the reference kernel, op by op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..backends.reference import ReferenceKernel
from ..ir.graph import Graph, Node, Op

KernelCompiler = Callable[[Graph, list[tuple[int, Node]]], dict[int, Any]]

__all__ = ["KernelCompiler", "ReferenceKernel", "compile_fused_nodes"]


def compile_fused_nodes(graph: Graph, compiler: KernelCompiler | None = None) -> dict[int, Any]:
    """node index -> kernel for every FUSED node; groups the compiler cannot take run by reference."""
    fused = [(index, node) for index, node in enumerate(graph.nodes) if node.op is Op.FUSED]
    kernels = compiler(graph, fused) if compiler is not None and fused else {}
    for index, node in fused:
        if index not in kernels:
            kernels[index] = ReferenceKernel(graph, node)
    return kernels
