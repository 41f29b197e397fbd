"""Facts about a graph that several passes need."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..ir.graph import INPUT_OPS, Graph, Node, Op, Value
from ..record.collectives import is_collective


def observable_roots(graph: Graph) -> set[int]:
    """Storage roots whose contents outlive the call: inputs, returned and escaped tensors."""
    roots = {graph.values[n.outputs[0]].root for n in graph.nodes if n.op in INPUT_OPS}
    roots |= {graph.values[v].root for v in graph.outputs}
    roots |= {graph.values[v].root for v in range(len(graph.values)) if graph.values[v].handle in graph.escaped}
    return roots


def has_side_effect(graph: Graph, node: Node, observable: set[int]) -> bool:
    """Writes into observable storage, draws random numbers (keeping the RNG stream as eager's), or
    communicates with other processes (they wait for every collective, in order)."""
    if node.op in INPUT_OPS:
        return False
    if is_collective(node.target):
        return True
    if any(graph.values[v].root in observable for v in node.writes):
        return True
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def is_pure_call(node: Node) -> bool:
    target = node.target
    return (
        node.op is Op.CALL
        and not node.writes
        and isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded not in target.tags
        and node.out_kind in ("tensor", "tuple", "list")
        and not is_collective(target)  # a functional all_reduce returns a fresh tensor, yet talks to peers
    )


def collective_roots(graph: Graph) -> set[int]:
    """Storage roots a collective reads or writes: another process touches that memory while the
    collective runs, so it is never shared with another value (see plan_memory)."""
    roots = set()
    for node in graph.nodes:
        if node.op is Op.CALL and is_collective(node.target):
            for vid in (*node.inputs, *node.writes, *(v for v in node.outputs if v is not None)):
                roots.add(graph.values[vid].root)
    return roots


def identity_matters(graph: Graph) -> set[int]:
    """Handles whose tensor object the caller or Python state holds (returned or escaped)."""
    return set(graph.escaped) | {graph.values[v].handle for v in graph.outputs}


def versions_of(graph: Graph) -> dict[int, list[int]]:
    """handle -> its value ids, oldest first."""
    found: dict[int, list[int]] = {}
    for value in graph.values:
        found.setdefault(value.handle, []).append(value.id)
    return found


def single_version_handles(graph: Graph) -> set[int]:
    """Handles whose storage nobody writes after they are created."""
    return {handle for handle, ids in versions_of(graph).items() if len(ids) == 1}


def replace_uses(graph: Graph, nodes: list[Node], mapping: dict[int, int]) -> dict[str, Any]:
    """Rewrite node inputs and graph outputs through `mapping` (value id -> value id); returns the
    changes for `graph.with_nodes`."""
    if not mapping:
        return {"nodes": nodes}

    def resolve(vid: int) -> int:
        while vid in mapping:
            vid = mapping[vid]
        return vid

    rewritten = []
    for node in nodes:
        inputs = tuple(resolve(v) for v in node.inputs)
        if inputs != node.inputs:
            node = replace(node, inputs=inputs)
        rewritten.append(node)
    return {"nodes": rewritten, "outputs": tuple(resolve(v) for v in graph.outputs),
            "values": rehomed_views(graph, {old: resolve(old) for old in mapping})}


def rehomed_views(graph: Graph, replaced_by: dict[int, int], among: set[int] | None = None) -> tuple[Value, ...]:
    """The values, with the views of a replaced value's storage living in the storage of the value
    replacing it (`replaced_by`: value id -> value id). plan_memory keeps a storage alive while any
    value with it as root is used, so a view left with the replaced storage as its root does not
    keep the replacement's storage alive, which is reused while the view is still read or held.

    CSE keeps one of two equal results: `last = a.mean(0).detach()` after an equal `a.mean(0)` is
    a view of the kept mean; the dropped one is made by no node any more, so every view of its
    storage moves. rematerialize keeps the original for forward and gives backward a recomputed
    copy: only the views backward makes of the copy move, those are `among` (default: all)."""
    roots = {graph.values[old].root: graph.values[new].root for old, new in replaced_by.items()}
    roots = {old: new for old, new in roots.items() if old != new}
    if not roots:
        return graph.values
    return tuple(replace(v, root=roots[v.root]) if v.root in roots and (among is None or v.id in among) else v
                 for v in graph.values)


def peak_live_bytes(graph: Graph) -> int:
    """The most bytes of intermediate storage alive at once when the nodes run in order, with each
    storage freed after the last node touching it (the generated program frees at last use)."""
    spans: dict[int, list[int]] = {}
    sizes: dict[int, int] = {}
    inputs = {graph.values[n.outputs[0]].root for n in graph.nodes if n.op in INPUT_OPS}
    kept = {graph.values[v].root for v in graph.outputs}
    for index, node in enumerate(graph.nodes):
        for vid in (*node.inputs, *(v for v in node.outputs if v is not None), *node.writes):
            value = graph.values[vid]
            if value.root in inputs:
                continue
            span = spans.setdefault(value.root, [index, index])
            span[1] = max(span[1], index)
            if value.handle == value.root:
                numel = 1
                for size in value.meta.shape:
                    numel *= size
                sizes[value.root] = numel * torch.empty((), dtype=value.meta.dtype).element_size()
    end = len(graph.nodes)
    events = [0] * (end + 1)
    for root, (first, last) in spans.items():
        events[first] += sizes.get(root, 0)
        events[end if root in kept else last + 1] -= sizes.get(root, 0)
    peak = live = 0
    for delta in events:
        live += delta
        peak = max(peak, live)
    return peak
