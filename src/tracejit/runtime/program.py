"""Executable forms of a graph.

`CheckedProgram` serves checked replay over a host-visible graph: the host runs the function
and hands over each op's arguments at its recorded position; the program decides what runs
there. A plain node runs right away on the arguments the host passed, through the fastest
verified callable. The members of a fused group before its last one return *placeholders*
(tensors of the right shape whose contents are not computed yet) and the group runs when its
last member arrives, filling the placeholders of every value something still needs. A value
the host reads that is still a placeholder is computed on demand.

`HostFreeProgram` runs a host-free graph as generated straight-line Python (see codegen.py):
the path of `without_host=True` and of loaded graphs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from ..ir.graph import Graph, Node, Op
from ..record.calls import has_dynamic_output_shape
from ..record.record import Record
from .codegen import callable_for, generate_straight_line
from .fastpath import generate_steps
from .fused import ReferenceKernel
from .profile import CLOCK, Profiler, Row


def scalar_layout(record: Record) -> tuple[list[int], list]:
    """Offset of each op's dynamic scalars in the flat scalar list, and the recorded values."""
    offsets, values = [], []
    for op in record.ops:
        offsets.append(len(values))
        values.extend(op.scalars)
    return offsets, values


class CallState:
    """What one checked call holds: values by handle, and which placeholders are real."""

    __slots__ = ("env", "pending")

    def __init__(self, num_handles: int):
        self.env: list = [None] * num_handles
        self.pending: dict[int, _GroupRun] = {}  # handle of an unfilled placeholder -> its group


class _GroupRun:
    """A fused node in checked replay: placeholders for its members, the kernel at its end."""

    def __init__(self, graph: Graph, node: Node, kernel: Any):
        self.node = node
        self.kernel = kernel
        self.reference = kernel if isinstance(kernel, ReferenceKernel) else ReferenceKernel(graph, node)
        self.last = node.fire_at
        self.member_at = {m.positions[0]: m for m in node.members}
        self.handle_of = {v: graph.values[v].handle for m in node.members for v in (*m.inputs, *m.outputs)}
        self.inputs = set(node.inputs)
        self.metas = {m.outputs[0]: graph.values[m.outputs[0]].meta for m in node.members}

    def step(self, position: int, tensors: list[torch.Tensor], state: CallState, scalars: list) -> torch.Tensor:
        member = self.member_at[position]
        env = state.env
        for tensor, vid in zip(tensors, member.inputs):
            if vid in self.inputs:
                env[self.handle_of[vid]] = tensor
        if position != self.last:
            meta = self.metas[member.outputs[0]]
            placeholder = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=meta.device)
            handle = self.handle_of[member.outputs[0]]
            env[handle] = placeholder
            state.pending[handle] = self
            return placeholder
        inputs = [env[self.handle_of[v]] for v in self.node.inputs]
        outs = [env[self.handle_of[v]] if self.handle_of[v] in state.pending else None for v in self.node.outputs]
        results = self.kernel(inputs, scalars, outs)
        for vid, result in zip(self.node.outputs, results):
            handle = self.handle_of[vid]
            env[handle] = result
            state.pending.pop(handle, None)
        return env[self.handle_of[member.outputs[0]]]

    def materialize(self, handle: int, state: CallState, scalars: list) -> None:
        """Compute one placeholder now: the host reads it before (or without) the group filling it."""
        env = state.env
        vid = next(v for v, h in self.handle_of.items() if h == handle and v in self.metas)
        inputs = [env[self.handle_of[v]] for v in self.node.inputs]
        env[handle].copy_(self.reference.partial(inputs, scalars, vid))
        del state.pending[handle]


class CheckedProgram:
    def __init__(self, record: Record, graph: Graph, profiler: Profiler | None = None,
                 kernels: dict[int, Any] | None = None):
        self.record = record
        self.graph = graph
        self.profiler = profiler
        self.scalar_offsets, self.initial_scalars = scalar_layout(record)
        self.callables: list[Callable | None] = [None] * len(record.ops)
        self.group_at: list[_GroupRun | None] = [None] * len(record.ops)
        for index, node in enumerate(graph.nodes):
            if node.op is Op.CALL:
                self.callables[node.positions[0]] = callable_for(node)
            elif node.op is Op.FUSED:
                group = _GroupRun(graph, node, kernels[index])
                for position in node.positions:
                    self.group_at[position] = group
        # Fused members and data-dependent output shapes take the generic path.
        fast = [self.callables[op.index] is not None and not has_dynamic_output_shape(op.op) for op in record.ops]
        self.profile_rows = None
        if profiler is not None:
            self.profile_rows = [profiler.add_row(Row(op.name, (op.name,), (str(op.source),), "checked replay"))
                                 for op in record.ops]
        self.steps = generate_steps(record, self.callables, fast, self.profile_rows, profiler)

    def new_state(self) -> CallState:
        return CallState(len(self.record.tensors))

    def execute(self, position: int, args: tuple, kwargs: dict, tensors: list[torch.Tensor], state: CallState,
                scalars: list) -> Any:
        """Run what the graph does at `position`; return the recorded op's result."""
        group = self.group_at[position]
        start = CLOCK() if self.profiler is not None else 0.0
        if group is None:
            result = self.callables[position](*args, **kwargs)
        else:
            result = group.step(position, tensors, state, scalars)
        if self.profiler is not None:
            self.profiler.stop(self.profile_rows[position], start)
        return result

    def materialize(self, state: CallState, handle: int, scalars: list) -> None:
        """Make the value of `handle` real before the host reads it."""
        group = state.pending.get(handle)
        if group is not None:
            group.materialize(handle, state, scalars)

    def complete(self, state: CallState, scalars: list) -> None:
        """Make every placeholder handed out so far real (the host may look at any of them)."""
        for handle in list(state.pending):
            self.materialize(state, handle, scalars)

    def finish(self, state: CallState, scalars: list) -> None:
        """At the end of a call, make real the placeholders something outside still references
        (a value the record did not see escape); the others are garbage nobody can read."""
        for handle in list(state.pending):
            # references: the state's list and getrefcount's own argument
            if sys.getrefcount(state.env[handle]) > 2:
                self.materialize(state, handle, scalars)


class HostFreeProgram:
    def __init__(self, graph: Graph, profiler: Profiler | None = None, kernels: dict[int, Any] | None = None):
        self.graph = graph
        generated = generate_straight_line(graph, profiler, kernels or {})
        self.source = generated.source
        self.run = generated.run  # run(env, scalars)
        self.init = generated.init  # init(env): computes the hoisted values
        self.hoisted = generated.hoisted
        self.arena = generated.arena

    @property
    def hoisted_roots(self) -> set[int]:
        """Handles of the externals whose storage the hoisted views point into."""
        return {self.graph.values[v].root for v in range(len(self.graph.values))
                if self.graph.values[v].handle in self.hoisted}
