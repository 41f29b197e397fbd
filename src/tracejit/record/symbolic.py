"""Symbolic recording (`symbolic=True`): the first call builds the record without computing it.

`SymbolicRecorder` records exactly the ops `Recorder` records, but runs no kernel: new outputs are
placeholders (placeholders.py), in-place ops leave their targets untouched, views run for real
(they only compute metadata, and real views keep aliasing exact). Once the call returns, the
recorded program runs for real (runtime/realize.py) and every placeholder storage still held
anywhere -- returned tensors, `.grad`, optimizer state, tensors autograd saved, values stored on
Python objects -- receives the contents an eager call would have left in it.

Two points of a call need real values earlier and get them by running the ops recorded so far (a
*catch-up*): the start of an `exclude_from_trace()` block, which is eager code by definition, and
an exception, after which the host must see the side effects eager execution would have had.
A host read of a value that is not computed yet (`.item()`, `.numpy()`, `print`) raises
`SymbolicTraceError` instead: serving it would run the call eagerly piece by piece, which is what
symbolic recording promises not to do (see docs/symbolic.md).
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from ..errors import SymbolicTraceError
from .calls import HOST_VALUE_OPS, is_view_op, may_copy, mutated_tensors
from .names import ExternalNames
from .placeholders import DataDependentResult, Placeholder, PlaceholderExecutor, storage_key
from .record import Kind, OpRecord, OutputSpec, Record
from .recorder import Recorder, _busy_calling, mark_escapes, storage_address
from .source import user_location
from .specialize import specialize
from .symbolic_shapes import SymbolicSizes

# In-place ops that give a tensor another storage: a placeholder's storage must stay the one recorded.
_STORAGE_REPLACING_OPS = frozenset({"resize_", "resize_as_", "set_"})
_OPTIM_DIR = f"{os.sep}torch{os.sep}optim{os.sep}"
# What a fake tensor dispatches to answer a metadata query (FakeTensor dispatches its device; C++
# code reading the sizes of one of symbolic size, as upsampling does, dispatches aten.size).
_aten = torch.ops.aten
_FAKE_METADATA_OPS = frozenset({torch.ops.prim.device.default, torch.ops.prim.layout.default, _aten.size.default,
                                _aten.stride.default, _aten.sym_size.default, _aten.sym_stride.default,
                                _aten.sym_numel.default, _aten.sym_storage_offset.default})


def sorted_kwargs(kwarg_handles: dict[str, int]) -> list[int]:
    """Tensor keyword handles in signature order (by name)."""
    return [kwarg_handles[name] for name in sorted(kwarg_handles)]


class ProgramRunner(Protocol):
    def run(self, program: Any, inputs: dict[int, torch.Tensor],
            placeholders: dict[int, Placeholder]) -> list[str]:
        """Run the program's ops not run yet; fill every live placeholder; return stride disagreements."""

    unwritten: set  # after a run raised: the storages of placeholders whose op never ran

    def computed(self, handle: int) -> torch.Tensor:
        """The value the runs left for an escaped handle."""


class SymbolicRecorder(Recorder):
    """A recorder that computes nothing until the call is over (see module docstring)."""

    def __init__(self, function_name: str, *, capture_as_const: bool, external_names: ExternalNames,
                 compile: Callable[[Record], Any], runner: ProgramRunner, sizes: SymbolicSizes | None = None):
        super().__init__(function_name, capture_as_const=capture_as_const, external_names=external_names)
        self._compile = compile
        self._runner = runner
        # symbolic_shape: the inputs are fakes of symbolic sizes (record/symbolic_shapes.py); a run of
        # the record so far (a catch-up) evaluates its sizes for this call's inputs first.
        self._sizes = sizes
        self._real_inputs: dict[int, torch.Tensor] = {}
        self._executor = PlaceholderExecutor(sizes)
        # Every tensor the record takes from outside (arguments, externals, constants), held strongly:
        # the program reads them when it runs, after the call may have dropped them.
        self._inputs: dict[int, torch.Tensor] = {}
        # ...except literals (`torch.tensor(data)`), held weakly: one the call no longer holds starts
        # from the record's copy, and one it keeps in Python state is found there (mark_escapes)
        self._literals: dict[int, weakref.ref] = {}
        self._placeholders: dict[int, Placeholder] = {}
        self._allocated: list[torch.Tensor] = []  # placeholders of the op being recorded
        # Storages whose contents are not what eager execution would hold at this point, and why.
        self._stale: dict[StorageWeakRef, str] = {}
        # The default generator's state at the first random op not run yet, and that op: random
        # ops draw only when the program runs, so the host must not reseed the generator after it.
        self._generator_state: torch.Tensor | None = None
        self._first_draw = ""
        self.ran_for_real = False  # a catch-up ran ops of the call on its real tensors
        # symbolic_shape: each leaf tensor from outside the call (a parameter) as first seen, its .grad
        # and requires_grad: a dropped attempt puts them back (runtime/undo.py)
        self.first_seen: list[tuple[torch.Tensor, torch.Tensor | None, bool]] = []
        # tensor -> True if it has autograd history no backward pass of the call freed (the call's
        # record/reached.Seen.live_graph); None: every returned tensor that requires grad has such history
        self.live_graph: Callable[[torch.Tensor], bool] | None = None

    # -- recording --------------------------------------------------------------------------------

    def _new_handle(self, tensor: torch.Tensor, kind: Kind, name: str, producer: int | None = None,
                    base: int | None = None, literal: bool = False) -> int:
        handle = super()._new_handle(tensor, kind, name, producer=producer, base=base, literal=literal)
        if literal:
            self._literals[handle] = weakref.ref(tensor)
        elif kind is not Kind.INTERNAL:
            self._inputs[handle] = tensor
        if self._sizes is not None and kind is Kind.EXTERNAL and tensor.is_leaf:
            self.first_seen.append((tensor, tensor.grad, tensor.requires_grad))
        return handle

    def use_real_inputs(self, args: tuple, kwargs: dict) -> None:
        """symbolic_shape: the function got fakes of the inputs; the program reads the real ones."""
        self._real_inputs = dict(zip(self.arg_handles, args))
        self._real_inputs.update((self.kwarg_handles[name], kwargs[name]) for name in self.kwarg_handles)
        self._inputs.update(self._real_inputs)

    def held_storages(self) -> set[int]:
        # A tensor from before an excluded block, used after it, is an input of the program (see
        # Recorder._cut) that this recorder holds until the program has run: that keeps no state.
        return {storage_address(t) for h, t in self._inputs.items() if self.tensors[h].cut is not None}

    def _on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in _FAKE_METADATA_OPS:  # a fake tensor asking for its device: not an op of the function
            return func(*args, **kwargs)
        if func in HOST_VALUE_OPS:
            for value in args:
                if isinstance(value, torch.Tensor):
                    self._check_readable(value, str(func))
        recorded = len(self.ops)
        self._allocated = []
        result = super()._on_op(func, args, kwargs)
        if len(self.ops) > recorded:
            self._track(self.ops[-1], mutated_tensors(func, args, kwargs))
            if torch.Tag.nondeterministic_seeded in func.tags:
                self._note_random_op(self.ops[-1])
        return result

    def execute(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if is_view_op(func) and not may_copy(func):
            # Metadata only, and a real view keeps aliasing exactly as in eager code. (One that may
            # copy, `contiguous` under inference_mode, is computed with the rest: its copy would
            # read a placeholder not computed yet.)
            return self._executor.run_view(func, args, kwargs)
        if torch.Tag.inplace_view in func.tags:
            self._check_metadata_change(func, args, kwargs)
            return self._executor.change_metadata(func, args, kwargs)
        try:
            result, self._allocated = self._executor.run(func, args, kwargs)
        except DataDependentResult:
            if any("Tensor" in str(r.type) for r in func._schema.returns):
                raise
            # A value for the host (allclose, equal): a host read, allowed where the data exists already.
            for value in tree_leaves((args, kwargs)):
                if isinstance(value, torch.Tensor):
                    self._check_readable(value, str(func))
            return func(*args, **kwargs)
        return result

    def _track(self, op: OpRecord, written: list[torch.Tensor]) -> None:
        for tensor in self._allocated:
            handle = self.handles.get(tensor)
            if handle is None:
                continue
            placeholder = Placeholder.of(tensor)
            self._placeholders[handle] = placeholder
            self._stale[placeholder.storage] = f"the output of op #{op.index} {op.name} at {op.source}"
        self._allocated = []
        for tensor in written:
            key = storage_key(tensor)
            if key is not None and key not in self._stale:
                self._stale[key] = (f"written in place by op #{op.index} {op.name} at {op.source}, "
                                    f"which has not run yet")

    def _note_random_op(self, op: OpRecord) -> None:
        if self._generator_state is None:
            self._generator_state = torch.default_generator.get_state()
            self._first_draw = f"op #{op.index} {op.name} at {op.source}"
        else:
            self._raise_if_reseeded()

    def _reseeding_error(self) -> SymbolicTraceError | None:
        if self._generator_state is None or not _generator_changed(self._generator_state):
            return None
        return SymbolicTraceError(
            f"tracejit: {self.function_name}() changed the state of torch's default random generator on the "
            f"host (torch.manual_seed, set_rng_state, ...) after recording the random {self._first_draw}, "
            f"while its first call was recorded with symbolic=True. Random ops draw their numbers only when "
            f"the recorded program runs, so they would not draw what an eager call draws. Seed before "
            f"calling the traced function, or trace with symbolic=False."
        )

    def _raise_if_reseeded(self) -> None:
        error = self._reseeding_error()
        if error is not None:
            raise error

    def _check_metadata_change(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = func._schema.name.split("::")[-1]
        if name in _STORAGE_REPLACING_OPS:
            raise SymbolicTraceError(
                f"tracejit: symbolic recording cannot run {func} at {user_location()}: it gives a tensor "
                f"another storage, and symbolic=True fills each output's storage only after the call. Trace "
                f"this function with symbolic=False."
            )
        if name == "detach_":
            return  # below autograd a no-op: running it now and again in the program is harmless
        for tensor in mutated_tensors(func, args, kwargs):
            handle = self.handles.get(tensor)
            if handle is None or self.tensors[handle].kind is not Kind.INTERNAL:
                described = self.tensors[handle].name if handle is not None else "a tensor"
                raise SymbolicTraceError(
                    f"tracejit: {func} at {user_location()} changes the shape or strides of {described} "
                    f"in place. Symbolic recording must apply that change now (later ops depend on it) and "
                    f"the program applies it again when it runs, so it cannot record it on a tensor from "
                    f"outside the call. Use the out-of-place form (x = x.unsqueeze(0) rather than "
                    f"x.unsqueeze_(0)) or trace with symbolic=False."
                )

    # -- host reads and excluded blocks -----------------------------------------------------------

    def _on_host_read(self, tensor: torch.Tensor, what: str) -> None:
        self._check_readable(tensor, what)
        super()._on_host_read(tensor, what)

    def _on_hidden_read(self, tensor: torch.Tensor, what: str) -> None:
        # torch reads the value in C++: a stand-in without values or a placeholder not computed yet
        # would give it garbage (or crash inside torch)
        self._check_readable(tensor, what)
        super()._on_hidden_read(tensor, what)

    on_stand_in_read = _busy_calling("_on_stand_in_read")

    def _on_stand_in_read(self, tensor: torch.Tensor, what: str) -> None:
        # torch skips a value read on a FakeTensor (modes.py _STAND_IN_READ_HOOKS) that it makes
        # on every real tensor: a trace recorded on the stand-in would lack the read's ops
        if isinstance(tensor, FakeTensor):
            raise SymbolicTraceError(self._fake_read_message(tensor, what))

    def _check_readable(self, tensor: torch.Tensor, what: str) -> None:
        if isinstance(tensor, FakeTensor):
            raise SymbolicTraceError(self._fake_read_message(tensor, what))
        key = storage_key(tensor)
        reason = self._stale.get(key) if key is not None else None
        if reason is not None:
            raise SymbolicTraceError(self._host_read_message(tensor, what, reason))

    def _fake_read_message(self, tensor: torch.Tensor, what: str) -> str:
        source = user_location()
        code = f": {source.code}" if source.code else ""
        handle = self.handles.get(tensor)
        label = f"t{handle} " if handle is not None else ""
        return (
            f"tracejit: {self.function_name}() reads the value of a tensor on the host ({what}) at {source}{code}, "
            f"while it is recorded with symbolic sizes (symbolic_shape). That tensor, {label}of shape "
            f"{list(tensor.shape)}, is an input or depends on one, and symbolic-shape recording runs the function on "
            f"stand-ins of the inputs that have sizes but no values. A value read on the host would also make the "
            f"trace depend on data. Read the value after the call, or trace with symbolic_shape=False."
        )

    def _host_read_message(self, tensor: torch.Tensor, what: str, reason: str) -> str:
        source = user_location()
        code = f": {source.code}" if source.code else ""
        handle = self.handles.get(tensor)
        label = f"t{handle} " if handle is not None else ""
        # symbolic_shape=True records this way too: its remedies are that option's, not symbolic's
        option, off = (("symbolic_shape=True", "symbolic_shape=None (the default) or False") if self._sizes is not None
                       else ("symbolic=True", "symbolic=False"))
        message = (
            f"tracejit: {self.function_name}() reads the value of a tensor on the host ({what}) at "
            f"{source}{code}, while its first call is recorded with {option}. That tensor, "
            f"{label}{_describe(tensor)}, is not computed yet: it is {reason}. Symbolic recording builds "
            f"the program without running it; values computed inside the call exist only once the call "
            f"returns.\n"
        )
        optimizer = _optimizer_in_stack()
        if optimizer is not None:
            owner, function = optimizer
            cls = type(owner).__name__
            fix = (f"construct the optimizer with fused=True, which reads nothing on the host, or trace with "
                   f"{off}" if "fused" in inspect.signature(type(owner).__init__).parameters
                   else f"trace with {off}")
            why = (" (the for-loop and foreach Adam and AdamW read the step count with .item() on every "
                   "step)" if isinstance(owner, torch.optim.Adam | torch.optim.AdamW) else "")
            return message + (
                f"The read happens inside torch.optim.{cls}.step (in {function}): this implementation reads "
                f"tensor values on the host{why}. To record it symbolically, {fix}."
            )
        if self._sizes is not None:  # which refuses exclude_from_trace() blocks
            return message + f"Read the value after the call (return the tensor), or trace with {off}."
        return message + (
            "Read the value after the call (return the tensor), read it inside a `with "
            "tracejit.exclude_from_trace():` block (the ops recorded before the block run first), or trace "
            "with symbolic=False."
        )

    def catch_up(self) -> None:
        """An excluded block begins: it is eager code, so run the ops recorded so far."""
        if self._sizes is not None:
            raise SymbolicTraceError(
                f"tracejit: {self.function_name}() has an exclude_from_trace() block at {user_location()}, and "
                f"symbolic_shape records the function on stand-ins of its inputs that have sizes but no values: "
                f"the block would see no values. Trace it with symbolic_shape=False.")
        self._catch_up()

    def finish(self, result: Any) -> Record:
        record = super().finish(result)
        if self._sizes is not None:
            self._refuse_kept_fakes(record, result)
        return record

    def _refuse_kept_fakes(self, record: Record, result: Any) -> None:
        """A tensor of symbolic size exists only as a stand-in: the call's result gets real values in
        its place, but a stand-in kept anywhere else (a module attribute, the autograd graph of a
        returned tensor) would stay one."""
        returned = {id(t) for t in tree_leaves(result) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(result):
            # an output whose graph a backward pass of the call used (`return loss, out` of a training
            # step) comes back computed, without history, as a replay of a static trace returns it
            if (isinstance(tensor, FakeTensor) and tensor.requires_grad
                    and (self.live_graph is None or self.live_graph(tensor))):
                raise SymbolicTraceError(
                    f"tracejit: {self.function_name}() returns a tensor of symbolic size that requires grad "
                    f"(of shape {list(tensor.shape)}), and runs no backward pass for it. With symbolic_shape the "
                    f"call returns it computed by the program, without an autograd graph. Trace the whole "
                    f"training step, call it under torch.no_grad(), or trace with symbolic_shape=False.")
        gc.collect()  # stand-ins in reference cycles the call left behind
        # what a returned view keeps alive of its base is no stand-in in Python state
        bases = {id(t._base) for t in tree_leaves(result) if isinstance(t, torch.Tensor) and t._base is not None}
        for handle, tensor in self.handles.live().items():
            info = record.tensors[handle]
            if (isinstance(tensor, FakeTensor) and info.kind is Kind.INTERNAL and id(tensor) not in returned
                    and not any(t is tensor for t in tree_leaves(result))):
                producer = record.ops[info.producer]
                how = ("as the base of a view the call returns (return a copy: `.clone()` before the view), "
                       "or in Python state" if id(tensor) in bases else
                       "in Python state, or saved by the autograd graph of a returned tensor")
                raise SymbolicTraceError(
                    f"tracejit: {self.function_name}() keeps t{handle}, a tensor of symbolic size made by op "
                    f"#{producer.index} {producer.name} at {producer.source}, beyond the call ({how}) without "
                    f"returning it. With symbolic_shape such a tensor is a stand-in until the call returns, so it "
                    f"cannot be kept. Return it, or trace with symbolic_shape=False.")

    def left_behind(self, held: tuple[set, set[int]] = (set(), set())) -> str | None:
        """A tensor the call made that is still alive other than in `held` (storages, tensor ids),
        described, or None. Asked once the caller has dropped what only the recording held (its
        result, the frames of its error): what is left is in Python state, where a stand-in of
        symbolic size stays one and a placeholder stays unwritten unless the record runs."""
        self._allocated = []
        gc.collect()
        storages, ids = held
        record = self.tensors
        for handle, tensor in self.handles.live().items():
            if isinstance(tensor, FakeTensor) and record[handle].kind is Kind.INTERNAL and id(tensor) not in ids:
                return f"t{handle} (of symbolic size, made by {self._made_by(handle)})"
        for handle, placeholder in self._placeholders.items():
            if not placeholder.storage.expired() and placeholder.storage not in storages:
                return f"t{handle} {list(placeholder.shape)} (made by {self._made_by(handle)}, not computed yet)"
        return None

    def _made_by(self, handle: int) -> str:
        producer = self.tensors[handle].producer
        if producer is None:
            return "?"
        op = self.ops[producer]
        return f"op #{op.index} {op.name} at {op.source}"

    def real_result(self, result: Any) -> Any:
        """The call's result with each stand-in of symbolic size replaced by its computed value."""
        def real(value: Any) -> Any:
            if isinstance(value, FakeTensor):
                return self.computed(self.handles.get(value))
            return value
        return tree_map(real, result)

    # -- running the record for real --------------------------------------------------------------

    def abandon(self) -> None:
        """The call raised: run what it recorded, so the host sees the side effects eager execution had."""
        self._generator_state = None  # the error to raise is the call's own
        self._catch_up()

    def complete(self, program: Any) -> None:
        """The call returned: run its program for real and fill every placeholder still held anywhere.

        Problems are raised after the run: the tensors the host holds must be filled in any case.
        """
        reseeded = self._reseeding_error()
        self._run(program)
        if reseeded is not None:
            raise reseeded

    def _catch_up(self) -> None:
        self._raise_if_reseeded()
        snapshot = self._snapshot()
        if self._sizes is not None:  # the sizes of this call's inputs
            inputs = [self._real_inputs[h] for h in (*self.arg_handles, *sorted_kwargs(self.kwarg_handles))]
            snapshot = specialize(snapshot, self._sizes.guards().binding(inputs))
        self._run(self._compile(snapshot))
        self._stale.clear()
        self._generator_state = None
        self._executor.forget_metadata()  # the code that follows may change tensors behind the recording

    def unwritten_storages(self) -> set:
        """After a run of the program raised: the storages of placeholders held outside whose op
        never ran (see runtime/undo.StateSnapshot.restore_unwritten)."""
        return getattr(self._runner, "unwritten", set())

    def computed(self, handle: int) -> torch.Tensor:
        """The value the program computed for `handle` (a returned tensor of symbolic size)."""
        return self._runner.computed(handle)

    def _run(self, program: Any) -> None:
        self.ran_for_real = True
        inputs = self._inputs
        if self._literals:
            inputs = dict(inputs)
            for handle, ref in self._literals.items():
                tensor = ref()
                inputs[handle] = tensor if tensor is not None else self.constants[handle].clone()
        disagreements = self._runner.run(program, inputs, self._placeholders)
        if disagreements:
            raise self._prediction_error(disagreements)

    def _snapshot(self) -> Record:
        """The record so far, with the tensors alive now marked as escaped (the program must keep them)."""
        record = Record(
            function_name=self.function_name,
            tensors=[dataclasses.replace(info) for info in self.tensors],
            ops=list(self.ops),
            output=OutputSpec("none"),
            constants=dict(self.constants),
            constant_versions=dict(self.constant_versions),
            constant_storage=dict(self.constant_storage),
            arg_handles=self.arg_handles,
            kwarg_handles=dict(self.kwarg_handles),
            inference_mode=self.inference_mode,
        )
        mark_escapes(record, self.handles)
        return record

    def _prediction_error(self, disagreements: list[str]) -> SymbolicTraceError:
        listed = "\n".join(f"  {line}" for line in disagreements)
        return SymbolicTraceError(
            f"tracejit: {self.function_name}() was recorded with symbolic=True, and torch's fake (meta) "
            f"kernels predicted other strides than the real kernels produced:\n{listed}\n"
            f"The call ran its program, so the tensors it updates (parameters, buffers, optimizer state) may "
            f"hold values computed on that metadata, and the record is not kept. Trace this function with "
            f"symbolic=False (symbolic_shape=False)."
        )


def _generator_changed(since: torch.Tensor) -> bool:
    # Compared outside the call's modes: this comparison is tracejit's, not an op of the function.
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        return not torch.equal(torch.default_generator.get_state(), since)


def _describe(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{tensor.device.type} {dtype}{list(tensor.shape)}"


def _optimizer_in_stack() -> tuple[torch.optim.Optimizer, str] | None:
    """The optimizer whose step() is running on this stack, and the innermost torch.optim function."""
    frame = sys._getframe(1)
    innermost = None
    while frame is not None:
        code = frame.f_code
        if _OPTIM_DIR in code.co_filename:
            innermost = innermost or code.co_name
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.optim.Optimizer):
                return owner, innermost
        frame = frame.f_back
    return None
