"""jit_fuse_dimshuffle: dimshuffles (transpose, permute, reshape, expand and the other views) cost
nothing per call, and the copies that materialize them read with strides.

Two parts:

`make_views_static` (after plan_memory): a view whose input lives in the persistent arena (a
planned buffer, or a view of one) is the same tensor on every call, so the generated program makes
it once when it is built and binds it on each call, instead of dispatching the view op:

    t11 = aten.addmm.default(t10, t7, t9)        # arena[0:196608]
    t12 = aten.view.default(t11, [8, 32, 192])   # static view

`worth_alone` (for group_elementwise): an elementwise op alone becomes a kernel when it reads a
tensor laid out otherwise than its result (a copy of a transposed tensor, a division of a broadcast
one), which aten's TensorIterator walks slowly; ops computing a transcendental function stay aten's
(its vectorized functions are faster than the kernels' when nothing else fuses). With any
graph_opt_config fusion on, a lone `_foreach_` op is one multi-tensor kernel instead of one aten
dispatch per tensor (an optimizer's step count).
"""

from __future__ import annotations

from dataclasses import replace

from ..backends.base import lowered_ops
from ..backends.expr import TRANSCENDENTAL
from ..backends.optable import entry_for
from ..ir.graph import Graph, Node, Op
from ..record.calls import aliases_its_input
from .group import CanFuse


def make_views_static(graph: Graph) -> Graph:
    if graph.host_visible:
        return graph
    static: set[int] = set()
    nodes = []
    changed = False
    for node in graph.nodes:
        if node.op is Op.CALL and node.buffer is not None and node.outputs and node.outputs[0] is not None:
            static.add(node.outputs[0])
        elif node.op is Op.FUSED:
            static.update(v for v, b in zip(node.outputs, node.buffers) if b is not None)
        elif (node.op is Op.CALL and not node.hoisted and not node.writes and not node.scalars and node.inputs
              and aliases_its_input(node.target) and all(v in static for v in node.inputs)
              and node.out_kind in ("tensor", "tuple", "list") and _views_only(graph, node)):
            node = replace(node, static_view=True)
            static.update(v for v in node.outputs if v is not None)
            changed = True
        nodes.append(node)
    return graph.with_nodes(nodes, "make_views_static") if changed else graph


def _views_only(graph: Graph, node: Node) -> bool:
    """Its outputs lie in another value's memory, as recorded: an op that may copy (record/calls.py
    MAY_COPY) and did is computed on every call."""
    return all(graph.values[v].root != graph.values[v].handle for v in node.outputs if v is not None)


def worth_alone(dimshuffle: bool) -> CanFuse:
    def alone(graph: Graph, node: Node) -> bool:
        found = entry_for(node.target)
        if found is None:
            return False
        if found[1]:
            return True  # a _foreach_ op: one launch for every tensor of its lists
        if not dimshuffle:
            return False
        results = [v for v in (*node.outputs, *node.writes) if v is not None]
        if len(results) != 1:
            return False
        out = graph.values[results[0]].meta
        strided = any(graph.values[v].meta.shape != out.shape or graph.values[v].meta.stride != out.stride
                      for v in node.inputs)
        ops = lowered_ops(graph, node)
        return strided and ops is not None and not ops & TRANSCENDENTAL
    return alone
