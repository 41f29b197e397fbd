"""hoist_external_views: views of external tensors are computed once and kept across calls.

Before (host-free graph):              After:
    t2 = external('model.0.weight')        t2 = external('model.0.weight')
    t3 = aten.t.default(t2)                t3 = aten.t.default(t2)   # hoisted: once per binding
    t5 = aten.addmm.default(t4, t0, t3)    t5 = aten.addmm.default(t4, t0, t3)

A view shares its base's storage, so an in-place update of the parameter (the optimizer's)
shows through a view made before it. The view stays valid as long as the external is the same
object over the same storage, which the without_host call checks every time.
"""

from __future__ import annotations

from dataclasses import replace

from ..ir.graph import Graph, Op
from ..record.calls import is_view_op
from .analysis import identity_matters


def hoist_external_views(graph: Graph) -> Graph:
    if graph.host_visible:
        return graph
    # a fresh literal is another tensor on every call (graph.fresh)
    invariant = {n.outputs[0] for n in graph.nodes if n.op in (Op.EXTERNAL, Op.CONST)
                 and graph.values[n.outputs[0]].handle not in graph.fresh}
    held = identity_matters(graph)
    nodes = []
    for node in graph.nodes:
        hoistable = (
            node.op is Op.CALL and is_view_op(node.target) and not node.scalars and not node.writes
            and node.inputs and all(v in invariant for v in node.inputs)
            and all(graph.values[v].handle not in held for v in node.outputs if v is not None)
            # a view as recorded: an op that may copy (record/calls.py MAY_COPY) and did runs every call
            and all(graph.values[v].root != graph.values[v].handle for v in node.outputs if v is not None)
        )
        if hoistable:
            node = replace(node, hoisted=True)
            invariant.update(v for v in node.outputs if v is not None)
        nodes.append(node)
    return graph.with_nodes(nodes, "hoist_external_views")
