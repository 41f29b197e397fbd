"""fold_constants: under capture_as_const, ops on constants are computed once, at compile time.

Before (host-free, capture_as_const):   After:
    t2 = const('model.0.weight')            t3 = const('folded op #0')
    t3 = aten.t.default(t2)                 t5 = aten.addmm.default(t4, t0, t3)
    t5 = aten.addmm.default(t4, t0, t3)

Foldable: a pure op (no write, no randomness, no dynamic scalar) whose tensor inputs are all
constants, whose results nobody writes afterwards and which are not returned (a traced call
returns fresh tensors).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..ir.graph import Graph, Node, Op
from ..record.calls import rebuild_call
from .analysis import is_pure_call, single_version_handles


def fold_constants(graph: Graph) -> Graph:
    if graph.host_visible or not graph.capture_as_const:
        return graph
    unwritten = single_version_handles(graph)
    returned = {graph.values[v].handle for v in graph.outputs} | set(graph.escaped)
    constant_values = {n.outputs[0]: graph.constants[graph.values[n.outputs[0]].handle]
                       for n in graph.nodes if n.op is Op.CONST and graph.values[n.outputs[0]].handle in graph.constants
                       and graph.values[n.outputs[0]].handle not in graph.fresh}  # a literal made anew each call
    constants = dict(graph.constants)
    nodes = []
    for node in graph.nodes:
        handles = [graph.values[v].handle for v in node.outputs if v is not None]
        foldable = (
            is_pure_call(node) and not node.scalars and node.inputs
            and all(v in constant_values for v in node.inputs)
            and all(h in unwritten and h not in returned for h in handles)
        )
        if not foldable:
            nodes.append(node)
            continue
        args, kwargs = rebuild_call(node.statics, [constant_values[v] for v in node.inputs], [])
        with torch.no_grad():
            result = node.target(*args, **kwargs)
        results = [result] if isinstance(result, torch.Tensor) else list(result)
        for vid, tensor in zip(node.outputs, results):
            if vid is None:
                continue
            constant_values[vid] = tensor
            constants[graph.values[vid].handle] = tensor
            nodes.append(Node(Op.CONST, None, (), (vid,), input_name=f"folded {node.name}",
                              source=node.source))
    return replace(graph.with_nodes(_inputs_first(nodes), "fold_constants"), constants=constants)


def _inputs_first(nodes: list[Node]) -> list[Node]:
    """Keep graph inputs (folded constants included) ahead of the computation, as verify expects."""
    inputs = [n for n in nodes if n.op in (Op.ARG, Op.KWARG, Op.EXTERNAL, Op.CONST)]
    return inputs + [n for n in nodes if n.op not in (Op.ARG, Op.KWARG, Op.EXTERNAL, Op.CONST)]
