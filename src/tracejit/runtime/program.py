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

from ..backends.reference import ReferenceKernel
from ..errors import TraceMismatchError
from ..ir.graph import Graph, Node, Op
from ..record.autocast_keys import outside_autocast
from ..record.calls import data_dependent_size, default_dtype_checks
from ..record.record import Record
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


class CallState:
    """What one checked call holds: values by handle, and which of them are not computed yet."""

    __slots__ = ("broken", "env", "fired", "pending", "stepped")

    def __init__(self, num_handles: int):
        self.env: list = [None] * num_handles
        self.pending: dict[int, _GroupRun] = {}  # handle whose contents its group has not computed yet
        self.stepped: dict[_GroupRun, int] = {}  # group -> members handed out so far
        self.fired: set[_GroupRun] = set()
        self.broken: set[_GroupRun] = set()  # groups that run op by op for the rest of the call


class _GroupRun:
    """A fused node in checked replay.

    Members before the last one hand the host what the op would return without computing it: a
    placeholder (a tensor of the right layout, contents pending), the tensor an in-place op
    returns, or None. The kernel runs when the last member arrives and fills every pending value.
    If the host reads a pending value earlier (an unrecorded `print`, say), the members handed out
    so far run for real, op by op, and so does the rest of the group in this call.
    """

    def __init__(self, graph: Graph, node: Node, kernel: Any, last_write: dict[int, int]):
        self.node = node
        self.kernel = kernel
        self.reference = kernel if isinstance(kernel, ReferenceKernel) else ReferenceKernel(graph, node)
        self.last = node.fire_at
        self.member_at = {m.positions[0]: k for k, m in enumerate(node.members)}
        self.handle_of = {v: graph.values[v].handle for m in node.members
                          for v in (*m.inputs, *m.writes, *(o for o in m.outputs if o is not None))}
        self.inputs = set(node.inputs)
        self.metas = {v: graph.values[v].meta for m in node.members for v in m.outputs if v is not None}
        self.output_handles = [self.handle_of[v] for v in node.outputs]
        # outputs the kernel creates (not storage from outside that it writes): the call state
        # lets go of them once handed out, see step()
        input_handles = {self.handle_of[v] for v in node.inputs}
        written = {self.handle_of[w] for m in node.members for w in m.writes}
        self.fresh_outputs = [h for h in self.output_handles if h not in input_handles and h not in written]
        # handle -> its last value in the group: what the tensor holds once the group has run
        self.final_of = {self.handle_of[v]: v for m in node.members
                         for v in (*(o for o in m.outputs if o is not None), *m.writes)}
        # what is real once the kernel ran: its outputs and the storage from outside it writes
        input_roots = {graph.values[v].root for v in node.inputs}
        self.real_after_run = set(self.output_handles) | {
            self.handle_of[w] for m in node.members for w in m.writes if graph.values[w].root in input_roots}
        self.recomputable = _recomputable(graph, node, last_write)
        self.graph = graph

    def step(self, position: int, args: tuple, kwargs: dict, tensors: list[torch.Tensor], state: CallState,
             scalars: list) -> Any:
        k = self.member_at[position]
        member = self.node.members[k]
        if self in state.broken:
            return self._run_member(k, args, kwargs)
        env = state.env
        for tensor, vid in zip(tensors, member.inputs):
            if vid in self.inputs:
                env[self.handle_of[vid]] = tensor
        state.stepped[self] = k + 1
        if position != self.last:
            return self._deferred(member, tensors, state)
        inputs = [env[self.handle_of[v]] for v in self.node.inputs]
        outs = [env[h] if h in state.pending else None for h in self.output_handles]
        results = self.kernel(inputs, scalars, outs)
        for handle, result in zip(self.output_handles, results):
            env[handle] = result
        for handle in self.real_after_run:
            if state.pending.get(handle) is self:
                del state.pending[handle]
        state.fired.add(self)
        result = self._result(member, tensors, env)
        # Nothing of the call state needs the kernel's outputs any more (they are real, and a
        # later recompute reads only inputs). Holding them would be an extra reference that eager
        # does not have: autograd's AccumulateGrad steals a gradient only when nobody else holds
        # it, and copies it otherwise (new_empty_strided + copy_ instead of the recorded detach).
        for handle in self.fresh_outputs:
            env[handle] = None
        return result

    def _deferred(self, member: Node, tensors: list[torch.Tensor], state: CallState) -> Any:
        env = state.env
        for vid in member.writes:
            state.pending[self.handle_of[vid]] = self
        kind = member.out_kind
        if kind == "none":
            return None
        results = []
        for vid in member.outputs:
            if vid is None:  # an optional result the op did not compute (a layer norm backward's)
                results.append(None)
                continue
            handle = self.handle_of[vid]
            if vid in member.writes:
                results.append(self._handed(member, tensors, handle))
                continue
            meta = self.metas[vid]
            env[handle] = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=meta.device)
            state.pending[handle] = self
            results.append(env[handle])
        return results[0] if kind == "tensor" else results

    def _handed(self, member: Node, tensors: list[torch.Tensor], handle: int) -> torch.Tensor:
        """The tensor an in-place op returns: the one it was handed."""
        return next(t for t, v in zip(tensors, member.inputs) if self.handle_of[v] == handle)

    def _result(self, member: Node, tensors: list[torch.Tensor], env: list) -> Any:
        kind = member.out_kind
        if kind == "none":
            return None
        results = [None if v is None else env[self.handle_of[v]] for v in member.outputs]
        return results[0] if kind == "tensor" else results

    def _run_member(self, k: int, args: tuple, kwargs: dict) -> Any:
        """A member of a broken group runs like an unfused op, on what the host passed."""
        # Its outputs are not kept in the call state: nothing pends on a broken group, and an
        # extra reference would change what autograd does with a gradient (see step()).
        return self.reference.steps[k].function(*args, **kwargs)

    def materialize(self, handle: int, state: CallState, scalars: list) -> None:
        """Make `handle`'s contents real now: the host reads it before (or without) the kernel filling it."""
        with _as_dispatched(), outside_autocast():  # the members ran after autocast cast them
            self._materialize(handle, state, scalars)

    def _materialize(self, handle: int, state: CallState, scalars: list) -> None:
        if self in state.fired:  # a value the kernel did not store: recompute it from the inputs
            wanted = self.final_of[handle]
            if wanted not in self.recomputable:
                raise self._kept_error(wanted)
            env = state.env
            inputs = [env[self.handle_of[v]] for v in self.node.inputs]
            _fill_placeholder(env[handle], self.reference.partial(inputs, scalars, wanted))
            del state.pending[handle]
            return
        self.interrupt(state, scalars)

    def _kept_error(self, vid: int) -> TraceMismatchError:
        member = next(m for m in self.node.members if vid in m.outputs or vid in m.writes)
        return TraceMismatchError(
            f"{self.graph.function_name}() kept a reference to t{self.handle_of[vid]} ({member.name} at "
            f"{member.source}), a value inside the fused kernel {self.node.name} that the recorded call "
            f"did not keep. The kernel does not store it, and its inputs have changed since, so it cannot "
            f"be computed now. Keep the value on the first call too (the trace then stores it), or trace "
            f"with backend='aten'."
        )

    def interrupt(self, state: CallState, scalars: list) -> None:
        """Run the members handed out so far for real, and the rest of the group op by op."""
        env = state.env
        values = {v: env[self.handle_of[v]] for v in self.node.inputs if env[self.handle_of[v]] is not None}
        for step in self.reference.steps[:state.stepped.get(self, 0)]:
            placeholders = {vid: env[self.handle_of[vid]] for vid in step.outputs if vid is not None}
            step.run(values, scalars)
            for vid, placeholder in placeholders.items():
                # no placeholder: the member whose call fired the kernel (which then raised)
                if placeholder is not None and values[vid] is not placeholder:
                    _fill_placeholder(placeholder, values[vid])
                    values[vid] = placeholder
        for handle in [h for h, group in state.pending.items() if group is self]:
            del state.pending[handle]
        state.broken.add(self)


def _as_dispatched() -> torch._C._AutoDispatchBelowADInplaceOrView:
    """Where the members run when the host settles a group: below autograd, as the kernel runs
    inside the dispatch of its last member. The host may be in another grad mode than the
    members were handed out in: an exception (a TraceMismatchError) has left the user's
    `no_grad()` block before the replay settles its pending groups, and `p.mul_()` on a
    parameter would then refuse to write into a leaf that requires grad. Autograd and the
    version counters saw each member when the host called it (a `_foreach_` member's bump comes
    from the dispatch mode, record/modes.py), so nothing is owed to them. The host-free program
    dispatches no member: it bumps after its kernels (codegen._version_bumps)."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


def _fill_placeholder(placeholder: torch.Tensor, value: torch.Tensor) -> None:
    """Give a placeholder handed to the host its value. The host may have made it a leaf that
    requires grad since (`x = (x * 1.0).requires_grad_()`: requires_grad_ is never dispatched, so
    the record cannot see it); eager's tensor was born with the value, so the fill is no autograd
    op, and copy_ under grad mode would refuse to write into such a leaf."""
    with torch.no_grad():
        placeholder.copy_(value)


def last_writes(graph: Graph) -> dict[int, int]:
    """root -> the latest `fire_at` of the nodes writing it in place."""
    last: dict[int, int] = {}
    for n in graph.nodes:
        for w in n.writes:
            root = graph.values[w].root
            if last.get(root, -1) < n.fire_at:
                last[root] = n.fire_at
    return last


def _recomputable(graph: Graph, node: Node, last_write: dict[int, int]) -> set[int]:
    """Member values that can still be recomputed from the node's inputs at the end of the call:
    computed from storage that neither the group nor any later node writes, out of place or in
    place into memory a member made (`h = lin(x) + 0; h.mul_(3)`: a recompute makes its own `h`).
    `last_write`: see last_writes (one pass over the graph, not one per group)."""
    fire = node.fire_at
    own = {graph.values[w].root for w in node.writes}
    input_roots = {graph.values[v].root for v in node.inputs}

    def later(root: int) -> bool:
        return last_write.get(root, -1) > fire

    made = {root for root in (graph.values[v].root for m in node.members for v in m.outputs if v is not None)
            if root not in input_roots and not later(root)}
    ok: set[int] = set()
    for member in node.members:
        reads = all(v in ok or (v in node.inputs and graph.values[v].root not in own and not later(graph.values[v].root))
                    for v in member.inputs)
        if reads and all(graph.values[w].root in made for w in member.writes):
            ok.update(v for v in (*member.outputs, *member.writes) if v is not None)
    return ok


def _root(record: Record, handle: int) -> int:
    base = record.tensors[handle].base
    return handle if base is None else base


class CheckedProgram:
    def __init__(self, record: Record, graph: Graph, profiler: Profiler | None = None,
                 kernels: dict[int, Any] | None = None):
        self.record = record
        self.graph = graph
        self.default_dtype_results = default_dtype_checks(record)  # checked before those ops run
        self.profiler = profiler
        self.scalar_offsets, self.initial_scalars = scalar_layout(record)
        self.written_literals = frozenset(record.written_literals())  # see Replayer.literal_values
        self.kernels = kernels or {}
        self.groups_fired = 0  # fused kernels run by the checked calls that finished (tests prove fusion ran)
        self.callables: list[Callable | None] = [None] * len(record.ops)
        self.group_at: list[_GroupRun | None] = [None] * len(record.ops)
        # the memory fused kernels read or write (handles, by their root): only there does memory
        # shared where the record had none compute otherwise than eager (Replayer._overlap_error)
        fused_roots = set()
        last_write = last_writes(graph)
        for index, node in enumerate(graph.nodes):
            if node.op is Op.CALL:
                self.callables[node.positions[0]] = callable_for(node)
            elif node.op is Op.FUSED:
                group = _GroupRun(graph, node, kernels[index], last_write)
                for position in node.positions:
                    self.group_at[position] = group
                fused_roots.update(_root(record, h) for h in group.handle_of.values())
        self.fused_roots = frozenset(fused_roots)
        # Fused members and data-dependent output shapes take the generic path.
        fast = [self.callables[op.index] is not None and not data_dependent_size(op, record) for op in record.ops]
        self.profile_rows = None
        if profiler is not None:
            self.profile_rows = [self._profile_row(profiler, op) for op in record.ops]
        self.steps = generate_steps(record, self.callables, fast, self.profile_rows, profiler)

    def _profile_row(self, profiler: Profiler, op) -> int | None:
        """One row per op; a fused group gets one row, timed where its kernel runs (its last member)."""
        group = self.group_at[op.index]
        if group is None:
            return profiler.add_row(Row(op.name, (op.name,), (str(op.source),), "checked replay"))
        if op.index != group.last:
            return None
        members = group.node.members
        return profiler.add_row(Row(group.node.name, tuple(m.name for m in members),
                                    tuple(dict.fromkeys(str(m.source) for m in members)), "checked replay"))

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
            result = group.step(position, args, kwargs, tensors, state, scalars)
        if self.profiler is not None and self.profile_rows[position] is not None:
            self.profiler.stop(self.profile_rows[position], start)
        return result

    def materialize(self, state: CallState, handle: int, scalars: list) -> None:
        """Make the value of `handle` real before the host reads it."""
        group = state.pending.get(handle)
        if group is not None:
            group.materialize(handle, state, scalars)

    def complete(self, state: CallState, scalars: list) -> None:
        """Settle every pending value before arbitrary host code runs (an excluded block, the eager
        rest of a re-recording call, an exception): groups still waiting for members run the ones
        handed out for real; values a finished kernel did not store are computed if someone still
        holds them and dropped otherwise."""
        for handle in list(state.pending):
            group = state.pending.get(handle)
            if group is None:
                continue  # settled by an earlier interrupt of its group
            # references: the state's list and getrefcount's own argument
            if group not in state.fired or sys.getrefcount(state.env[handle]) > 2:
                group.materialize(handle, state, scalars)
            else:
                del state.pending[handle]

    def finish(self, state: CallState, scalars: list) -> None:
        """At the end of a call: values the host still references are made real, the rest is garbage."""
        self.complete(state, scalars)
        self.groups_fired += len(state.fired)


class HostFreeProgram:
    def __init__(self, graph: Graph, profiler: Profiler | None = None, kernels: dict[int, Any] | None = None):
        self.graph = graph
        self.kernels = kernels or {}
        generated = generate_straight_line(graph, profiler, self.kernels)
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
