"""Executable forms of a graph.

`CheckedProgram` serves checked replay over a host-visible graph: the host runs the function
and hands over each op's arguments at its recorded position; the program decides what runs
there. A plain node runs right away on the arguments the host passed (they are the graph's
values: every value the host sees is real), through the fastest verified callable; the members
of a fused group before its last op return placeholders, and the group runs when its last
member arrives.

`HostFreeProgram` runs a host-free graph as generated straight-line Python (see codegen.py):
the path of `without_host=True` and of loaded graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..ir.graph import Graph, Op
from ..record.record import Record
from ..record.calls import has_dynamic_output_shape
from .codegen import callable_for, generate_straight_line
from .fastpath import generate_steps
from .profile import CLOCK, Profiler, Row


def scalar_layout(record: Record) -> tuple[list[int], list]:
    """Offset of each op's dynamic scalars in the flat scalar list, and the recorded values."""
    offsets, values = [], []
    for op in record.ops:
        offsets.append(len(values))
        values.extend(op.scalars)
    return offsets, values


class CheckedProgram:
    def __init__(self, record: Record, graph: Graph, profiler: Profiler | None = None):
        self.record = record
        self.graph = graph
        self.profiler = profiler
        self.scalar_offsets, self.initial_scalars = scalar_layout(record)
        self.callables: list[Callable | None] = [None] * len(record.ops)
        for node in graph.nodes:
            if node.op is Op.CALL:
                self.callables[node.positions[0]] = callable_for(node)
        # Data-dependent output shapes are checked on the generic path.
        fast = [self.callables[op.index] is not None and not has_dynamic_output_shape(op.op) for op in record.ops]
        self.profile_rows = None
        if profiler is not None:
            self.profile_rows = [profiler.add_row(Row(op.name, (op.name,), (str(op.source),), "checked replay"))
                                 for op in record.ops]
        self.steps = generate_steps(record, self.callables, fast, self.profile_rows, profiler)

    def new_env(self) -> list:
        return [None] * len(self.record.tensors)

    def execute(self, position: int, args: tuple, kwargs: dict, env: list, scalars: list) -> Any:
        """Run what the graph does at `position`; return the recorded op's result."""
        if self.profiler is None:
            return self.callables[position](*args, **kwargs)
        start = CLOCK()
        result = self.callables[position](*args, **kwargs)
        self.profiler.stop(self.profile_rows[position], start)
        return result

    def materialize(self, env: list, handle: int) -> torch.Tensor | None:
        """Make the value of `handle` real before the host reads it (plain nodes always are)."""
        return env[handle]

    def complete(self, env: list) -> None:
        """Make every value that outlives the call real."""


class HostFreeProgram:
    def __init__(self, graph: Graph, profiler: Profiler | None = None):
        self.graph = graph
        generated = generate_straight_line(graph, profiler)
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
