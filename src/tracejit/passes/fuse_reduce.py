"""fuse_row_reductions (`jit_fuse_reduce`): reductions and the elementwise ops around them become
one row-kernel node.

Before:                                           After:
    t5 = aten.div.Tensor(t4, 2.83)                    t6 = row0_div__softmax(t4)
    t6 = aten._softmax.default(t5, -1, False)           # t5 = aten.div.Tensor(t4, 2.83)
                                                        # t6 = aten._softmax.default(t5, -1, False)

A row op (backends/rows.py: softmax, log-softmax, layer norm, sum/mean/amax, nll_loss, and their
backward) walks a row space: the tensors it reads element by element, split into rows. Its group
takes as *prologue* the elementwise ops that produce its inputs (a result that others read too,
such as a residual sum feeding a layer norm, is stored as well) and as *epilogue* the elementwise
ops that read its results, when they walk the same space element by element or one value per row
(`mean(x, -1) * 2`); row ops of the same space join too (log_softmax and nll_loss: cross-entropy
in one kernel). Members are pure (no in-place writes); legality is the grouping pass's rule
(`legal_group`): nothing outside may need a member's value, or write a member's input, between
the first and the last member. A reduction alone that aten computes as fast (a plain sum) stays
unfused. Runs before group_elementwise, which then groups what is left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..backends.rows import alone_worth_a_kernel, is_row_op, row_space
from ..ir.fused_group import FusedGroup
from ..ir.graph import Graph, Node, Op
from .group import CanFuse, _candidate, _fused_node, _needed_outside, legal_group

CanFuseRow = Callable[[Graph, Node], bool]
MAX_MEMBERS = 24


def fuse_row_reductions(graph: Graph, can_fuse: CanFuse, can_fuse_row: CanFuseRow,
                        max_members: int = MAX_MEMBERS) -> Graph:
    nodes = list(graph.nodes)
    index_of = {id(n): i for i, n in enumerate(nodes)}
    producers = graph.producers()
    users = graph.users()
    taken: set[int] = set()
    groups: list[tuple[list[int], object]] = []
    spaces: dict[int, object] = {}

    def space_of_row_op(node: Node):
        if id(node) not in spaces:
            spaces[id(node)] = row_space(graph, node) if can_fuse_row(graph, node) else None
        return spaces[id(node)]

    def joins(node: Node, space) -> bool:
        if node.op is not Op.CALL or id(node) in taken or node.hoisted or node.writes:
            return False
        if is_row_op(node.target):  # (a row op may return a tuple: layer norm, nll_loss)
            return space_of_row_op(node) == space
        if not _candidate(node):
            return False
        outputs = [v for v in node.outputs if v is not None]
        return (len(outputs) == 1 and space.member_class(graph.values[outputs[0]].meta.shape) is not None
                and can_fuse(graph, node))

    def legal(members: list[Node]) -> bool:
        return len(members) <= max_members and legal_group(graph, members, nodes, index_of)

    for node in nodes:
        if node.op is not Op.CALL or id(node) in taken or node.hoisted or not is_row_op(node.target):
            continue
        space = space_of_row_op(node)
        if space is None:
            continue
        members = [node]
        grown = True
        while grown:
            grown = False
            inside = {id(m) for m in members}
            produced = {v for m in members for v in m.outputs if v is not None}
            # prologue: producers of the members' inputs (a result read elsewhere is also stored)
            for vid in dict.fromkeys(v for m in members for v in m.inputs if v not in produced):
                producer = producers.get(vid)
                if producer is None or id(producer) in inside or not joins(producer, space):
                    continue
                candidate = sorted(members + [producer], key=lambda n: index_of[id(n)])
                if legal(candidate):
                    members, grown = candidate, True
                    break
            if grown:
                continue
            # epilogue: readers of a member's result
            for vid in [v for m in members for v in m.outputs if v is not None]:
                for reader in users.get(vid, ()):
                    if id(reader) in inside or not joins(reader, space):
                        continue
                    candidate = sorted(members + [reader], key=lambda n: index_of[id(n)])
                    if legal(candidate):
                        members, grown = candidate, True
                        break
                if grown:
                    break
        if len(members) == 1 and not alone_worth_a_kernel(node.target):
            continue
        taken |= {id(m) for m in members}
        groups.append(([index_of[id(m)] for m in members], space))
    if not groups:
        return graph
    return _rewrite(graph, nodes, groups)


def _rewrite(graph: Graph, nodes: list[Node], groups: list[tuple[list[int], object]]) -> Graph:
    member_of = {index: g for g, (members, _) in enumerate(groups) for index in members}
    needed = _needed_outside(graph, nodes, member_of)
    rewritten = []
    for index, node in enumerate(nodes):
        g = member_of.get(index)
        if g is None:
            rewritten.append(node)
        elif index == groups[g][0][-1]:
            members, space = groups[g]
            fused = _fused_node(graph, g, [nodes[i] for i in members], needed)
            name = "row" + fused.target.name.removeprefix("fused")
            others = tuple(sorted(space.allowed_shapes() - {space.element}))
            rewritten.append(dataclasses.replace(fused, target=FusedGroup(name, space.element, rows=others)))
    return graph.with_nodes(rewritten, "fuse_row_reductions")
