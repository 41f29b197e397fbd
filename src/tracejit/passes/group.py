"""group_elementwise: chains of elementwise ops become fused kernel nodes.

Before:                                        After:
    t5 = aten.mul.Tensor(t0, t1)                   t7 = fused0_mul_add_sigmoid(t0, t1)
    t6 = aten.add.Tensor(t5, 1)                      # t5 = aten.mul.Tensor(t0, t1)
    t7 = aten.sigmoid.default(t6)                    # t6 = aten.add.Tensor(t5, 1)
                                                     # t7 = aten.sigmoid.default(t6)

A FUSED node keeps its member CALL nodes, reads the values its members read from outside the
group, and produces the member values something outside still needs (later ops, the return
value, Python state, host reads). Which ops may join is the backend's decision (`can_fuse`);
when a group is *legal* is decided here (`legal_group`), from one rule: a group runs when its
last member's position is reached, so nothing outside it may need a member's value, or write a
member's input, between its first and last member. Groups never cross a host read or an excluded
block, and in host-visible graphs nothing outside may even read a group input inside the span
(holding it would change what autograd dispatches).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ir.graph import Graph, Node, Op
from .analysis import versions_of

CanFuse = Callable[[Graph, Node], bool]
MAX_MEMBERS = 48


@dataclass(frozen=True)
class FusedGroup:
    """The target of a FUSED node: what the backend compiles into one kernel."""

    name: str
    shape: tuple[int, ...]  # iteration space: every member's output has this shape


def group_elementwise(graph: Graph, can_fuse: CanFuse | None = None, max_members: int = MAX_MEMBERS) -> Graph:
    if can_fuse is None:
        return graph
    nodes = list(graph.nodes)
    groups: list[list[int]] = []
    group_of_value: dict[int, int] = {}
    for index, node in enumerate(nodes):
        if not _candidate(graph, node) or not can_fuse(graph, node):
            continue
        joined = {group_of_value[v] for v in node.inputs if v in group_of_value}
        target = None
        if len(joined) == 1:
            g = joined.pop()
            members = groups[g]
            shape = graph.values[nodes[members[0]].outputs[0]].meta.shape
            if (len(members) < max_members and graph.values[node.outputs[0]].meta.shape == shape
                    and legal_group(graph, [nodes[i] for i in members] + [node], nodes)):
                target = g
        if target is None:
            groups.append([])
            target = len(groups) - 1
        groups[target].append(index)
        group_of_value[node.outputs[0]] = target
    fused = [g for g in groups if len(g) > 1]
    if not fused:
        return graph
    return _rewrite(graph, nodes, fused)


def _candidate(graph: Graph, node: Node) -> bool:
    target = node.target
    return (
        node.op is Op.CALL
        and not node.writes
        and not node.attr("hoisted")
        and node.attr("out_kind") == "tensor"
        and isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded not in target.tags
    )


def legal_group(graph: Graph, members: list[Node], nodes: list[Node] | None = None) -> bool:
    """Whether `members` may run as one node firing at the last member's position."""
    nodes = list(graph.nodes) if nodes is None else nodes
    first, last = min(m.fire_at for m in members), max(m.fire_at for m in members)
    if any(first < p <= last for p in graph.barriers):  # the read happens before op p
        return False
    member_ids = {id(m) for m in members}
    produced = {v for m in members for v in m.outputs if v is not None}
    read = {v for m in members for v in m.inputs} - produced
    read_roots = {graph.values[v].root for v in read}
    for node in nodes:
        if id(node) in member_ids or not node.positions or not first < node.fire_at < last:
            continue
        if any(v in produced for v in node.inputs):
            return False  # needs a member's value before the group runs
        if any(graph.values[v].root in read_roots for v in node.writes):
            return False  # changes a member's input before the group reads it
        if graph.host_visible and any(v in read for v in node.inputs):
            return False  # the program would hold the input while the host uses it
    return True


def _rewrite(graph: Graph, nodes: list[Node], groups: list[list[int]]) -> Graph:
    member_of = {index: g for g, members in enumerate(groups) for index in members}
    needed = _needed_outside(graph, nodes, member_of)
    rewritten = []
    for index, node in enumerate(nodes):
        g = member_of.get(index)
        if g is None:
            rewritten.append(node)
        elif index == groups[g][-1]:
            rewritten.append(_fused_node(graph, g, [nodes[i] for i in groups[g]], needed))
    return graph.with_nodes(rewritten, "group_elementwise")


def _needed_outside(graph: Graph, nodes: list[Node], member_of: dict[int, int]) -> set[int]:
    """Member values that must be materialized: read by a node outside their group, returned,
    kept in Python state, or read by the host."""
    needed = set(graph.outputs)
    versions = versions_of(graph)
    needed |= {versions[h][-1] for h in graph.escaped if h in versions}
    needed |= {v.id for v in graph.values if v.handle in graph.host_reads}
    producer_group = {v: member_of[i] for i, n in enumerate(nodes) if i in member_of for v in n.outputs}
    for index, node in enumerate(nodes):
        for vid in node.inputs:
            group = producer_group.get(vid)
            if group is not None and member_of.get(index) != group:
                needed.add(vid)
    return needed


def _fused_node(graph: Graph, number: int, members: list[Node], needed: set[int]) -> Node:
    produced = [m.outputs[0] for m in members]
    inputs = list(dict.fromkeys(v for m in members for v in m.inputs if v not in produced))
    # the last member's value is always computed: checked replay hands it to the host as a real
    # tensor when the group runs
    outputs = tuple(v for v in produced if v in needed or v == produced[-1])
    ops = "_".join(str(m.target).split(".")[1] for m in members[:4])
    name = f"fused{number}_{ops}" + ("_etc" if len(members) > 4 else "")
    shape = graph.values[produced[0]].meta.shape
    positions = tuple(sorted(p for m in members for p in m.positions))
    return Node(Op.FUSED, FusedGroup(name, shape), tuple(inputs), outputs, (), (), positions, members[-1].source,
                tuple(members))
