"""eliminate_common_subexpressions: identical pure ops on identical inputs run once.

Before (host-free graph):          After:
    t3 = aten.t.default(t2)            t3 = aten.t.default(t2)
    t9 = aten.t.default(t2)            t10 = aten.mm.default(t3, t3)
    t10 = aten.mm.default(t3, t9)

Pure means: no in-place write, no randomness, no dynamic scalar (its value may differ per
call). Values written after their creation, returned or kept in Python state are never merged.
"""

from __future__ import annotations

from ..ir.graph import Graph
from .analysis import identity_matters, is_pure_call, replace_uses, single_version_handles


def eliminate_common_subexpressions(graph: Graph) -> Graph:
    if graph.host_visible:
        return graph
    unwritten = single_version_handles(graph)
    held = identity_matters(graph)
    seen: dict[tuple, tuple] = {}
    mapping: dict[int, int] = {}
    nodes = []
    for node in graph.nodes:
        inputs = tuple(mapping.get(v, v) for v in node.inputs)
        handles = [graph.values[v].handle for v in node.outputs if v is not None]
        mergeable = (
            is_pure_call(node) and not node.scalars
            and all(h in unwritten and h not in held for h in handles)
        )
        if mergeable:
            try:
                key = (node.target, inputs, node.statics)
                hash(key)
            except TypeError:
                key = None
            if key is not None and key in seen:
                for mine, theirs in zip(node.outputs, seen[key]):
                    if mine is not None and theirs is not None:
                        mapping[mine] = theirs
                continue
            if key is not None:
                seen[key] = node.outputs
        nodes.append(node)
    return graph.with_nodes(provenance="eliminate_common_subexpressions", **replace_uses(graph, nodes, mapping))
