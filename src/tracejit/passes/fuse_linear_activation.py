"""fuse_linear_activation: `relu(addmm(b, x, w))` becomes one `_addmm_activation(b, x, w)`.

Before (host-free graph):                      After:
    t5 = aten.addmm.default(t4, t0, t3)            t6 = aten._addmm_activation.default(t4, t0, t3)
    t6 = aten.relu.default(t5)

The pair is the body of every `nn.Linear` + `nn.ReLU`; the fused op computes the product and
applies the ReLU in place on its result, so the numbers are bit for bit the same while one op
call and one allocation disappear. Applies when nothing else reads the addmm result, it is
neither returned nor kept, and nothing in between writes what the addmm reads.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..ir.graph import Graph, Op
from .analysis import versions_of

aten = torch.ops.aten


def fuse_linear_activation(graph: Graph) -> Graph:
    if graph.host_visible:
        return graph
    users = graph.users()
    versions = versions_of(graph)
    keep = set(graph.outputs) | {versions[h][-1] for h in graph.escaped if h in versions}
    producers = {n.outputs[0]: (i, n) for i, n in enumerate(graph.nodes)
                 if n.op is Op.CALL and n.target is aten.addmm.default}
    replaced: dict[int, object] = {}  # id(node) -> replacement (None: drop)
    for index, node in enumerate(graph.nodes):
        if node.op is not Op.CALL or node.target is not aten.relu.default:
            continue
        at, addmm = producers.get(node.inputs[0], (None, None))
        value = node.inputs[0]
        if (addmm is None or len(users.get(value, [])) != 1 or value in keep or len(versions[graph.values[value].handle]) != 1
                or addmm.scalars or len(addmm.statics) != 3 or _written_between(graph, addmm, graph.nodes[at + 1:index])):
            continue
        fused = replace(addmm, target=aten._addmm_activation.default, outputs=node.outputs,
                        positions=tuple(sorted((*addmm.positions, *node.positions))), source=node.source)
        replaced[id(addmm)] = None
        replaced[id(node)] = fused
    if not replaced:
        return graph
    nodes = []
    for node in graph.nodes:
        if id(node) in replaced:
            if replaced[id(node)] is not None:
                nodes.append(replaced[id(node)])
        else:
            nodes.append(node)
    return graph.with_nodes(nodes, "fuse_linear_activation")


def _written_between(graph: Graph, addmm, between) -> bool:
    """Whether an op between the product and its ReLU writes memory the product reads: the fused
    op runs at the ReLU's place and would read the new contents (`h = F.linear(x, W); x.mul_(2)`)."""
    read = {graph.values[v].root for v in addmm.inputs}
    return any(graph.values[w].root in read for node in between for w in node.writes)
