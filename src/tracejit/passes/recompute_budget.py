"""plan_recomputation: `dtr_config` — keep a training step's memory under a threshold by
recomputing chosen forward values in backward.

MegEngine's DTR (dynamic tensor rematerialization) watches memory at run time: over the
threshold, it evicts the resident tensor with the best heuristic score (cheap to recompute,
large, long unused) and recomputes it when an op needs it again. A trace knows its whole op
sequence, so tracejit makes the same choice once, at compile time, and with what online DTR
cannot know: each value's next use. Starting from the graph that keeps every forward value
backward reads, it simulates the step's memory (every value freed after its last use), and while
the peak is over the threshold it evicts, among the forward values alive at the peak, the one
with the lowest

    score = recompute_cost ** recomp_time_factor / (bytes ** recomp_memory_factor * idle)

(`idle`: how many ops lie between its last forward use and its first backward use). An eviction
that does not lower the peak is undone. Evicted values are recomputed by `rematerialize`'s
rewriter (the same pure ops on the same inputs, so results are bit for bit eager's); random ops,
in-place writes and values that outlive the call are never evicted.

Before (peak over the threshold):             After (t6 evicted):
    t6 = aten.relu.default(t5)                    t6 = aten.relu.default(t5)
    ...                                           ...            # t6 dies after its forward use
    t26 = aten.threshold_backward(t16, t6, 0)     t90 = aten.relu.default(t5)
                                                  t26 = aten.threshold_backward(t16, t90, 0)
"""

from __future__ import annotations

import math

from ..ir.graph import INPUT_OPS, Graph, Node, Op, RecomputePlan
from .analysis import observable_roots
from .plan_memory import storage_lifetimes
from .rematerialize import Candidates, find_candidates, recompute_all_but, value_bytes

MATMULS = frozenset({"mm", "bmm", "addmm", "baddbmm", "_addmm_activation", "addbmm"})
CONVOLUTIONS = frozenset({"convolution", "_convolution", "mkldnn_convolution", "conv2d", "conv1d", "conv3d"})


def plan_recomputation(graph: Graph, threshold: int, min_bytes: int = 1 << 20, memory_factor: float = 1.0,
                       time_factor: float = 1.0, batch_norm: bool = True) -> Graph:
    candidates = find_candidates(graph, min_bytes, batch_norm)
    if candidates is None:
        return graph
    peak_before, at, area = _memory_profile(graph)
    kept = set(candidates.saved_roots)
    current, peak = graph, peak_before
    refused: set[int] = set()
    idle = _idle_spans(candidates)
    while peak > threshold:
        alive = storage_lifetimes(current)
        choices = [r for r in kept - refused if alive.get(r, (1, 0))[0] <= at <= alive.get(r, (1, 0))[1]]
        if not choices:
            break
        costs = {r: _recompute_flops(candidates, r, kept) for r in choices}
        root = min(choices, key=lambda r: (_log_score(costs[r], _root_bytes(candidates, r), idle.get(r, 1),
                                                      time_factor, memory_factor), r))
        trial = recompute_all_but(candidates, kept - {root})
        trial_peak, trial_at, trial_area = _memory_profile(trial)
        # the peak is often a plateau (the end of forward and the start of backward hold the same
        # values): an eviction that shortens a value's life without lowering the peak yet is progress
        if (trial_peak, trial_area) >= (peak, area):
            refused.add(root)  # recomputing it holds as much memory as keeping it
            continue
        kept.discard(root)
        current, peak, at, area = trial, trial_peak, trial_at, trial_area
    added = [n for n in current.nodes if any(v is not None and v >= len(graph.values) for v in n.outputs)]
    plan = RecomputePlan(
        threshold=threshold, peak_before=peak_before, peak=peak,
        evicted=len(candidates.saved_roots) - len(kept), recomputed_ops=len(added),
        extra_flops=sum(node_flops(current, n) for n in added),
        step_flops=sum(node_flops(graph, n) for n in graph.nodes if n.op is Op.CALL))
    return current.with_nodes(current.nodes, "plan_recomputation", recompute_plan=plan)


def planned_peak(graph: Graph) -> int:
    """The most memory (bytes) the call's own tensors hold at once when each is freed right after
    its last use (what the memory plan's arena approaches); returned and escaping tensors live to
    the end, inputs and external tensors are not counted."""
    return _memory_profile(graph)[0]


def _memory_profile(graph: Graph) -> tuple[int, int, int]:
    """(peak bytes, the node index where it is first reached, bytes x nodes held over the call)."""
    end = len(graph.nodes)
    sizes = {}
    for node in graph.nodes:
        if node.op in INPUT_OPS:
            continue
        for vid in node.outputs:
            value = graph.values[vid] if vid is not None else None
            if value is not None and value.root == value.handle and value.version == 0:
                sizes[value.handle] = value_bytes(value)
    outliving = observable_roots(graph)
    change = [0] * (end + 1)
    for root, (first, last) in storage_lifetimes(graph).items():
        if root in sizes:
            change[first] += sizes[root]
            change[(end - 1 if root in outliving else last) + 1] -= sizes[root]
    peak, at, running, area = 0, 0, 0, 0
    for index in range(end):
        running += change[index]
        area += running
        if running > peak:
            peak, at = running, index
    return peak, at, area


def node_flops(graph: Graph, node: Node) -> int:
    """A rough cost: multiply-adds of matmuls and convolutions, one per output element otherwise."""
    if node.op is not Op.CALL or not node.outputs or node.outputs[0] is None:
        return 0
    out = _numel(graph.values[node.outputs[0]].meta.shape)
    name = node.target._schema.name.split("::")[-1] if hasattr(node.target, "_schema") else ""
    shapes = [graph.values[v].meta.shape for v in node.inputs]
    if name in MATMULS:
        left = shapes[1] if name.startswith(("addmm", "baddbmm", "_addmm", "addbmm")) else shapes[0]
        return 2 * out * (left[-1] if left else 1)
    if name in CONVOLUTIONS and len(shapes) > 1 and shapes[1]:
        weight = shapes[1]
        return 2 * out * _numel(weight) // max(weight[0], 1)
    if name == "convolution_backward" and len(shapes) > 2 and shapes[2]:
        weight = shapes[2]  # the gradients of the input and of the weight: twice the forward
        return 4 * _numel(shapes[0]) * _numel(weight) // max(weight[0], 1)
    return out


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def _root_bytes(candidates: Candidates, root: int) -> int:
    graph = candidates.graph
    return max(1, next(value_bytes(v) for v in graph.values if v.handle == root and v.version == 0))


def _recompute_flops(candidates: Candidates, root: int, kept: set[int]) -> int:
    """What recomputing `root` runs: its producer and every evicted forward value it needs."""
    graph, producer = candidates.graph, candidates.producer
    base = next(v.id for v in graph.values if v.handle == root and v.version == 0)
    seen, stack, total = set(), [base], 0
    while stack:
        vid = stack.pop()
        if vid in seen or vid not in candidates.recomputable:
            continue
        if vid != base and graph.values[vid].root in kept:
            continue
        seen.add(vid)
        _, node = producer[vid]
        total += node_flops(graph, node)
        stack.extend(node.inputs)
    return max(total, 1)


def _log_score(cost: float, size: int, idle: int, time_factor: float, memory_factor: float) -> float:
    """log(cost ** time_factor / (size ** memory_factor * idle)): the same order as the score
    itself, which overflows a float for large factors (recomp_time_factor=1000)."""
    def weighted(value: float, factor: float) -> float:
        return 0.0 if factor == 0 else factor * (math.log(value) if value > 0 else -math.inf)

    return weighted(cost, time_factor) - weighted(size, memory_factor) - math.log(idle)


def _idle_spans(candidates: Candidates) -> dict[int, int]:
    """root -> ops between its last forward use and its first backward use."""
    last_forward: dict[int, int] = {}
    first_backward: dict[int, int] = {}
    graph = candidates.graph
    for index, node in enumerate(candidates.nodes):
        for vid in (*node.inputs, *(v for v in node.outputs if v is not None)):
            root = graph.values[vid].root
            if index < candidates.first_backward:
                last_forward[root] = index
            else:
                first_backward.setdefault(root, index)
    return {r: max(1, first_backward.get(r, r) - last_forward.get(r, 0)) for r in candidates.saved_roots}

