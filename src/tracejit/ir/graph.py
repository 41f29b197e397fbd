"""The graph IR: nodes over SSA values, built from a record.

A `Value` is one *version* of a record handle. Handles that share storage (views of one base)
share a version counter: an in-place write through any of them creates new versions of all of
them, so a read after the write depends on the writer. Nodes keep the record order, which is a
valid schedule; passes may drop nodes, merge them, or mark them as members of a fused group.
"""

from __future__ import annotations

import enum
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

from ..record.record import Kind, TensorMeta
from ..record.source import SourceLocation


class Op(enum.Enum):
    # graph inputs, one node per input handle
    ARG = "arg"
    KWARG = "kwarg"
    EXTERNAL = "external"
    CONST = "const"
    # one aten op of the record
    CALL = "call"
    # a group of elementwise ops run as one kernel (target: fused_group.FusedGroup; see passes/group.py)
    FUSED = "fused"


INPUT_OPS = frozenset({Op.ARG, Op.KWARG, Op.EXTERNAL, Op.CONST})
INPUT_OP_OF_KIND = {Kind.ARG: Op.ARG, Kind.KWARG: Op.KWARG, Kind.EXTERNAL: Op.EXTERNAL, Kind.CONST: Op.CONST}


@dataclass(frozen=True)
class Value:
    id: int
    handle: int  # the record handle this is a version of; the runtime keeps one slot per handle
    version: int  # version of the handle's storage (all views of one base count together)
    meta: TensorMeta
    root: int  # handle of the base whose storage this value lives in (itself if not a view)


@dataclass(frozen=True)
class Node:
    """One step of the graph: an op over values. The fields after `outputs` are given by keyword;
    those after `members` say what a node carries besides its values, each for some ops only (it
    keeps its default elsewhere)."""

    op: Op
    target: Any  # OpOverload for CALL, a FusedGroup for FUSED, None for inputs
    inputs: tuple[int, ...]  # value ids read
    outputs: tuple[int | None, ...]  # value ids produced; None where the op returned None
    _: KW_ONLY
    writes: tuple[int, ...] = ()  # value ids of new versions this node creates by writing in place
    positions: tuple[int, ...] = ()  # record positions it covers; a node fires at the last one
    source: SourceLocation | None = None
    members: tuple[Node, ...] = ()  # the CALL nodes a FUSED node replaces, in order
    # input nodes: the tensor's name (an argument, `model.fc.weight`, `folded aten.t.default`)
    input_name: str | None = None
    # CALL nodes, from the record (record/calls.py): the call's structure with the tensors and
    # dynamic scalars left out, the dynamic scalars' recorded values, what the op returned
    # ("tensor" | "tuple" | "list" | "none" | "value"), and the metas of the tensors it read
    statics: tuple = ()
    scalars: tuple = ()
    out_kind: str | None = None
    input_metas: tuple[TensorMeta, ...] = ()
    # index of this node's first scalar in the call's flat list of dynamic scalars
    scalar_base: int = 0
    # the autograd node running it ("ReluBackward0"); None: not part of backward
    backward_of: str | None = None
    # the grad mode a kernel that depends on it was recorded under (record/calls.py GRAD_MODE_KERNELS)
    grad_enabled: bool | None = None
    # hoist_external_views: computed once per binding, not on every call
    hoisted: bool = False
    # plan_memory: (offset, bytes) of its output in the persistent arena
    buffer: tuple[int, int] | None = None
    # plan_memory for a FUSED node (jit_fuse_dimshuffle): per output its (offset, bytes), or None
    buffers: tuple[tuple[int, int] | None, ...] = ()
    # make_views_static (jit_fuse_dimshuffle): a view of arena buffers, made once with the program
    static_view: bool = False

    @property
    def fire_at(self) -> int:
        return max(self.positions) if self.positions else -1

    @property
    def name(self) -> str:
        """What the node runs, for messages and listings: the aten op, the fused kernel, the input kind."""
        if self.op is Op.CALL:
            return str(self.target)
        if self.op is Op.FUSED:
            return getattr(self.target, "name", "fused")
        return self.op.value


@dataclass(frozen=True)
class RecomputePlan:
    """What `dtr_config`'s planning pass chose (passes/recompute_budget.py): bytes are the planned
    peak of the call's own tensors, freed after their last use; flops a rough count."""

    threshold: int
    peak_before: int
    peak: int
    evicted: int  # forward values recomputed instead of kept for backward
    recomputed_ops: int
    extra_flops: int
    step_flops: int

    def as_dict(self) -> dict[str, Any]:
        return {"eviction_threshold": self.threshold, "planned_peak_bytes_before": self.peak_before,
                "planned_peak_bytes": self.peak, "under_threshold": self.peak <= self.threshold,
                "evicted_values": self.evicted, "recomputed_ops": self.recomputed_ops,
                "extra_compute": self.extra_flops / self.step_flops if self.step_flops else 0.0}


@dataclass(frozen=True)
class Graph:
    """A static graph. `host_visible` graphs serve checked replay: the host sees every op's
    outputs at their recorded position, so passes must keep each of them a real, distinct tensor."""

    function_name: str
    values: tuple[Value, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[int, ...]  # value ids returned by the traced function (flattened)
    escaped: frozenset[int]  # handles whose final value outlives the call (Python state)
    host_visible: bool
    num_handles: int
    capture_as_const: bool = False
    provenance: str = "record"  # which pass produced this graph, and its time
    arena_bytes: int = 0  # size of the persistent buffer arena planned by plan_memory
    recompute_plan: RecomputePlan | None = None  # set by plan_recomputation (dtr_config)
    host_reads: frozenset[int] = frozenset()  # handles the host read (numpy, item, print...)
    reads: tuple[tuple[int, int], ...] = ()  # (position, handle) of each host read: before op `position`
    # handles a checked call's program leaves when it runs at a host read (runtime/early_finish.py):
    # in `escaped` too, for the passes; the epilogue leaves those not escaped otherwise nowhere
    read_exports: frozenset[int] = frozenset()
    # positions of excluded blocks (arbitrary host code runs there) and of collectives (other
    # processes meet there): nothing is fused across them
    barriers: tuple[int, ...] = ()
    # handle -> constant tensor (captured or folded); shared, never mutated by passes
    constants: dict[int, Any] = field(default_factory=dict, compare=False)
    # constants made anew by every call: the literals (`torch.tensor(data)`) the call writes or lets
    # outlive it (Record.fresh_literals). A program starts each call from a copy of the recorded value
    # (runtime/hostfree.py), so they are no invariant to hoist or fold.
    fresh: frozenset[int] = frozenset()
    # torch.inference_mode() when the call began, and the positions of the ops the recorded call ran
    # the other way (the function entered `with torch.inference_mode():`, or left it): the program runs
    # those so, and their results are inference tensors exactly where eager's are (runtime/codegen.py)
    inference_mode: bool = False
    inference_flipped: frozenset[int] = frozenset()

    def value(self, value_id: int) -> Value:
        return self.values[value_id]

    def producers(self) -> dict[int, Node]:
        """value id -> the node that produced it (its writer, for in-place versions)."""
        produced = {}
        for node in self.nodes:
            for vid in node.outputs:
                if vid is not None:
                    produced[vid] = node
            for vid in node.writes:
                produced[vid] = node
        return produced

    def users(self) -> dict[int, list[Node]]:
        """value id -> the nodes that read it, in order."""
        used: dict[int, list[Node]] = {}
        for node in self.nodes:
            for vid in node.inputs:
                used.setdefault(vid, []).append(node)
        return used

    def with_nodes(self, nodes, provenance: str, **changes: Any) -> Graph:
        return replace(self, nodes=tuple(nodes), provenance=provenance, **changes)

    def __str__(self) -> str:
        from .printer import format_graph

        return format_graph(self)
