"""Checked replay: the function runs again, every op is matched with the record, the program computes.

Each dispatched op is compared with the record at the current position (same op, same
structural arguments, inputs wired to the same handles) and is not executed eagerly: the
program's node for that position fires instead and its values are handed back to the host.

Lazy state. A record whose call left new tensors in Python state (optimizer state created on
the first `step()`, a first `.grad`) is *provisional*: the next call legitimately dispatches
different ops (no `zeros_like`, state tensors now come from outside). If the first replay of
such a record diverges, it re-records from the point of divergence (the matched prefix has
already run and is kept), once. Any later divergence raises `TraceMismatchError`.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch

from ..errors import TraceMismatchError
from ..record.amp import in_grad_scaler
from ..record.calls import HOST_VALUE_OPS, data_dependent_size, is_ignored_op, rebuild_call, split_call
from ..record.ddp_calls import ddp_changes_note
from ..record.handles import HandleMap
from ..record.names import ExternalNames
from ..record.optimizer_calls import branching_step
from ..record.record import Kind, Record, TensorMeta
from ..record.recorder import (
    Recorder,
    byte_span,
    note_grad_clear,
    refuse_lazy,
    snapshot_literal,
    storage_address,
    version_of,
)
from ..record.regions import RegionTracker
from ..record.source import user_location
from . import mismatch
from .api_match import same_literal
from .fastpath import MISS
from .program import CheckedProgram
from .variants import ShapeVariants, cache_full

# how many calls of a trace may record again because a stock optimizer's step() took another
# branch (RAdam's rectification switches on once; an optimizer that branches on every call would
# recompile on every call, and raises instead)
OPTIMIZER_BRANCHES = 3


class Replayer:
    """Handler of a checked replay; may turn itself into a recorder (see module docstring)."""

    def __init__(self, program: CheckedProgram, args: tuple, kwargs: dict, *, may_rerecord: bool,
                 external_names: ExternalNames, capture_as_const: bool, variants: ShapeVariants | None = None,
                 room: int = 0, max_traces: int = 0, optimizer_branches: int = 0):
        self.program = program
        # Data-dependent output sizes (see variants.py): the family of programs to move between, and
        # how many new variants max_traces leaves room for. new_variant: this call records one.
        self.variants = variants
        self.room = room
        self.max_traces = max_traces
        self.new_variant = False
        self.replacing: CheckedProgram | None = None  # the provisional variant a new_variant records again
        self.inf_check_at = -1  # the position of GradScaler's inf check in this call, if it ran
        self.outside_inf_check_at = -1  # ...of one on a `found_inf` made outside the call (no branch)
        # host reads of traced values this call made, by description: a record without host reads
        # whose call now makes them (BatchNorm's momentum set to None reads its batch count) must
        # not be re-bound to run without the host, where the value read would be frozen
        self.host_reads_seen: list[str] = []
        self.host_reads = 0  # of any tensor, traced or not (record/api.py: reads inside a torch call)
        self.branched = False  # this call records a variant for the other side of the inf check
        self.moved_at = -1  # where this call last moved to another variant at an inf check
        self.record: Record = program.record
        self.position = 0
        self.handles = HandleMap()
        self.state = program.new_state()
        self.scalars = list(program.initial_scalars)
        self.may_rerecord = may_rerecord
        # a replay that may turn into a re-record notes the `.grad` clears of its matched part
        self.notes_grad_clears = may_rerecord
        self.grad_clears: list = []
        # re-records left for a stock optimizer's step() taking another branch (branching_step);
        # the optimizer's class when this call records again for that reason
        self.optimizer_branches = optimizer_branches
        self.optimizer_branched: str | None = None
        self.names = external_names
        self.capture_as_const = capture_as_const
        self.recorder: Recorder | None = None  # set when the replay turned into a re-record
        self.regions = RegionTracker()
        self._ops = self.record.ops
        self._length = len(self._ops)
        self._steps = program.steps
        self._default_dtype_results = program.default_dtype_results
        self._table = self.handles.table
        # Externals bound so far in this call, held weakly: an extra strong reference changes
        # what autograd dispatches (AccumulateGrad steals a gradient only if nobody else holds it).
        self.bound_externals: dict[int, weakref.ref] = {}
        # Literals (torch.tensor(s), the value of `y[mask] = s`) this call made with other values
        # than the record's: this call computes with them, but the compiled program has the recorded
        # ones built in, so no faster path may be bound from this call (trace.py).
        self.other_literals: list[int] = []
        # copies of the literals the record writes, as this call made them: a re-record from a later
        # op keeps the value the program starts from (Recorder.resume)
        self.literal_values: dict[int, torch.Tensor] = {}
        for handle, tensor in zip(self.record.arg_handles, args):
            self.handles.set(tensor, handle)
        for name, handle in self.record.kwarg_handles.items():
            self.handles.set(kwargs[name], handle)
        # the memory of the inputs and of the externals bound so far (see _overlap_error): by
        # storage, (handle, first byte, end, the tensor held weakly) in the order they were bound
        self._spans = self._input_spans(args, kwargs)

    def _bind_external(self, tensor: torch.Tensor, handle: int) -> None:
        if self.record.tensors[handle].literal and not same_literal(tensor, self.record.constants[handle]):
            self.other_literals.append(handle)
        self.handles.set(tensor, handle)
        self.bound_externals[handle] = weakref.ref(tensor)
        if handle in self.program.written_literals:
            self.literal_values[handle] = snapshot_literal(tensor)

    # -- handler protocol -----------------------------------------------------------------------

    def on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.recorder is None:
            position = self.position
            if position in self._default_dtype_results and torch.get_default_dtype() is not \
                    self._default_dtype_results[position] and func is self._ops[position].op:
                return self._diverge(func, args, kwargs, lambda: mismatch.other_default_dtype(
                    self.record, position, torch.get_default_dtype(), user_location()))
            if position < self._length and func is self._ops[position].op:
                step = self._steps[position]
                if step is not None:
                    result = step(args, kwargs, self._table, self._bind_first_seen, self.bound_externals,
                                  self.scalars, self._overlaps)
                    if result is not MISS:
                        self.position = position + 1
                        return result
            return self._on_op_generic(func, args, kwargs)
        return self.recorder.on_op(func, args, kwargs)

    def _on_op_generic(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Everything the generated step does not handle: ignored ops, host reads, first-seen
        externals, and the precise analysis of a divergence."""
        if is_ignored_op(func):
            return self.regions.run(func, args, kwargs)
        if func in HOST_VALUE_OPS:
            for tensor in split_call(func, args, kwargs)[0]:  # torch.equal(a, b) reads both
                self.on_host_read(tensor, str(func))
            return func(*args, **kwargs)
        record = self.record
        position = self.position
        tensors, statics, scalars = split_call(func, args, kwargs)
        refuse_lazy(record.function_name, self.names, func, tensors, position, user_location())
        if position >= len(record.ops):
            return self._diverge(func, args, kwargs, lambda: mismatch.extra_op(
                record, func, statics, self._names(tensors), scalars, user_location()))
        op = record.ops[position]
        if func is _ALIAS and op.op is _SLICE and kwargs == {}:
            result = self._full_slice(op, args[0], position)
            if result is not None:
                return result
        if func is not op.op:
            return self._diverge(func, args, kwargs, lambda: mismatch.different_op(
                record, position, func, statics, self._names(tensors), scalars, user_location()))
        if statics != op.statics:
            return self._diverge(func, args, kwargs, lambda: mismatch.different_arguments(
                record, position, statics, self._names(tensors), scalars, user_location()))
        error = self._check_inputs(tensors, op.inputs, position)
        if error is not None:
            return self._diverge(func, args, kwargs, error)
        if scalars:
            start = self.program.scalar_offsets[position]
            self.scalars[start:start + len(scalars)] = scalars
        result = self.program.execute(position, args, kwargs, tensors, self.state, self.scalars)
        if data_dependent_size(op, record):
            metas = _metas(op, result)
            if metas != op.out_metas:
                return self._new_size(func, args, kwargs, result, metas)
        self._map_outputs(op, result)
        self.position = position + 1
        return result

    def _full_slice(self, op: Any, tensor: torch.Tensor, position: int) -> Any:
        """torch's indexing dispatches `aten.alias` for a slice that covers its whole dim at the
        call's sizes (`x[:, :6]` where `x.size(1) <= 6`) and `aten.slice` otherwise: a trace of
        symbolic sizes recorded the slice, whose view of the whole dim is the alias. The recorded
        slice runs in its place, or None if it does not cover the dim at these sizes."""
        if self._check_inputs([tensor], op.inputs, position) is not None:
            return None
        start = self.program.scalar_offsets[position]
        args, kwargs = rebuild_call(op.statics, [tensor], self.scalars[start:start + len(op.scalars)])
        if not _covers_whole_dim(tensor, {**dict(zip(_SLICE_ARGUMENTS, args[1:])), **kwargs}):
            return None
        result = self.program.execute(position, tuple(args), kwargs, [tensor], self.state, self.scalars)
        self._map_outputs(op, result)
        self.position = position + 1
        return result

    def _new_size(self, func: Any, args: tuple, kwargs: dict, result: Any, metas: tuple) -> Any:
        """A data-dependent op produced outputs of a size this program did not record: continue in the
        variant that did, or record one from here (see variants.py)."""
        position = self.position
        if self.variants is None:
            raise mismatch.shape_changed(self.record, position, list(metas), user_location())
        other = self.variants.find(self.program, position, metas)
        if other is not None:
            self._move_to(other)
            self._map_outputs(self.record.ops[position], result)
            self.position = position + 1
            return result
        if self.room <= 0:
            raise cache_full(self.record, position, list(metas), self.variants.sizes_at(position, self.program),
                             self.max_traces)
        self.new_variant = True
        self._start_rerecord()
        return self.recorder.on_op(func, args, kwargs)  # runs the op again, as recorded from here on

    def _move_to(self, program: CheckedProgram) -> None:
        """Continue the call in another variant: the ops before this position ran and no fused group
        spans a data-dependent op, so the other program starts from a settled state."""
        self.program.complete(self.state, self.scalars)
        kept = program.scalar_offsets[self.position] + len(self.record.ops[self.position].scalars)
        self.scalars = self.scalars[:kept] + list(program.initial_scalars[kept:])
        self.program = program
        self.record = program.record
        self.state = program.new_state()
        if self.variants.provisional(program) and not self.may_rerecord:
            # recorded by the call that created the state this call has: it may diverge where that
            # call made the state, and then records the variant again from there
            self.may_rerecord = True
            self.new_variant = True
            self.replacing = program
        self._ops = self.record.ops
        self._length = len(self._ops)
        self._steps = program.steps

    def on_host_read(self, tensor: torch.Tensor, what: str) -> None:
        if self.recorder is not None:
            return self.recorder.on_host_read(tensor, what)
        self.host_reads += 1
        handle = self.handles.get(tensor)
        if handle is not None:
            self.host_reads_seen.append(f"{what} of t{handle} at {user_location()}")
            self.program.materialize(self.state, handle, self.scalars)
            if in_grad_scaler():
                self.inf_check_at = self.position
        elif in_grad_scaler():
            self.outside_inf_check_at = self.position

    def on_hidden_read(self, tensor: torch.Tensor, what: str) -> None:
        """torch reads `tensor` in C++ (record/modes.py HIDDEN_READS): it must hold its value, as for a
        host read. The record notes the read; the ops torch dispatches from it are checked as any."""
        if self.recorder is not None:
            return self.recorder.on_hidden_read(tensor, what)
        handle = self.handles.get(tensor)
        if handle is not None:
            self.program.materialize(self.state, handle, self.scalars)

    def on_grad_cleared(self, tensor: torch.Tensor) -> None:
        if self.recorder is not None:
            self.recorder.on_grad_cleared(tensor)
        else:
            self.grad_clears.append(note_grad_clear(self.position, tensor, self.handles))

    def on_excluded_block(self) -> None:
        if self.recorder is not None:
            return self.recorder.on_excluded_block()
        self.program.complete(self.state, self.scalars)

    # -- matching -------------------------------------------------------------------------------

    def _check_inputs(self, tensors: list[torch.Tensor], expected: tuple[int, ...], position: int):
        """Return a factory of the mismatch error, or None when every input is wired as recorded."""
        record = self.record
        for slot, (tensor, handle) in enumerate(zip(tensors, expected)):
            got = self.handles.get(tensor)
            info = record.tensors[handle]
            if got == handle:
                continue
            if got is not None and not (info.cut is not None and got < info.cut):
                reason = ("is an internal tensor where an external one was recorded"
                          if info.kind in (Kind.EXTERNAL, Kind.CONST) and record.tensors[got].kind is Kind.INTERNAL
                          else "comes from a different producer")
                return self._input_error(position, slot, handle, record.describe_handle(got), reason)
            if info.kind is Kind.INTERNAL:
                return self._input_error(position, slot, handle, f"an external tensor, {_describe(tensor)}",
                                         "is an external tensor where an internal one was recorded")
            if info.kind in (Kind.ARG, Kind.KWARG):
                return self._input_error(position, slot, handle, f"an external tensor, {_describe(tensor)}",
                                         f"is not the {info.kind.value} {info.name} it was recorded as")
            error = self._first_seen_error(tensor, handle, position, slot)
            if error is not None:
                return error
            self._bind_external(tensor, handle)
        return None

    def _first_seen_error(self, tensor: torch.Tensor, handle: int, position: int, slot: int):
        """Why a tensor seen for the first time in this call cannot be the recorded external (or None)."""
        info = self.record.tensors[handle]
        bound = self.bound_externals.get(handle)
        if bound is not None and bound() is not tensor:
            return self._input_error(position, slot, handle, f"another tensor, {_describe(tensor)}",
                                     "is a different object than the one this external was bound to "
                                     "earlier in the call")
        if info.kind is Kind.CONST and not info.literal:
            return self._check_constant(tensor, handle, position)
        if info.literal:
            return self._literal_error(tensor, handle, position, slot)
        meta = TensorMeta.of(tensor)
        if meta != info.meta:
            now, recorded = str(meta), str(info.meta)
            if now == recorded:  # only the layout differs: say so, or the two look the same
                now = f"{now} with strides {tuple(tensor.stride())}"
                recorded = f"{recorded} with strides {info.meta.stride}"
            changed = ("changed shape, stride, dtype or device" if meta.math_bits == info.meta.math_bits else
                       "is a negative or conjugate view where the recorded one was not, or the reverse")
            return self._input_error(position, slot, handle, now, f"{changed} (recorded {recorded})")
        return self._overlap_error(tensor, handle, position, slot)

    def _overlap_error(self, tensor: torch.Tensor, handle: int, position: int, slot: int):
        """An external in the memory of an input or of another external, where the record saw it in
        memory of its own (`q.grad = p.grad.detach()` after recording): the program computes the two
        as separate memory, and a write through one would not show in the other. The recorder noted
        each overlap as a base (Recorder._overlapped); the call must overlap the same way, where
        a fused kernel meets one of the two. (An overlap the record had and this call has not is
        harmless: the program only orders them.)"""
        if self.record.tensors[handle].cut is not None:
            return None  # taken again after an excluded block: the program settled before it
        span = byte_span(tensor)
        if span is None:
            return None
        start, end = span
        spans = self._spans.setdefault(storage_address(tensor), [])  # only one storage's tensors overlap
        tensors = self.record.tensors
        own_root = tensors[handle].base if tensors[handle].base is not None else handle
        fused = self.program.fused_roots
        for other, low, high, ref in spans:
            # a tensor freed since it was bound (a bucket the comm hook replaced) left its memory to
            # the allocator: a tensor there now does not share it
            if not (start < high and low < end) or ref() is None:
                continue
            root = tensors[other].base if tensors[other].base is not None else other
            if root == tensors[handle].base or (root not in fused and own_root not in fused):
                continue  # recorded as one memory, or both only met by ops that run as eager's
            return self._input_error(position, slot, handle, f"a tensor in the memory of {tensors[other].label()}",
                                     f"shares memory with {tensors[other].label()} ({tensors[other].name}) now, "
                                     f"which it did not when recorded; the program computes them as separate memory")
        spans.append((handle, start, end, weakref.ref(tensor)))
        return None

    def _input_spans(self, args: tuple, kwargs: dict) -> dict[int, list[tuple[int, int, int, weakref.ref]]]:
        inputs = [*zip(self.record.arg_handles, args)]
        inputs += [(handle, kwargs[name]) for name, handle in self.record.kwarg_handles.items()]
        spans: dict[int, list[tuple[int, int, int, weakref.ref]]] = {}
        for handle, tensor in inputs:
            span = byte_span(tensor) if isinstance(tensor, torch.Tensor) else None
            if span is not None and self.handles.get(tensor) == handle:
                spans.setdefault(storage_address(tensor), []).append((handle, *span, weakref.ref(tensor)))
        return spans

    def _literal_error(self, tensor: torch.Tensor, handle: int, position: int, slot: int):
        """A literal (`torch.tensor(data)`) may hold other values than recorded (bound as this call's,
        see `other_literals`), but not another dtype or shape: the program's kernels and the ops
        after it were built for the recorded ones (a bool read as int64, a list grown past its
        recorded length read out of bounds). Like a Python number that changes type, a mismatch."""
        recorded = self.record.tensors[handle].meta
        if TensorMeta.of(tensor) == recorded:
            return None
        return self._input_error(position, slot, handle, f"a tensor created from Python data, {_describe(tensor)}",
                                 f"is created from Python data of another dtype or shape than recorded ({recorded}); "
                                 f"the program was compiled for the recorded one")

    def _overlaps(self, tensor: torch.Tensor, handle: int) -> bool:
        """The generated steps' memory check of a first-seen external (see _overlap_error)."""
        return bool(self.program.fused_roots) and self._overlap_error(tensor, handle, self.position, 0) is not None

    def _bind_first_seen(self, tensor: torch.Tensor, handle: int) -> bool:
        """Binding hook of the generated steps: True if `tensor` may be bound as external `handle`."""
        if self._first_seen_error(tensor, handle, self.position, 0) is not None:
            return False
        self._bind_external(tensor, handle)
        return True

    def _check_constant(self, tensor: torch.Tensor, handle: int, position: int):
        record = self.record
        captured = record.constants[handle]
        if tensor is not captured:
            detail = f"is a different tensor object now ({_describe(tensor)})"
        elif version_of(tensor) != record.constant_versions[handle]:
            detail = (f"was modified in place since it was captured (version "
                      f"{record.constant_versions[handle]} -> {version_of(tensor)})")
        elif record.constant_storage.get(handle, 0) not in (0, storage_address(tensor)):
            detail = "has other memory than when it was captured (`.data = ...` or `set_()`)"
        else:
            return None
        return lambda: mismatch.const_violated(record, position, handle, detail, user_location())

    def _input_error(self, position: int, slot: int, handle: int, got: str, reason: str):
        return lambda: mismatch.wrong_input(self.record, position, slot, handle, got, reason, user_location())

    def _map_outputs(self, op, result: Any) -> None:
        if op.out_kind == "tensor":
            self.handles.set(result, op.outputs[0])
        elif op.out_kind in ("tuple", "list"):
            for handle, value in zip(op.outputs, result):
                if handle is not None:
                    self.handles.set(value, handle)

    def _names(self, tensors: list[torch.Tensor]) -> list[str]:
        names = []
        for tensor in tensors:
            handle = self.handles.get(tensor)
            names.append(f"t{handle}" if handle is not None else f"<external {_describe(tensor)}>")
        return names

    # -- divergence -----------------------------------------------------------------------------

    def _diverge(self, func: Any, args: tuple, kwargs: dict, error_factory) -> Any:
        if self.inf_check_at == self.position and not self.may_rerecord and self.variants is not None:
            return self._other_branch(func, args, kwargs)
        optimizer = branching_step() if not self.may_rerecord else None
        if optimizer is not None and self.optimizer_branches > 0:
            # torch's step() went another way on its own state: what eager does from here on, so
            # the call records again from here, as a call that created state does
            self.optimizer_branched = type(optimizer).__qualname__
            self._start_rerecord()
            return self.recorder.on_op(func, args, kwargs)
        if not self.may_rerecord:
            error = error_factory()
            if isinstance(error, TraceMismatchError):
                # the cause of a divergence inside DDP's forward or backward, which the ops do not show
                note = ddp_changes_note(self.record.ddp_states)
                if self.outside_inf_check_at == self.position:
                    note += ("\n  GradScaler's inf check just read a found_inf made outside the traced call "
                             "(`scaler.unscale_(opt)` before it): the trace follows the branch of an overflow "
                             "step only when it computes found_inf itself. Call `scaler.unscale_` inside the "
                             "traced function, or trace the whole step.")
                if optimizer is not None:
                    note += (f"\n  The divergence is inside {type(optimizer).__qualname__}.step(), whose ops "
                             f"changed: a branch of torch's own on the optimizer's state (RAdam's rectification), "
                             f"or settings or gradients that changed. This trace recorded the call again at such "
                             f"a change {OPTIMIZER_BRANCHES} times already and does not follow one that keeps "
                             f"changing: keep the settings and which parameters have gradients the same from "
                             f"call to call, or run that optimizer's step outside the traced function.")
                if note:
                    error.args = (f"{error.args[0]}{note}", *error.args[1:])
            raise error
        self._start_rerecord()
        return self.recorder.on_op(func, args, kwargs)

    def _other_branch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """GradScaler's inf check just went the other way (an overflow skips `optimizer.step()`, or
        the first step after overflows takes it): continue in the variant that took this branch,
        or record one from here (see variants.py; the check is a barrier no fused group spans)."""
        other = self.variants.find_branch(self.program, self.position, func)
        if other is not None and self.moved_at != self.position:  # once: two variants never ping-pong
            self.moved_at = self.position
            self._move_to(other)
            return self.on_op(func, args, kwargs)
        if self.room <= 0:
            raise self.variants.branch_cache_full(self.record, self.position, self.max_traces)
        self.new_variant = self.branched = True
        self._start_rerecord()
        return self.recorder.on_op(func, args, kwargs)

    def _start_rerecord(self) -> None:
        # the rest of the call runs eagerly on the tensors the host holds: make them all real
        self.program.complete(self.state, self.scalars)
        self.recorder = Recorder.resume(self.record, self.position, self.handles, self.names,
                                        self.capture_as_const, self.regions, self.scalars, self.literal_values,
                                        self.grad_clears if self.notes_grad_clears else None)

    def abandon(self) -> None:
        """The function raised: run the fused members it was handed, so tensors it kept are real and
        in-place updates it asked for happened (the exception itself propagates unchanged)."""
        if self.recorder is None:
            # a kept value that cannot be computed raises a mismatch: the user's exception is the news
            with contextlib.suppress(TraceMismatchError):
                self.program.complete(self.state, self.scalars)

    def finish(self, result: Any) -> Record | None:
        """Check the end of the call; return a new record if the call re-recorded."""
        if self.recorder is None and self.position < len(self.record.ops):
            if not self.may_rerecord:
                raise mismatch.premature_end(self.record, self.position, user_location())
            self._start_rerecord()
        if self.recorder is not None:
            return self._rerecorded(result)
        error = self._check_output(self.record.output, result, "output")
        if error is not None:
            if not self.may_rerecord:
                raise mismatch.output_mismatch(self.record, error, user_location())
            self._start_rerecord()
            return self._rerecorded(result)
        self.program.finish(self.state, self.scalars)
        return None

    def _rerecorded(self, result: Any) -> Record:
        """The new record. The abandoned replay lets go of the values it computed first: the record
        flags every tensor still alive after the call as state the call created (escaped), and a
        value only this replay held was then stored by its fused kernel on every later call."""
        self.state.env = [None] * len(self.state.env)
        self.state.pending.clear()
        return self.recorder.finish(result)

    def _check_output(self, spec, value: Any, path: str) -> str | None:
        if spec.kind == "tensor":
            if not isinstance(value, torch.Tensor):
                return f"{path} is {type(value).__name__}, recorded a tensor (t{spec.handle})"
            got = self.handles.get(value)
            if got == spec.handle:
                return None
            info = self.record.tensors[spec.handle]
            if got is None and info.kind is Kind.EXTERNAL:
                self._bind_external(value, spec.handle)
                return None
            if info.cut is not None and got < info.cut and spec.handle not in self.bound_externals:
                self._bind_external(value, spec.handle)  # from before an excluded block: what the host has
                return None
            now = self.record.describe_handle(got) if got is not None else f"an untraced tensor {_describe(value)}"
            return f"{path} is {now}, not the recorded {self.record.describe_handle(spec.handle)}"
        if spec.kind == "none":
            return None if value is None else f"{path} is {type(value).__name__}, recorded None"
        expected_type = {"tuple": tuple, "list": list, "dict": dict}[spec.kind]
        if not isinstance(value, expected_type):
            return f"{path} is {type(value).__name__}, recorded a {spec.kind}"
        if spec.kind == "dict":
            if tuple(value) != spec.keys:
                return f"{path} has keys {list(value)}, recorded {list(spec.keys)}"
            items = [(f"{path}[{k!r}]", value[k]) for k in spec.keys]
        else:
            if len(value) != len(spec.children):
                return f"{path} has {len(value)} elements, recorded {len(spec.children)}"
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        for child, (child_path, child_value) in zip(spec.children, items):
            error = self._check_output(child, child_value, child_path)
            if error is not None:
                return error
        return None


_ALIAS, _SLICE = torch.ops.aten.alias.default, torch.ops.aten.slice.Tensor
_SLICE_ARGUMENTS = ("dim", "start", "end", "step")


def _covers_whole_dim(tensor: torch.Tensor, arguments: dict) -> bool:
    """True if `aten.slice(tensor, **arguments)` takes every element of its dim, as Python's
    slice rules clamp its start and end to the dim's size."""
    dim, step = arguments.get("dim", 0), arguments.get("step", 1)
    if not isinstance(dim, int) or step != 1 or not -tensor.dim() <= dim < tensor.dim():
        return False
    start, end = arguments.get("start"), arguments.get("end")
    if not all(value is None or isinstance(value, int) for value in (start, end)):
        return False
    size = tensor.shape[dim]
    first, stop, _ = slice(start, end).indices(size)
    return first == 0 and stop == size


def _metas(op: Any, result: Any) -> tuple:
    """The metadata of an op's tensor outputs, shaped like its recorded `out_metas`."""
    if op.out_kind == "tensor":
        return (TensorMeta.of(result),)
    if op.out_kind in ("tuple", "list"):
        return tuple(None if v is None else TensorMeta.of(v) for v in result)
    return ()


def _describe(tensor: torch.Tensor) -> str:
    return mismatch.describe_tensor(tensor)
