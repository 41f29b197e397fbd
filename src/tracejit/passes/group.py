"""group_elementwise: chains of elementwise ops become fused kernel nodes.

Before:                                        After:
    t5 = aten.mul.Tensor(t0, t1)                   t7 = fused0_mul_add_sigmoid(t0, t1)
    t6 = aten.add.Tensor(t5, 1)                      # t5 = aten.mul.Tensor(t0, t1)
    t7 = aten.sigmoid.default(t6)                    # t6 = aten.add.Tensor(t5, 1)
                                                     # t7 = aten.sigmoid.default(t6)

A FUSED node keeps its member CALL nodes, reads the values its members read from outside the
group, writes what its in-place members write, and produces the member values something outside
still needs (later ops, the return value, Python state, host reads). Which ops may join is the
backend's decision (`can_fuse`); a node joins a group that produced one of its inputs or that reads
one of its inputs (siblings share the loads), when both walk the same iteration space (`space_of`:
the shape, or one shape per list element for `_foreach_` ops).

When a group is *legal* is decided here (`legal_group`), from one rule: a group runs when its last
member's position is reached, so nothing outside it may need a member's value, or write a
member's input, between its first and last member; nor may an op that checks values and raises
come after a member's write the caller sees (eager made that write before it raised). Groups never cross a host read or an excluded
block, and in host-visible graphs nothing outside may even read a group input inside the span
(holding it would change what autograd dispatches). A group that writes a storage it reads reads
it only through the written tensor itself (one element, one index: no overlap hazard); inputs
that overlap in memory are views of one base in the record, so this covers `f(a, a.t())` too. A
`_foreach_` op joins only if no other lane touches a storage one of its lanes writes (a kernel
runs lane by lane, eager op by op).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..ir.fused_group import FusedGroup
from ..ir.graph import INPUT_OPS, Graph, Node, Op
from ..record.calls import rebuild_call
from .analysis import versions_of

CanFuse = Callable[[Graph, Node], bool]
MAX_MEMBERS = 48


def group_elementwise(graph: Graph, can_fuse: CanFuse | None = None, max_members: int = MAX_MEMBERS,
                      min_members: int = 2, fuel: int | None = None, alone: CanFuse | None = None) -> Graph:
    """`fuel` bounds how many groups are formed (bisecting a suspected miscompile); a group of one
    op is a kernel only when `alone` says the op is worth one (graph_opt_config)."""
    if can_fuse is None:
        return graph
    grouping = _Grouping(graph, max_members)
    for index, node in enumerate(grouping.nodes):
        if _candidate(node) and _lanes_are_exclusive(graph, [node]) and can_fuse(graph, node):
            grouping.add(index, node)
    fused = [g for g in grouping.groups if len(g) >= min_members
             or (len(g) == 1 and alone is not None and alone(graph, grouping.nodes[g[0]]))]
    if fuel is not None:
        fused = fused[:max(fuel, 0)]
    if not fused:
        return graph
    return _rewrite(graph, grouping.nodes, fused)


class _Grouping:
    """Groups formed so far, and which group computes or reads each value."""

    def __init__(self, graph: Graph, max_members: int):
        self.graph = graph
        self.nodes = list(graph.nodes)
        self.max_members = max_members
        self.groups: list[list[int]] = []
        self.spaces: list[tuple] = []
        self.producer: dict[int, int] = {}  # value id -> group that computes it
        self.readers: dict[int, set[int]] = {}  # value id -> groups reading it from outside
        self.index_of = {id(n): i for i, n in enumerate(self.nodes)}

    def add(self, index: int, node: Node) -> None:
        space = space_of(self.graph, node)
        candidates = self._candidates(node, space)
        target = next((g for g in candidates if self._legal(self.groups[g] + [index])), None)
        if target is None:
            self.groups.append([])
            self.spaces.append(space)
            target = len(self.groups) - 1
        self.groups[target].append(index)
        for vid in (*node.outputs, *node.writes):
            if vid is not None:
                self.producer[vid] = target
        for vid in node.inputs:
            if self.producer.get(vid) != target:
                self.readers.setdefault(vid, set()).add(target)
        for other in candidates:  # a node joining two groups lets them run as one (Adam's moments)
            if other != target and self._legal(self.groups[target] + self.groups[other]):
                self._merge(other, target)

    def _candidates(self, node: Node, space: tuple) -> list[int]:
        feeding = [self.producer[v] for v in node.inputs if v in self.producer]
        sharing = [g for v in node.inputs if v not in self.producer for g in self.readers.get(v, ())]
        ordered = dict.fromkeys(sorted(feeding, reverse=True) + sorted(sharing, reverse=True))
        return [g for g in ordered if self.spaces[g] == space and self.groups[g]]

    def _legal(self, members: list[int]) -> bool:
        return len(members) <= self.max_members and legal_group(
            self.graph, [self.nodes[i] for i in sorted(members)], self.nodes, self.index_of)

    def _merge(self, source: int, target: int) -> None:
        self.groups[target] = sorted(self.groups[target] + self.groups[source])
        self.groups[source] = []
        for vid, group in self.producer.items():
            if group == source:
                self.producer[vid] = target
        for groups in self.readers.values():
            if source in groups:
                groups.discard(source)
                groups.add(target)
        for vid, group in self.producer.items():  # a value both produced and read inside the group
            if group == target:
                self.readers.get(vid, set()).discard(target)


def _candidate(node: Node) -> bool:
    target = node.target
    return (
        node.op is Op.CALL
        and not node.hoisted
        and node.out_kind in ("tensor", "none", "list")
        and isinstance(target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded not in target.tags
    )


def space_of(graph: Graph, node: Node) -> tuple:
    """The shapes a member computes: its result, or the target it writes; one per list element."""
    results = [v for v in node.outputs if v is not None]
    if not results and node.writes:
        written = {graph.values[v].handle for v in node.inputs}
        results = [v for v in node.writes if graph.values[v].handle in written]
        seen, unique = set(), []
        for v in results:  # one per written handle, not per alias
            if graph.values[v].handle not in seen:
                seen.add(graph.values[v].handle)
                unique.append(v)
        results = unique
    return tuple(graph.values[v].meta.shape for v in results)


def legal_group(graph: Graph, members: list[Node], nodes: list[Node] | None = None,
                index_of: dict[int, int] | None = None) -> bool:
    """Whether `members` may run as one node in place of its last member.

    The span is measured in node order, which is the execution order (a rematerialized node
    shares the record position of the op it serves, so positions alone do not order nodes).
    Excluded blocks (arbitrary host code) and host reads of a value the group computes end a
    group; a host read of anything else does not (Adam reads `step` between its two updates,
    and the scalars it computes from it are bound when the group runs)."""
    nodes = list(graph.nodes) if nodes is None else nodes
    index_of = {id(n): i for i, n in enumerate(nodes)} if index_of is None else index_of
    first, last = min(m.fire_at for m in members), max(m.fire_at for m in members)
    if any(first < p <= last for p in graph.barriers):  # the block runs before op p
        return False
    produced = {v for m in members for v in (*m.outputs, *m.writes) if v is not None}
    produced_handles = {graph.values[v].handle for v in produced}
    if any(first < p <= last and handle in produced_handles for p, handle in graph.reads):
        return False
    start, end = min(index_of[id(m)] for m in members), max(index_of[id(m)] for m in members)
    member_ids = {id(m) for m in members}
    read = {v for m in members for v in m.inputs} - produced
    read_roots = {graph.values[v].root for v in read}
    if not _writes_are_exclusive(graph, members, read) or not _lanes_are_exclusive(graph, members):
        return False
    # eager has made a write the caller sees (an input, a parameter, state that outlives the call)
    # when a later op raises on its values (an index out of range): the group must not hold such a
    # write back past that op, or the caller would find it missing after the error
    seen_write = next((i for i in range(start, end) if id(nodes[i]) in member_ids and nodes[i].writes
                       and _writes_visible_memory(graph, nodes[i])), end)
    for index in range(start + 1, end):
        node = nodes[index]
        if id(node) in member_ids or not node.positions:
            continue
        if index > seen_write and _raises_on_values(node):
            return False
        if any(v in produced for v in node.inputs):
            return False  # needs a member's value before the group runs
        if any(graph.values[v].root in read_roots for v in node.writes):
            return False  # changes a member's input before the group reads it
        if graph.host_visible and any(v in read for v in node.inputs):
            return False  # the program would hold the input while the host uses it
    return True


# aten ops that check their tensors' values and raise (indices in range, probabilities, targets)
_VALUE_CHECKED = frozenset({
    "gather", "scatter", "scatter_add", "scatter_reduce", "index", "index_put", "_index_put_impl", "index_select",
    "index_add", "index_copy", "index_fill", "index_reduce", "take", "put", "embedding", "embedding_bag",
    "_embedding_bag", "embedding_dense_backward", "nll_loss_forward", "nll_loss2d_forward", "nll_loss_backward",
    "nll_loss2d_backward", "multi_margin_loss", "multilabel_margin_loss_forward", "binary_cross_entropy",
    "multinomial", "bincount", "one_hot", "repeat_interleave", "searchsorted", "bucketize", "histc",
    "masked_scatter", "_assert_async", "_assert_scalar", "_linalg_check_errors", "bernoulli", "normal",
    "max_unpool2d", "max_unpool3d", "ctc_loss", "_ctc_loss", "poisson", "binomial", "_sample_dirichlet",
})
# and on integers, a zero divisor
_INTEGER_DIVISIONS = frozenset({"div", "floor_divide", "remainder", "fmod", "div_", "floor_divide_", "remainder_", "fmod_"})


def _raises_on_values(node: Node) -> bool:
    for member in node.members if node.op is Op.FUSED else (node,):
        target = member.target
        if not isinstance(target, torch._ops.OpOverload):
            continue
        name = target._overloadpacket.__name__
        if name in _VALUE_CHECKED or (name in _INTEGER_DIVISIONS and any(
                not meta.dtype.is_floating_point and not meta.dtype.is_complex and meta.dtype is not torch.bool
                for meta in member.input_metas)):
            return True
    return False


def _writes_visible_memory(graph: Graph, node: Node) -> bool:
    """Whether `node` writes memory that is not the call's own: an input's, an external's (a
    parameter, a buffer, optimizer state), or a value that outlives the call."""
    roots = {graph.values[v].root for v in node.writes}
    return bool(roots & _visible_roots(graph))


_visible_cache: dict[int, tuple[weakref.ref, frozenset]] = {}  # legal_group runs for every candidate group


def _visible_roots(graph: Graph) -> frozenset:
    cached = _visible_cache.get(id(graph))
    if cached is None or cached[0]() is not graph:
        handles = {graph.values[v].handle for n in graph.nodes if n.op in INPUT_OPS for v in n.outputs if v is not None}
        cached = _visible_cache[id(graph)] = (weakref.ref(graph), frozenset(handles | set(graph.escaped)))
        if len(_visible_cache) > 64:  # graphs of finished compilations
            _visible_cache.pop(next(iter(_visible_cache)))
    return cached[1]


def _writes_are_exclusive(graph: Graph, members: list[Node], read: set[int]) -> bool:
    """A storage the group writes is read, from outside, only through the one tensor written."""
    written: dict[int, int] = {}  # root -> handle written through
    for member in members:
        handles_read = {graph.values[v].handle for v in member.inputs}
        targets = [v for v in member.writes if graph.values[v].handle in handles_read]
        if member.writes and not targets:
            return False  # writes a tensor it was not handed (an out= argument, an alias)
        for vid in targets:
            value = graph.values[vid]
            if written.setdefault(value.root, value.handle) != value.handle:
                return False
    for vid in read:
        value = graph.values[vid]
        if value.root in written and value.handle != written[value.root]:
            return False
    # other views of a written storage get new versions too; no member may read one of them
    aliases = {v for m in members for v in m.writes if graph.values[v].handle != written.get(graph.values[v].root)}
    return not any(v in aliases for m in members for v in m.inputs)


def _lanes_are_exclusive(graph: Graph, members: list[Node]) -> bool:
    """A storage a lane of a `_foreach_` member writes is touched by no other lane of the group.

    Eager runs a `_foreach_` op over every list element before the next op starts; a multi-tensor
    kernel runs all its members lane by lane (and lanes in parallel). That is the same only when
    the lanes are independent: `_foreach_mul_([a, a], 2)` writes one tensor in two lanes, and
    `_foreach_add_([a, b], [b, a])` writes in lane 0 what lane 1 reads."""
    lanes_of_root: dict[int, set[int]] = {}  # root -> lanes touching it (EVERY_LANE: a shared argument)
    written: dict[int, set[int]] = {}  # root -> lanes writing it
    for member in members:
        per_lane = _lane_values(member)
        if per_lane is None:
            continue
        writes = {graph.values[v].handle for v in member.writes}
        for lane, vids in per_lane.items():
            for vid in vids:
                root = graph.values[vid].root
                lanes_of_root.setdefault(root, set()).add(lane)
                if lane != _EVERY_LANE and vid == vids[0] and graph.values[vid].handle in writes:
                    written.setdefault(root, set()).add(lane)
    return all(len(lanes) == 1 and lanes_of_root[root] == lanes for root, lanes in written.items())


_EVERY_LANE = -1


class _Slot:
    """Stands for one tensor of a call while its argument structure is rebuilt."""

    __slots__ = ("value",)

    def __init__(self, value: int):
        self.value = value


def _lane_values(node: Node) -> dict[int, list[int]] | None:
    """For a `_foreach_` op of more than one list element: lane -> the value ids it reads, its written
    target (the first list's element) first; tensors outside the lists under _EVERY_LANE. None for
    other ops (one lane: nothing runs beside it)."""
    if not str(node.target).startswith("aten._foreach_"):
        return None
    args, kwargs = rebuild_call(node.statics, [_Slot(v) for v in node.inputs], [None] * len(node.scalars))
    arguments = [*args, *kwargs.values()]
    lists = [a for a in arguments if isinstance(a, list)]
    if not lists or len(lists[0]) < 2:
        return None
    per_lane: dict[int, list[int]] = {}
    for argument in arguments:
        items = enumerate(argument) if isinstance(argument, list) else [(_EVERY_LANE, argument)]
        for lane, item in items:
            if isinstance(item, _Slot):
                per_lane.setdefault(lane, []).append(item.value)
    return per_lane


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
    producer_group = {v: member_of[i] for i, n in enumerate(nodes) if i in member_of
                      for v in (*n.outputs, *n.writes) if v is not None}
    for index, node in enumerate(nodes):
        for vid in node.inputs:
            group = producer_group.get(vid)
            if group is not None and member_of.get(index) != group:
                needed.add(vid)
    return needed


def _fused_node(graph: Graph, number: int, members: list[Node], needed: set[int]) -> Node:
    produced = [v for m in members for v in (*m.outputs, *m.writes) if v is not None]
    inputs = list(dict.fromkeys(v for m in members for v in m.inputs if v not in produced))
    final = _final_versions(graph, produced)
    # A write is a value of its own only for the tensor the op was handed; other views of the
    # storage see the new contents through the objects they already are.
    handed = {graph.values[v].handle for m in members for v in m.inputs}
    own = {v for v in produced if v not in _writes_of(members) or graph.values[v].handle in handed}
    # the last member's values are always computed: checked replay hands them to the host
    wanted = set(needed) | {v for v in members[-1].outputs if v is not None}
    outputs = tuple(v for v in dict.fromkeys(produced) if v in wanted and v in final and v in own)
    ops = "_".join(str(m.target).split(".")[1].removeprefix("_foreach_") for m in members[:4])
    name = f"fused{number}_{ops}" + ("_etc" if len(members) > 4 else "")
    space = space_of(graph, members[0])
    positions = tuple(sorted(p for m in members for p in m.positions))
    writes = tuple(v for m in members for v in m.writes)
    return Node(Op.FUSED, FusedGroup(name, space[0] if space else (), len(space)), tuple(inputs), outputs,
                writes=writes, positions=positions, source=members[-1].source, members=tuple(members))


def _final_versions(graph: Graph, produced: list[int]) -> set[int]:
    """Of the values the group produces, the last version of each handle (what storage holds after)."""
    last: dict[int, int] = {}
    for vid in produced:
        last[graph.values[vid].handle] = vid
    return set(last.values())


def _writes_of(members: list[Node]) -> set[int]:
    return {v for m in members for v in m.writes}
