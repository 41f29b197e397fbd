"""The executable form of a record and the interface replay drives it through.

A `Program` is a list of nodes over an *environment*: a list of tensors indexed by handle.
Each node covers one or more recorded ops and *fires* at the position of the last of them, so a
checked replay that reaches position p can hand the host every value produced up to p. This
module holds the simplest program, one aten call per recorded op; the compiler builds programs
with fused nodes behind the same interface.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..record.calls import rebuild_call
from ..record.record import Flag, OpRecord, Record


class Node(Protocol):
    fire_at: int  # record position of the node's last op
    positions: tuple[int, ...]  # record positions the node covers

    def run(self, env: list, scalars: list) -> Any:
        """Compute the node's outputs into `env`; return the raw result of the op at `fire_at`."""


class AtenNode:
    """One recorded op, executed through its aten overload."""

    __slots__ = ("op", "fire_at", "positions", "scalar_start", "scalar_stop")

    def __init__(self, op: OpRecord, scalar_start: int):
        self.op = op
        self.fire_at = op.index
        self.positions = (op.index,)
        self.scalar_start = scalar_start
        self.scalar_stop = scalar_start + len(op.scalars)

    def run(self, env: list, scalars: list) -> Any:
        op = self.op
        args, kwargs = rebuild_call(op.statics, [env[h] for h in op.inputs],
                                    scalars[self.scalar_start:self.scalar_stop])
        result = op.op(*args, **kwargs)
        store_outputs(op, result, env)
        return result


def store_outputs(op: OpRecord, result: Any, env: list) -> None:
    if op.out_kind == "tensor":
        env[op.outputs[0]] = result
    elif op.out_kind in ("tuple", "list"):
        for handle, value in zip(op.outputs, result):
            if handle is not None:
                env[handle] = value


class Program:
    def __init__(self, record: Record, nodes: list[Node]):
        self.record = record
        self.nodes = nodes
        self.node_at: list[Node | None] = [None] * len(record.ops)
        for node in nodes:
            self.node_at[node.fire_at] = node
        self.initial_scalars: list = [s for op in record.ops for s in op.scalars]
        self.scalar_offsets: list[int] = []
        offset = 0
        for op in record.ops:
            self.scalar_offsets.append(offset)
            offset += len(op.scalars)
        self.release_after = _release_points(record)
        self.touched = [tuple({*op.inputs, *(h for h in op.outputs if h is not None)}) for op in record.ops]

    def new_env(self) -> list:
        return [None] * len(self.record.tensors)

    def fire(self, position: int, env: list, scalars: list) -> Any:
        """Run the node that completes at `position`; return the recorded op's result."""
        return self.node_at[position].run(env, scalars)

    def release_checked(self, position: int, env: list) -> None:
        """In checked replay, drop the references the program no longer needs after `position`.

        The host hands every input back when it uses it again, and autograd's behaviour depends
        on reference counts (a gradient nobody else holds is stolen rather than copied), so the
        program keeps nothing it does not need itself.
        """
        for handle in self.touched[position]:
            env[handle] = None

    def materialize(self, env: list, handle: int) -> torch.Tensor | None:
        """Make the value of `handle` real; every value of a one-op-per-node program already is."""
        return env[handle]

    def complete(self, env: list) -> None:
        """Make every value computed so far real (before host code or the caller can see it)."""

    def run_all(self, env: list, scalars: list) -> None:
        for node in self.nodes:
            node.run(env, scalars)


def build_program(record: Record) -> Program:
    """opt_level 0: execute the record as recorded, one aten call per op."""
    nodes, offset = [], 0
    for op in record.ops:
        nodes.append(AtenNode(op, offset))
        offset += len(op.scalars)
    return Program(record, nodes)


def _release_points(record: Record) -> list[list[int]]:
    """For each position, the handles the program no longer needs once it has run."""
    last_use: dict[int, int] = {}
    for op in record.ops:
        for handle in op.inputs:
            last_use[handle] = op.index
        for handle in op.outputs:
            if handle is not None:
                last_use.setdefault(handle, op.index)
    keep = Flag.ESCAPED | Flag.RETURNED
    release: list[list[int]] = [[] for _ in record.ops]
    for handle, position in last_use.items():
        if not record.tensors[handle].flags & keep:
            release[position].append(handle)
    return release
