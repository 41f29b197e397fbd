"""remove_noop_views: aliases the program does not need become the value they alias.

Before (host-free graph):          After:
    t7 = aten.detach.default(t6)       t25 = aten.threshold_backward.default(t16, t6, 0)
    t25 = aten.detach.default(t7)
    t26 = aten.threshold_backward.default(t16, t25, 0)

Only aliases nobody writes through, that are not returned or kept in Python state (where the
object's identity matters), are removed. A host-visible graph keeps every op: the host holds
each alias as an object of its own.
"""

from __future__ import annotations

import torch

from ..ir.graph import Graph, Op
from .analysis import identity_matters, replace_uses, single_version_handles

aten = torch.ops.aten
NOOP_ALIASES = frozenset({aten.detach.default, aten.alias.default, aten.lift_fresh.default})


def remove_noop_views(graph: Graph) -> Graph:
    if graph.host_visible:
        return graph
    unwritten = single_version_handles(graph)
    held = identity_matters(graph)
    mapping: dict[int, int] = {}
    nodes = []
    for node in graph.nodes:
        if node.op is Op.CALL and node.target in NOOP_ALIASES:
            handle = graph.values[node.outputs[0]].handle
            if handle in unwritten and handle not in held:
                mapping[node.outputs[0]] = node.inputs[0]
                continue
        nodes.append(node)
    return graph.with_nodes(provenance="remove_noop_views", **replace_uses(graph, nodes, mapping))
