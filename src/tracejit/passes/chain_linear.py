"""chain_small_linear: small matrix products, alone or in a chain, become one kernel node.

Before (host-free graph):                                  After:
    t5 = aten._addmm_activation.default(t2, t0, t3)            t9 = linear0_addmm_activation_addmm(t2, t0, t3, t4, t8)
    t9 = aten.addmm.default(t4, t5, t8)                          # t5 = aten._addmm_activation.default(t2, t0, t3)
                                                                 # t9 = aten.addmm.default(t4, t5, t8)

A batch-1 forward (inference, a policy network, a per-sample step) spends most of each product in
getting to the BLAS kernel: `addmm` of one 64-row vector by a 64x128 weight costs 3 µs through aten
and computes in well under one. A generated kernel computes such a product in one call, and a
chain of them (an MLP's layers) in one call with its intermediates on the stack. The backend
decides which products it takes (`can_chain`: the C backend's float32 CPU products); this pass
decides which are small enough (BLAS wins from a few rows and a few hundred thousand
multiply-adds on) and which may chain: the next product's left side is the previous one's result
and reads nothing else of it, and nothing in between runs (views hoisted out of the call aside).
Only products with eager's defaults (`beta=1, alpha=1`, ReLU as `_addmm_activation`'s activation)
qualify. Sums are ordered differently from the BLAS library's, so results agree with eager's to
rounding, not bit for bit (the `aten` backend keeps eager's bits).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..ir.fused_group import FusedGroup
from ..ir.graph import Graph, Node, Op
from .analysis import versions_of

aten = torch.ops.aten
CanChain = Callable[[Graph, Node], bool]

# role of each tensor input, in the op's order
LINEAR_OPS = {
    aten.addmm.default: ("bias", "left", "weight"),
    aten._addmm_activation.default: ("bias", "left", "weight"),
    aten.mm.default: ("left", "weight"),
}
MAX_ROWS = 4
MAX_MULTIPLY_ADDS = 1 << 16
MAX_CHAIN = 8
# bytes of the intermediates a chain keeps on the kernel's stack (a thread may have a small one)
MAX_STACK_BYTES = 16 << 10


def product_shape(graph: Graph, node: Node) -> tuple[int, int, int] | None:
    """(rows, inner, columns) of a product this pass may take, else None."""
    if node.op is not Op.CALL or node.target not in LINEAR_OPS or node.scalars or node.writes:
        return None
    if len(node.statics) != len(LINEAR_OPS[node.target]):  # beta=, alpha= or use_gelu= given
        return None
    metas = dict(zip(LINEAR_OPS[node.target], (graph.values[v].meta for v in node.inputs)))
    left, weight = metas["left"].shape, metas["weight"].shape
    if len(left) != 2 or len(weight) != 2 or left[1] != weight[0]:
        return None
    rows, inner, columns = left[0], left[1], weight[1]
    if "bias" in metas and tuple(metas["bias"].shape) != (columns,):
        return None
    if not (1 <= rows <= MAX_ROWS and inner >= 1 and columns >= 1 and rows * inner * columns <= MAX_MULTIPLY_ADDS):
        return None
    return rows, inner, columns


def chain_small_linear(graph: Graph, can_chain: CanChain | None = None, fuel: int | None = None) -> Graph:
    """`fuel` bounds how many chains are formed (TRACEJIT_FUSION_FUEL, bisecting a miscompile)."""
    if can_chain is None or graph.host_visible:
        return graph
    chains = _chains(graph, can_chain)
    if fuel is not None:
        chains = chains[:max(fuel, 0)]
    if not chains:
        return graph
    last_of = {chain[-1]: number for number, chain in enumerate(chains)}  # a chain runs at its last product
    member = {index for chain in chains for index in chain}
    nodes = []
    for index, node in enumerate(graph.nodes):
        if index in last_of:
            number = last_of[index]
            nodes.append(_linear_node(graph, number, [graph.nodes[i] for i in chains[number]]))
        elif index not in member:
            nodes.append(node)
    return graph.with_nodes(nodes, "chain_small_linear")


def _chains(graph: Graph, can_chain: CanChain) -> list[list[int]]:
    users = graph.users()
    versions = versions_of(graph)
    kept = set(graph.outputs) | {versions[h][-1] for h in graph.escaped if h in versions}
    breaks = {position for position, _ in graph.reads} | set(graph.barriers)
    chains: list[list[int]] = []
    previous: int | None = None  # index of the last product of the open chain
    stack = 0  # bytes the open chain keeps on the stack
    for index, node in enumerate(graph.nodes):
        if node.hoisted:
            continue  # computed once per binding, not where it stands
        if product_shape(graph, node) is None or not can_chain(graph, node):
            previous = None
            continue
        kept_bytes = 0 if previous is None else _bytes(graph, graph.nodes[previous].outputs[0])
        if previous is not None and _continues(graph, graph.nodes[previous], node, users, kept, versions, breaks) \
                and len(chains[-1]) < MAX_CHAIN and stack + kept_bytes <= MAX_STACK_BYTES:
            chains[-1].append(index)
            stack += kept_bytes
        else:
            chains.append([index])
            stack = 0
        previous = index
    return chains


def _bytes(graph: Graph, value: int) -> int:
    meta = graph.values[value].meta
    return math.prod(meta.shape) * meta.dtype.itemsize


def linear_groups(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if n.op is Op.FUSED and n.target.kind == "linear"]


def _continues(graph: Graph, before: Node, after: Node, users: dict, kept: set, versions: dict,
               breaks: set) -> bool:
    """Whether `after` may join the chain `before` ends: it multiplies before's result, which
    nothing else reads, keeps or writes, and no host read or barrier stands between them."""
    value = before.outputs[0]
    left = after.inputs[LINEAR_OPS[after.target].index("left")]
    if left != value or value in kept or len(users.get(value, ())) != 1:
        return False
    if value in after.inputs[:LINEAR_OPS[after.target].index("left")] or after.inputs.count(value) != 1:
        return False
    handle = graph.values[value].handle
    if handle in graph.host_reads or len(versions[handle]) != 1:
        return False
    return not any(before.fire_at < position <= after.fire_at for position in breaks)


def _linear_node(graph: Graph, number: int, members: list[Node]) -> Node:
    produced = {m.outputs[0] for m in members}
    inputs = tuple(dict.fromkeys(v for m in members for v in m.inputs if v not in produced))
    ops = "_".join(str(m.target).split(".")[1].lstrip("_") for m in members[:3])
    name = f"linear{number}_{ops}" + ("_etc" if len(members) > 3 else "")
    last = members[-1]
    positions = tuple(sorted(p for m in members for p in m.positions))
    shape = tuple(graph.values[last.outputs[0]].meta.shape)
    return Node(Op.FUSED, FusedGroup(name, shape, kind="linear"), inputs, (last.outputs[0],),
                positions=positions, source=last.source, members=tuple(members))
