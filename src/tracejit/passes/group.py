"""group_elementwise: the seam where elementwise chains become fused kernel nodes.

A grouping turns runs of CALL nodes into FUSED nodes whose `members` are the original nodes.
Which ops can join a group and how a group becomes a kernel is the fused-kernel backends'
business; this module holds the pass and the rules every grouping must respect
(`legal_group`). Until a fusion backend is wired in, the pass forms no group.
"""

from __future__ import annotations

from ..ir.graph import Graph, Node


def group_elementwise(graph: Graph) -> Graph:
    return graph


def legal_group(graph: Graph, members: list[Node], host_read_positions: set[int] = frozenset()) -> bool:
    """The barriers of checked replay: a group fires at its last member's position, so no value
    produced inside the group may be needed by the host or by another node before that."""
    first, last = min(m.fire_at for m in members), max(m.fire_at for m in members)
    inside = {v for m in members for v in (*m.outputs, *m.writes) if v is not None}
    member_ids = {id(m) for m in members}
    for node in graph.nodes:
        if id(node) in member_ids or not node.positions:
            continue
        if first <= node.fire_at < last and any(v in inside for v in node.inputs):
            return False
    return not any(first <= p < last for p in host_read_positions)
