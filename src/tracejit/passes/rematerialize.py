"""rematerialize: sublinear memory — keep some forward activations, recompute the rest in backward.

A training step keeps every forward value that backward reads alive from the forward pass to
its backward use, so the peak holds all of them at once. This pass keeps only every k-th such
value (the *checkpoints*, k = sqrt(n) by default, as in gradient checkpointing) and recomputes
the others right before the first backward op that reads them, from the checkpoints. The
recomputed ops are the same pure ops on the same inputs, so results are bit for bit the same.

Before (host-free graph):                     After (the relu output t6 is not a checkpoint):
    t5 = aten.addmm.default(t4, t0, t3)           t5 = aten.addmm.default(t4, t0, t3)
    t6 = aten.relu.default(t5)                    t6 = aten.relu.default(t5)
    ...                                           ...            # t6 dies after its forward use
    t26 = aten.threshold_backward(t16, t6, 0)     t90 = aten.relu.default(t5)
                                                  t26 = aten.threshold_backward(t16, t90, 0)

Random ops, in-place writes and values that outlive the call are never recomputed; a value
whose recomputation needs one of them keeps it alive instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..ir.graph import Graph, Node, Op, Value
from ..record.record import TENSOR
from .analysis import is_pure_call, observable_roots, rehomed_views, single_version_handles


def rematerialize(graph: Graph, checkpoint_every: int | None = None, min_bytes: int = 0,
                  batch_norm: bool = True) -> Graph:
    candidates = find_candidates(graph, min_bytes, batch_norm)
    if candidates is None or len(candidates.saved_roots) < 2:
        return graph
    every = checkpoint_every or max(2, math.isqrt(len(candidates.saved_roots)))
    kept = {root for k, root in enumerate(candidates.saved_roots) if k % every == every - 1}
    return recompute_all_but(candidates, kept)


@dataclass(frozen=True)
class Candidates:
    """What a graph could recompute in backward: `saved_roots`, the storage made in forward and
    read in backward that recomputation could free (in creation order), and the pure forward
    values recomputation may run again."""

    graph: Graph
    nodes: list[Node]
    first_backward: int
    producer: dict[int, tuple[int, Node]]  # value id -> (index, node)
    recomputable: set[int]
    saved_roots: list[int]


def find_candidates(graph: Graph, min_bytes: int = 0, batch_norm: bool = True) -> Candidates | None:
    """None for graphs without a backward (or that the host sees: their values must stay real).
    `batch_norm=False`: a batch norm in training is not recomputed (a row kernel computes it in its
    own order where reductions fuse: the aten recomputation would give backward other bits)."""
    if graph.host_visible:
        return None
    nodes = list(graph.nodes)
    first_backward = next((i for i, n in enumerate(nodes) if n.op is Op.CALL and n.backward_of), None)
    if first_backward is None:
        return None
    producer = {v: (i, n) for i, n in enumerate(nodes) for v in n.outputs if v is not None}
    recomputable = _recomputable_values(graph, nodes, producer, first_backward, batch_norm)
    saved_roots = _saved_roots(graph, nodes, first_backward, recomputable, min_bytes)
    return Candidates(graph, nodes, first_backward, producer, recomputable, saved_roots)


def recompute_all_but(candidates: Candidates, kept: set[int]) -> Graph:
    """The graph with every saved root outside `kept` recomputed right before its backward uses,
    back to the kept ones and the inputs."""
    graph = candidates.graph
    rewriter = _Rewriter(graph, candidates.producer, candidates.recomputable, kept)
    rewritten: list[Node] = []
    for index, node in enumerate(candidates.nodes):
        if index >= candidates.first_backward and any(rewriter.recomputed(v) for v in node.inputs):
            inputs = tuple(rewriter.value_for(v, node.fire_at, rewritten) for v in node.inputs)
            node = replace(node, inputs=inputs)
        rewritten.append(node)
    if not rewriter.values:
        return graph
    recomputed = replace(graph.with_nodes(rewritten, "rematerialize"), values=graph.values + tuple(rewriter.values),
                         num_handles=rewriter.next_handle)
    return replace(recomputed, values=rehomed_views(recomputed, rewriter.copies,
                                                    among=_views_of_copies(recomputed, rewriter.copies)))


def _views_of_copies(graph: Graph, copies: dict[int, int]) -> set[int]:
    """The views backward makes of recomputed copies, directly or through other such views: bmm's
    backward transposes the (recomputed) softmax it multiplies. Recorded as views of the original,
    they would keep the original's storage alive instead of the copy's, and plan_memory would give
    the copy's buffer to a later op while they are still read. A view's storage is its node's
    first input's (as for the copies themselves, `_Rewriter._root_of_copy`); views of a value
    backward still reads from forward (one no copy replaces) stay with the original."""
    moved = set(copies.values())
    views = set()
    for node in graph.nodes:
        if not node.inputs or node.inputs[0] not in moved:
            continue
        for vid in node.outputs:
            value = graph.values[vid] if vid is not None else None
            if value is not None and vid not in moved and value.root != value.handle:
                views.add(vid)
                moved.add(vid)
    return views


def _recomputable_values(graph: Graph, nodes: list[Node], producer: dict, first_backward: int,
                         batch_norm: bool) -> set[int]:
    """Pure forward values whose storage nobody writes and whose inputs nobody writes between
    their producer and the end of backward, where the recomputation runs: `b = a.tanh();
    a.add_(1)` cannot recompute `b` from `a` (eager allows the write, nothing saved `a`; the
    copy was computed from `a + 1`: gradients 0.65 off). A write after backward (the optimizer
    step on a parameter) comes after every recomputation."""
    unwritten = single_version_handles(graph)
    observable = observable_roots(graph)
    last_backward = max(i for i, n in enumerate(nodes) if n.op is Op.CALL and n.backward_of)
    written_at: dict[int, list[int]] = {}  # root -> positions of the nodes writing it up to backward's end
    for position, node in enumerate(nodes[:last_backward + 1]):
        for vid in node.writes:
            written_at.setdefault(graph.values[vid].root, []).append(position)
    found = set()
    for vid, (index, node) in producer.items():
        value = graph.values[vid]
        recomputable = (is_pure_call(node) and node.out_kind == "tensor") or (
            batch_norm and vid == node.outputs[0] and _batch_norm_in_training(graph, node))
        if index < first_backward and recomputable and value.handle in unwritten and value.root not in observable \
                and not any(position > index for u in node.inputs
                            for position in written_at.get(graph.values[u].root, ())):
            found.add(vid)
    return found


_BATCH_NORM = torch.ops.aten.native_batch_norm.default
_BATCH_NORM_WITHOUT_STATISTICS = torch.ops.aten._native_batch_norm_legit.no_stats


def _batch_norm_in_training(graph: Graph, node: Node) -> bool:
    """A CPU batch norm in training: it also updates the running statistics, so it cannot run
    again, but its output can: the same kernel without running statistics
    (`_native_batch_norm_legit.no_stats`) updates nothing and gives the same bits on the CPU. The
    batch norm of a CNN is most of what it keeps for backward."""
    return (node.op is Op.CALL and node.target is _BATCH_NORM and len(node.statics) == 8
            and node.statics[5] is True and graph.values[node.outputs[0]].meta.device.type == "cpu")


def _recomputation(node: Node, graph: Graph, inputs: tuple[int, ...], output: int, position: int) -> Node:
    """The node that computes `node`'s (first) result again from `inputs`."""
    if node.target is not _BATCH_NORM:
        return replace(node, inputs=inputs, outputs=(output,), positions=(position,))
    # input, weight, bias, training, momentum, eps: the running statistics left out
    statics = (*node.statics[:3], *node.statics[5:])
    tensors = sum(1 for item in node.statics[:3] if item is TENSOR)
    return replace(node, target=_BATCH_NORM_WITHOUT_STATISTICS, inputs=inputs[:tensors], outputs=(output, None, None),
                   positions=(position,), statics=statics, writes=(), buffer=None,
                   input_metas=node.input_metas[:tensors])


def _saved_roots(graph: Graph, nodes: list[Node], first_backward: int, recomputable: set[int],
                 min_bytes: int) -> list[int]:
    """Storage made in forward and read in backward that recomputation could free, in creation order."""
    base_of = {graph.values[v].handle: v for v in recomputable if graph.values[v].root == graph.values[v].handle}
    roots: dict[int, None] = {}
    for node in nodes[first_backward:]:
        for vid in node.inputs:
            root = graph.values[vid].root
            if vid in recomputable and root in base_of and value_bytes(graph.values[base_of[root]]) >= min_bytes:
                roots.setdefault(root)
    order = {graph.values[v].handle: i for i, n in enumerate(nodes) for v in n.outputs if v is not None}
    return sorted(roots, key=lambda r: order.get(r, 0))


def value_bytes(value: Value) -> int:
    numel = 1
    for size in value.meta.shape:
        numel *= size
    return numel * torch.empty((), dtype=value.meta.dtype).element_size()


class _Rewriter:
    """Creates recomputed copies of forward values (memoized), with fresh handles. Everything
    recomputable is recomputed back to the checkpoints (the kept roots) and the inputs."""

    def __init__(self, graph: Graph, producer: dict, recomputable: set[int], kept: set[int]):
        self.graph = graph
        self.producer = producer
        self.recomputable = recomputable
        self.kept = kept
        self.values: list[Value] = []
        self.copies: dict[int, int] = {}  # original value id -> recomputed value id
        self.next_handle = graph.num_handles

    def recomputed(self, vid: int) -> bool:
        return vid in self.recomputable and self.graph.values[vid].root not in self.kept

    def value_for(self, vid: int, position: int, out: list[Node]) -> int:
        if vid in self.copies:
            return self.copies[vid]
        if not self.recomputed(vid):
            return vid  # a checkpoint, an input, or something that cannot be recomputed: kept alive
        value = self.graph.values[vid]
        _, node = self.producer[vid]
        inputs = tuple(self.value_for(v, position, out) for v in node.inputs)
        handle = self.next_handle
        self.next_handle += 1
        root = handle if value.root == value.handle else self._root_of_copy(node, inputs)
        copy = Value(len(self.graph.values) + len(self.values), handle, 0, value.meta, root)
        self.values.append(copy)
        out.append(_recomputation(node, self.graph, inputs, copy.id, position))
        self.copies[vid] = copy.id
        return copy.id

    def _root_of_copy(self, node: Node, inputs: tuple[int, ...]) -> int:
        first = inputs[0]
        values = self.graph.values
        return values[first].root if first < len(values) else self.values[first - len(values)].root
