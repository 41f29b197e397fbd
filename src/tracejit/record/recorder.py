"""The recording handler: runs each op eagerly and appends it to the record."""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from .amp import INF_CHECK, in_grad_scaler
from .calls import (
    HOST_VALUE_OPS,
    aliases_its_input,
    depends_on_grad_mode,
    is_ignored_op,
    may_copy,
    mutated_tensors,
    promotes_to_default_dtype,
    split_call,
)
from .handles import HandleMap
from .names import ExternalNames, is_lazy
from .optimizer_calls import setting_read_by_step
from .ranks import agree_on_collectives
from .record import (
    ExcludedBlock,
    Flag,
    HiddenRead,
    HostRead,
    Kind,
    OpRecord,
    OutputSpec,
    Record,
    TensorInfo,
    TensorMeta,
    container_rebuild,
)
from .regions import RegionTracker
from .source import user_location

_LITERAL_OPS = frozenset(
    {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default, torch.ops.aten.lift.default}
)


def snapshot_literal(tensor: torch.Tensor) -> torch.Tensor:
    """A private copy of a literal (`torch.tensor(data)`) as the call made it: what every call
    without the function starts from. The record never hands it out (programs and the API level
    give the function and the caller copies of it)."""
    if isinstance(tensor, FakeTensor):
        return tensor
    with torch._C.DisableTorchFunction(), torch.no_grad():
        return tensor.detach().clone(memory_format=torch.preserve_format)



def _busy_calling(name: str) -> Any:
    """A handler method that calls the (overridable) method `name` with the recorder marked busy:
    shape reads made meanwhile are tracejit's own, not the host's (see on_shape_read)."""
    def handler(self, *args: Any) -> Any:
        self._busy += 1
        try:
            return getattr(self, name)(*args)
        finally:
            self._busy -= 1

    handler.__name__ = name.lstrip("_")
    return handler

class Recorder:
    """Builds a `Record` from the ops of one call.

    A recorder can also *resume* a record: a replay that diverges from a provisional record
    hands over its handle map and the matched prefix, and recording continues from there (shape
    reads after that point are not flagged: the hooks that see them are installed per call).
    """

    records_shape_reads = True
    notes_grad_clears = True

    def __init__(self, function_name: str, *, capture_as_const: bool, external_names: ExternalNames):
        self.function_name = function_name
        self.capture_as_const = capture_as_const
        self.names = external_names
        self.tensors: list[TensorInfo] = []
        self.ops: list[OpRecord] = []
        self.handles = HandleMap()
        self.host_reads: list[HostRead] = []
        self.outside_reads: list[HostRead] = []
        self.hidden_reads: list[HiddenRead] = []
        self.excluded_blocks: list[ExcludedBlock] = []
        # (ops before it, the tensor whose `.grad` Python set to None: its handle, or a weak
        # reference while no op has used it yet)
        self.grad_clears: list[tuple[int, int | weakref.ref]] = []
        # whether each leaf from outside the call held a `.grad` when the call began, by handle: as
        # at its first use, or before the function first set its `.grad` if that came earlier
        # (`opt.zero_grad()` before the forward); see grad_at_start
        self._grads_at_first_use: dict[int, bool] = {}
        self._grads_before_set: dict[int, tuple[weakref.ref, bool]] = {}  # id(tensor) -> (it, held a .grad)
        self.constants: dict[int, torch.Tensor] = {}
        self.constant_versions: dict[int, int] = {}
        self.constant_storage: dict[int, int] = {}
        self.arg_handles: tuple[int, ...] = ()
        self.kwarg_handles: dict[str, int] = {}
        self.rerecorded = False
        self.regions = RegionTracker()
        self.storages: dict[int, StorageWeakRef] = {}  # internal handle -> its memory, held weakly
        # Handles below this existed when the last exclude_from_trace() block began: a use after it
        # takes the tensor as a new external (a cut, see _cut).
        self.cut_below = 0
        self._busy = 0  # inside a handler method: shape reads are tracejit's own, not the host's
        # the memory of the call's inputs and externals (handle -> bytes): an external found in one
        # of them (a parameter's .grad, a view of a flat buffer the call takes) is a view of it
        self._outer_spans: dict[int, tuple[int, int]] = {}
        # torch.inference_mode() when the call began; each op notes its own (the function may enter it)
        self.inference_mode = torch.is_inference_mode_enabled()
        self.default_dtype = torch.get_default_dtype()  # the caller's: programs run under it

    # -- inputs ---------------------------------------------------------------------------------

    def bind_inputs(self, args: tuple, kwargs: dict, arg_names: list[str]) -> None:
        self.arg_handles = tuple(
            self._new_handle(t, Kind.ARG, arg_names[i]) for i, t in enumerate(args)
        )
        self.kwarg_handles = {
            name: self._new_handle(value, Kind.KWARG, name)
            for name, value in kwargs.items()
            if isinstance(value, torch.Tensor)
        }
        for handle, tensor in zip(self.arg_handles, args):
            self.tensors[handle].storage_offset = tensor.storage_offset()
        for name, handle in self.kwarg_handles.items():
            self.tensors[handle].storage_offset = kwargs[name].storage_offset()
        self._share_overlapping_inputs(args, kwargs)

    def _share_overlapping_inputs(self, args: tuple, kwargs: dict) -> None:
        """Inputs whose memory overlaps (`f(a, a.t())`, `f(x[1:], x[:-1])`) become views of one base:
        a write through one makes new versions of the others, and the passes see one storage (a fused
        kernel must not read one while it writes the other). The input signature (shared_memory)
        pins which inputs overlap, so every call of this trace has the same overlap."""
        inputs = list(zip(self.arg_handles, args, strict=True))
        inputs += [(self.kwarg_handles[name], v) for name, v in kwargs.items() if name in self.kwarg_handles]
        # an object passed twice (`step(x, x)`) is one handle, its last: the others are never read
        inputs = [(h, t) for h, t in inputs if self.handles.get(t) == h]
        for handle, base in _overlapping_input_bases(inputs).items():
            self.tensors[handle].base = base
        for handle, tensor in inputs:
            span = byte_span(tensor)
            if span is not None:
                self._outer_spans[handle] = span

    @classmethod
    def resume(cls, record: Record, position: int, handles: HandleMap, external_names: ExternalNames,
               capture_as_const: bool, regions: RegionTracker, scalars: list,
               literal_values: dict[int, torch.Tensor] | None = None,
               grad_clears: list | None = None) -> Recorder:
        """Continue `record` from op `position`, with the handles a replay bound so far and the
        dynamic scalars it saw (`scalars`, flat): the matched ops keep this call's values, and the
        `.grad` clears the replay noted (`grad_clears`; None: it did not note them, the record's
        before `position` stand)."""
        recorder = cls(record.function_name, capture_as_const=capture_as_const, external_names=external_names)
        first_dropped = _first_handle_created_from(record, position)
        recorder.tensors = [_copy_info(info) for info in record.tensors[:first_dropped]]
        recorder.ops = []
        offset = 0
        for op in record.ops[:position]:
            observed = tuple(scalars[offset:offset + len(op.scalars)])
            recorder.ops.append(replace(op, scalars=observed) if observed != op.scalars else op)
            offset += len(op.scalars)
        handles.drop_from(first_dropped)
        recorder.handles = handles
        recorder.host_reads = [r for r in record.host_reads if r.position <= position]
        recorder.outside_reads = [r for r in record.outside_reads if r.position <= position]
        recorder.hidden_reads = [r for r in record.hidden_reads if r.position <= position]
        recorder.excluded_blocks = [b for b in record.excluded_blocks if b.position <= position]
        recorder.grad_clears = list(grad_clears) if grad_clears is not None else [
            clear for clear in record.grad_clears if clear[0] <= position]
        recorder.cut_below = recorder.excluded_blocks[-1].handles if recorder.excluded_blocks else 0
        recorder.constants = {h: t for h, t in record.constants.items() if h < first_dropped}
        recorder.constant_versions = {h: v for h, v in record.constant_versions.items() if h < first_dropped}
        recorder.constant_storage = {h: v for h, v in record.constant_storage.items() if h < first_dropped}
        # A literal (torch.tensor(1.0)) is made anew by every call: the matched prefix bound this
        # call's object to its handle, and the record keeps a copy of it as this call made it (the
        # replay copied those the record writes when it bound them, `literal_values`; the others
        # are still as made).
        bound = handles.live()
        for handle in recorder.constants:
            if record.tensors[handle].literal and handle in bound:
                made = (literal_values or {}).get(handle)
                recorder.constants[handle] = made if made is not None else snapshot_literal(bound[handle])
        recorder.arg_handles = record.arg_handles
        recorder.kwarg_handles = dict(record.kwarg_handles)
        recorder.rerecorded = True
        recorder.inference_mode = record.inference_mode
        recorder.regions = regions
        return recorder

    def _new_handle(self, tensor: torch.Tensor, kind: Kind, name: str, producer: int | None = None,
                    base: int | None = None, literal: bool = False) -> int:
        handle = len(self.tensors)
        self.tensors.append(
            TensorInfo(handle, kind, TensorMeta.of(tensor), name, producer=producer, base=base, literal=literal)
        )
        self.handles.set(tensor, handle)
        return handle

    def _input_handle(self, tensor: torch.Tensor, op: Any, index: int) -> int:
        handle = self.handles.get(tensor)
        if handle is not None:
            return handle if handle >= self.cut_below else self._cut(tensor, handle)
        literal = op in _LITERAL_OPS
        name = "literal" if literal else self.names.name_of(tensor) or f"first used by op #{index} {op}"
        if literal:
            # The record keeps a copy of the literal as the call made it: the call's own tensor is
            # the function's (it may write it, return it, keep it), and every later call makes its own.
            handle = self._new_handle(tensor, Kind.CONST, name, literal=True)
            self.constants[handle] = snapshot_literal(tensor)
            return handle
        if self.capture_as_const:
            handle = self._new_handle(tensor, Kind.CONST, name)
            self.constants[handle] = tensor
            self.constant_versions[handle] = version_of(tensor)
            self.constant_storage[handle] = storage_address(tensor)
            return handle
        handle = self._new_handle(tensor, Kind.EXTERNAL, name, base=self._overlapped(tensor))
        if self.cut_below:  # made by an excluded block, say: a later call's block may pass an older tensor
            self.tensors[handle].cut = self.cut_below
        if tensor.is_leaf:
            before = self._grads_before_set.get(id(tensor))
            held = before[1] if before is not None and before[0]() is tensor else tensor.grad is not None
            self._grads_at_first_use[handle] = held
        return handle

    def grad_at_start(self, handle: int) -> bool | None:
        """Whether the leaf external `handle` held a `.grad` when the call began (None: unknown, not
        a leaf external of this recording). The call itself creates gradients, and may clear or set
        them before its first use of the tensor: what selects the trace for later calls is the state
        a call starts in (signature.reached_gradient_state)."""
        return self._grads_at_first_use.get(handle)

    def _overlapped(self, tensor: torch.Tensor) -> int | None:
        """The base of the input or external whose memory a new external overlaps, if any; notes the
        new one's memory. Without it the passes took them for two storages: a write through one
        did not order the other's reads (CSE merged two `flat.sum()` around `p.grad.mul_(2)`)."""
        span = byte_span(tensor) if not isinstance(tensor, FakeTensor) else None
        if span is None:
            return None
        start, end = span
        other = next((h for h, (a, b) in self._outer_spans.items() if start < b and a < end), None)
        self._outer_spans[len(self.tensors)] = span  # the handle about to be made
        if other is None:
            return None
        info = self.tensors[other]
        return info.base if info.base is not None else other

    def _cut(self, tensor: torch.Tensor, handle: int) -> int:
        """A tensor alive when the last excluded block began, used after it: the block may have
        replaced it (`x = -x`) or changed it, so from here on the trace takes it as an external
        input, whatever tensor the host has there on a later call (MegEngine's excluded regions
        cut the trace the same way). A view stays a view of its base's cut, so aliasing is known."""
        info = self.tensors[handle]
        base = None
        if info.base is not None and tensor._base is not None:
            base_handle = self.handles.get(tensor._base)
            if base_handle is not None:
                base = base_handle if base_handle >= self.cut_below else self._cut(tensor._base, base_handle)
                base = self.tensors[base].base if self.tensors[base].base is not None else base
        block = self.excluded_blocks[-1]
        name = f"{info.label()} ({info.name}) after the exclude_from_trace() block at {block.source}"
        cut = self._new_handle(tensor, Kind.EXTERNAL, name, base=base)
        self.tensors[cut].cut = self.cut_below
        return cut

    # -- handler protocol -----------------------------------------------------------------------

    on_op = _busy_calling("_on_op")
    on_host_read = _busy_calling("_on_host_read")
    on_hidden_read = _busy_calling("_on_hidden_read")
    _catch_up_busy = _busy_calling("catch_up")

    def _on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if is_ignored_op(func):
            return self.regions.run(func, args, kwargs)
        if func in HOST_VALUE_OPS:
            for tensor in split_call(func, args, kwargs)[0]:  # torch.equal(a, b) reads both
                self.on_host_read(tensor, str(func))
            return func(*args, **kwargs)
        tensors, statics, scalars = split_call(func, args, kwargs)
        index = len(self.ops)
        source = user_location()
        autograd_node = torch._C._current_autograd_node()
        refuse_lazy(self.function_name, self.names, func, tensors, index, source)
        inference = torch.is_inference_mode_enabled()
        _refuse_non_strided(func, tensors, "takes", index, source)
        _refuse_non_strided_constructor(func, kwargs, index, source)
        _refuse_storage_arguments(func, args, kwargs, index, source)
        inputs = tuple(self._input_handle(t, func, index) for t in tensors)
        written = mutated_tensors(func, args, kwargs)
        self._check_const_writes(func, written, index, source)
        result = self.execute(func, args, kwargs)
        _refuse_non_strided(func, _tensors_in(result), "returns", index, source)
        outputs, out_kind, out_metas = self._register_outputs(func, result, index, inputs, tensors)
        if torch.get_default_dtype() is not self.default_dtype:
            _refuse_promotion_to_switched_default(func, tensors, out_metas, self.default_dtype, index, source)
        mutated = tuple(self.handles.get(t) for t in written)
        for handle in mutated:
            self.tensors[handle].flags |= Flag.MUTATED
        self.ops.append(
            OpRecord(index, func, statics, inputs, tuple(scalars), outputs, out_kind, out_metas, mutated, source,
                     self.regions.current(), autograd_node.name() if autograd_node is not None else None,
                     inference, torch.is_grad_enabled() if depends_on_grad_mode(func) else None)
        )
        return result

    def execute(self, func: Any, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)

    def on_shape_read(self, tensor: torch.Tensor) -> None:
        if not self._busy:
            handle = self.handles.get(tensor)
            if handle is not None:
                self.tensors[handle].flags |= Flag.SHAPE_READ

    def _on_host_read(self, tensor: torch.Tensor, what: str) -> None:
        handle = self.handles.get(tensor)
        if handle is None:  # a tensor from outside the trace: its data is real, but only with the function
            if not setting_read_by_step(tensor):
                self.outside_reads.append(HostRead(len(self.ops), -1, what, user_location()))
            return
        flag = Flag.DATA_READ if what in ("numpy()", "numpy.asarray()", "tolist()", "repr()") else Flag.VALUE_READ
        self.tensors[handle].flags |= flag
        if in_grad_scaler():
            what += INF_CHECK
        self.host_reads.append(HostRead(len(self.ops), handle, what, user_location()))

    def _on_hidden_read(self, tensor: torch.Tensor, what: str) -> None:
        self.hidden_reads.append(HiddenRead(len(self.ops), self.handles.get(tensor), what, user_location()))

    def on_grad_cleared(self, tensor: torch.Tensor) -> None:
        self.grad_clears.append(note_grad_clear(len(self.ops), tensor, self.handles))

    def on_grad_set(self, tensor: torch.Tensor) -> None:
        """Python is about to set `tensor.grad` (None or a tensor): for a tensor no op used yet, note
        whether it held one before the first such set (see grad_at_start)."""
        if self.handles.get(tensor) is None and id(tensor) not in self._grads_before_set:
            self._grads_before_set[id(tensor)] = (weakref.ref(tensor), tensor.grad is not None)

    def on_excluded_block(self) -> None:
        self.excluded_blocks.append(ExcludedBlock(len(self.ops), user_location(), len(self.tensors)))
        self.cut_below = len(self.tensors)
        self._catch_up_busy()

    def catch_up(self) -> None:
        """An excluded block begins: make what the host can see real. Nothing to do: every op ran."""

    # -- after the call (hooks for recorders that defer execution, see symbolic.py) -------------

    def abandon(self) -> None:
        """The call raised. Nothing to do: every recorded op already ran eagerly."""

    def complete(self, program: Any) -> None:
        """The call returned and `program` was built from its record. Nothing to do: every op ran."""

    # -- outputs --------------------------------------------------------------------------------

    def _register_outputs(self, func: Any, result: Any, index: int, inputs: tuple[int, ...],
                          tensors: list[torch.Tensor]) -> tuple[tuple, str, tuple]:
        if isinstance(result, torch.Tensor):
            kind, values = "tensor", [result]
        elif isinstance(result, (tuple, list)) and all(v is None or isinstance(v, torch.Tensor) for v in result):
            kind, values = ("tuple" if isinstance(result, tuple) else "list"), list(result)
        elif result is None:
            kind, values = "none", []
        else:
            kind, values = "value", []
        base = None
        declared = aliases_its_input(func)
        copying = may_copy(func)
        if declared and inputs:
            first = self.tensors[inputs[0]]
            base = first.base if first.base is not None else first.handle
        outputs, metas = [], []
        for value in values:
            if value is None:
                outputs.append(None)
                metas.append(None)
                continue
            handle = self.handles.get(value)
            if handle is None:
                if declared and copying and not _shares_memory(value, tensors):
                    view_of = None  # a copy (`contiguous` of a transposed tensor under inference_mode)
                else:
                    view_of = base if declared else self._undeclared_base(value, inputs, tensors)
                handle = self._new_handle(value, Kind.INTERNAL, f"op #{index}", producer=index, base=view_of)
                if view_of is None and not isinstance(value, FakeTensor):  # views: watched through their base
                    self.storages[handle] = StorageWeakRef(value.untyped_storage())
            outputs.append(handle)
            metas.append(TensorMeta.of(value))
        return tuple(outputs), kind, tuple(metas)

    def _undeclared_base(self, value: torch.Tensor, inputs: tuple[int, ...], tensors: list[torch.Tensor]) -> int | None:
        """The base of the input whose memory an output shares although the op's schema promises a
        new tensor: composite ops torch hands to the recorder whole under torch.inference_mode()
        return views (`broadcast_tensors`, `atleast_2d` of a vector, `meshgrid`, `einsum("ij->ji")`),
        which the memory plan took for memory of their own and overwrote the viewed input."""
        if not tensors:
            return None
        try:
            memory = value.untyped_storage()._cdata
            for handle, tensor in zip(inputs, tensors):
                if tensor.untyped_storage()._cdata == memory:
                    info = self.tensors[handle]
                    return info.base if info.base is not None else info.handle
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
            return None
        return None

    def _check_const_writes(self, func: Any, written: list[torch.Tensor], index: int, source: Any) -> None:
        for tensor in written:
            handle = self.handles.get(tensor)
            if handle is not None and self.tensors[handle].kind is Kind.CONST and not self.tensors[handle].literal:
                raise RuntimeError(
                    f"tracejit: op #{index} {func} at {source} writes into t{handle} "
                    f"({self.tensors[handle].name}), which capture_as_const=True captured as a constant. "
                    f"Constants cannot change inside the trace: trace training steps without "
                    f"capture_as_const, or put the module in eval mode (BatchNorm updates its running "
                    f"statistics in training mode)."
                )

    def output_spec(self, value: Any, path: str = "output") -> OutputSpec:
        if value is None:
            return OutputSpec("none")
        if isinstance(value, torch.Tensor):
            handle = self.handles.get(value)
            if handle is None:
                handle = self._new_handle(value, Kind.EXTERNAL, self.names.name_of(value) or path)
            elif handle < self.cut_below:
                handle = self._cut(value, handle)
            self.tensors[handle].flags |= Flag.RETURNED | Flag.ESCAPED
            return OutputSpec("tensor", handle)
        # a subclass (a namedtuple, an OrderedDict) keeps its class: calls without the function make it again
        container = type(value) if type(value) not in (tuple, list, dict) else None
        rebuild = container_rebuild(value) if container is not None and isinstance(value, (tuple, list, dict)) else None
        if isinstance(value, (tuple, list)):
            children = tuple(self.output_spec(v, f"{path}[{i}]") for i, v in enumerate(value))
            return OutputSpec("tuple" if isinstance(value, tuple) else "list", children=children,
                              container=container, rebuild=rebuild)
        if isinstance(value, dict):
            keys = tuple(value)
            children = tuple(self.output_spec(value[k], f"{path}[{k!r}]") for k in keys)
            return OutputSpec("dict", keys=keys, children=children, container=container, rebuild=rebuild)
        raise TypeError(
            f"tracejit: {self.function_name}() returned {type(value).__name__} at {path}; a traced "
            f"function returns a tensor, a tuple/list/dict of tensors, or None. Return tensors and "
            f"convert them on the host after the call (e.g. loss.item())."
        )

    def finish(self, result: Any) -> Record:
        # Inside the caller's autocast region (even one with enabled=False), torch keeps the casts
        # of the weights that an autocast region of the call made until the outermost region ends:
        # they would count as tensors the call keeps. Dropping them only costs the caller a new
        # cast of the same weights.
        torch.clear_autocast_cache()
        output = self.output_spec(result)
        record = Record(
            function_name=self.function_name,
            tensors=self.tensors,
            ops=self.ops,
            output=output,
            host_reads=self.host_reads,
            outside_reads=self.outside_reads,
            hidden_reads=self.hidden_reads,
            excluded_blocks=self.excluded_blocks,
            constants=self.constants,
            constant_versions=self.constant_versions,
            constant_storage=self.constant_storage,
            arg_handles=self.arg_handles,
            kwarg_handles=self.kwarg_handles,
            rerecorded=self.rerecorded,
            inference_mode=self.inference_mode,
            grad_clears=resolve_grad_clears(self.grad_clears, self.handles),
            outside_grad_clears=outside_grad_clears(self.grad_clears, self.handles),
        )
        held = autograd_saved(result) | self.held_storages()
        mark_escapes(record, self.handles, held, self.storages, _storages_of(result))
        agree_on_collectives(record)  # torch.distributed: every rank recorded the same collectives
        return record

    def held_storages(self) -> set[int]:
        """Storage pointers the recorder itself keeps alive past the call (not the call's state)."""
        return set()


def note_grad_clear(position: int, tensor: torch.Tensor, handles: HandleMap) -> tuple[int, int | weakref.ref]:
    """A `.grad` cleared after `position` ops; the tensor by handle once an op has used it (a
    parameter is an external only from its first use, often after `zero_grad()`)."""
    handle = handles.get(tensor)
    return position, handle if handle is not None else weakref.ref(tensor)


def resolve_grad_clears(clears: list[tuple[int, int | weakref.ref]], handles: HandleMap) -> tuple[tuple[int, int], ...]:
    """The clears by handle. A tensor no op used has none: the program cannot reach it (a
    parameter the call does not use keeps its `.grad` when a call without the function raises)."""
    resolved = []
    for position, tensor in clears:
        if not isinstance(tensor, int):
            tensor = tensor()
            tensor = handles.get(tensor) if tensor is not None else None
        if tensor is not None:
            resolved.append((position, tensor))
    return tuple(resolved)


def outside_grad_clears(clears: list[tuple[int, int | weakref.ref]], handles: HandleMap) -> tuple:
    """(ops before the first clear, weak reference) of the tensors without a handle (no op of the
    call used them) whose `.grad` the call cleared and that end the call with none: a later
    `p.grad = t` of the call's own leaves it set."""
    found: dict[int, tuple[int, weakref.ref]] = {}
    for position, tensor in clears:
        obj = tensor() if isinstance(tensor, weakref.ref) else None
        if obj is not None and handles.get(obj) is None and _GRAD_OF(obj) is None:
            found.setdefault(id(obj), (position, tensor))
    return tuple(found.values())


_GRAD_OF = torch._C.TensorBase.grad.__get__  # past any hook or mode: not a read of the function's


def mark_escapes(record: Record, handles: HandleMap, saved_for_backward: set[int] = frozenset(),
                 storages: dict[int, StorageWeakRef] | None = None, returned: set[int] = frozenset()) -> None:
    """Flag the internal tensors whose memory is still reachable after the call: Python state holds
    the tensor, or another tensor over its storage (a `.data` alias, a view). Likewise the literals
    (`torch.tensor(data)`) the call made, which the record holds only as copies: Python state that
    keeps one (`self.scale = torch.tensor(...)`) gets a new one from every call.

    Memory kept only because the autograd graph of a returned tensor saved it for a backward pass
    is not state: a call without the function returns tensors with no graph. The record *created
    state* when something outside the return value keeps memory of the call.
    """
    alive: dict[int, int] = {}  # handle -> storage pointer
    for handle, tensor in handles.live().items():
        alive[handle] = storage_address(tensor)
    for handle, ref in (storages or {}).items():
        if handle not in alive and not ref.expired():
            alive[handle] = _storage_pointer(ref)
    created_state = False
    for handle, pointer in alive.items():
        info = record.tensors[handle] if handle < len(record.tensors) else None
        if info is None or not (info.kind is Kind.INTERNAL or info.literal):
            continue
        if pointer in saved_for_backward:
            info.flags |= Flag.SAVED
            continue
        info.flags |= Flag.ESCAPED
        if not info.flags & Flag.RETURNED and pointer not in returned:
            created_state = True
    record.created_state = created_state


def _storage_pointer(ref: StorageWeakRef) -> int:
    storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
    return storage.data_ptr()


def _storages_of(result: Any) -> set[int]:
    return {storage_address(t) for t in _tensors_in(result)}


def autograd_saved(result: Any) -> set[int]:
    """Storage pointers of the memory the autograd graphs of the returned tensors hold for backward."""
    pending = [t.grad_fn for t in _tensors_in(result) if t.grad_fn is not None]
    seen_nodes: set[int] = set()
    saved: set[int] = set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:  # already freed by a backward pass
                    continue
                saved.update(storage_address(t) for t in _tensors_in(value))
        pending.extend(next_node for next_node, _ in node.next_functions)
    return saved


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    return []


def _first_handle_created_from(record: Record, position: int) -> int:
    """The smallest handle first seen at or after op `position` (handles grow in order of appearance)."""
    seen = set(record.arg_handles) | set(record.kwarg_handles.values())
    for op in record.ops[:position]:
        seen.update(op.inputs)
        seen.update(h for h in op.outputs if h is not None)
    limit = 0
    while limit in seen:
        limit += 1
    return limit


def _overlapping_input_bases(inputs: list[tuple[int, torch.Tensor]]) -> dict[int, int]:
    """Input handle -> the first handle of the group of inputs it shares memory with, for every input
    whose bytes overlap another input's (transitively). Inputs in disjoint parts of one storage
    (`f(x[0], x[1])`) stay apart, so a kernel may still write one while it reads the other."""
    spans = [(h, byte_span(t)) for h, t in inputs]
    spans = [(h, span) for h, span in spans if span is not None]
    group = {h: h for h, _ in spans}  # union-find over handles, the smallest handle representing

    def find(h: int) -> int:
        while group[h] != h:
            h = group[h]
        return h

    for i, (h, (start, end)) in enumerate(spans):
        for other, (other_start, other_end) in spans[:i]:
            if start < other_end and other_start < end:
                low, high = sorted((find(h), find(other)))
                group[high] = low
    return {h: find(h) for h, _ in spans if find(h) != h}


def byte_span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, last byte + 1) of the memory a tensor's elements occupy; None without memory."""
    if storage_address(tensor) == 0 or tensor.numel() == 0:
        return None
    if tensor.is_contiguous():  # the usual case, per external on every replayed call
        low = tensor.data_ptr()
        return low, low + tensor.nbytes
    size = tensor.element_size()
    low = high = tensor.data_ptr()
    for extent, stride in zip(tensor.shape, tensor.stride()):
        reach = (extent - 1) * stride * size
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    return low, high + size


def _copy_info(info: TensorInfo) -> TensorInfo:
    return TensorInfo(info.handle, info.kind, info.meta, info.name, info.producer, info.base,
                      info.flags & ~(Flag.ESCAPED | Flag.RETURNED), info.literal, info.cut)


def version_of(tensor: torch.Tensor) -> int:
    """A tensor's version counter; -1 for an inference tensor, which has none (made under
    torch.inference_mode(), where it may be written in place unseen)."""
    return -1 if tensor.is_inference() else tensor._version


def storage_address(tensor: torch.Tensor) -> int:
    """Where a tensor's memory is (0 for tensors without real memory: fake, meta)."""
    if isinstance(tensor, FakeTensor):  # symbolic_shape's stand-ins (asking warns)
        return 0
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _tensors_in(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [value for value in result if isinstance(value, torch.Tensor)]
    return []


def refuse_lazy(function_name: str, names: ExternalNames | None, func: Any, tensors: list[torch.Tensor], index: int,
                source: Any) -> None:
    """A parameter or buffer that a lazy module has not materialized yet (`nn.LazyLinear` before
    its first forward) has no shape and no memory. A call that finds such a module where tracejit
    looks runs eagerly, unrecorded (trace.py); one met by an op all the same (reached elsewhere, or
    left lazy by that call) is refused by name rather than crash on its missing shape."""
    for tensor in tensors:
        if is_lazy(tensor):
            name = names.name_of(tensor) if names is not None else None
            raise RuntimeError(
                f"tracejit: {function_name}(): op #{index} {func} at {source} uses "
                f"{name or 'an ' + type(tensor).__name__} of a lazy module (nn.LazyLinear, nn.LazyConv2d, ...) "
                f"that is not materialized yet. A call that finds such a module in the function's keyword "
                f"arguments, the globals and closure cells it names or their attributes runs eagerly first, "
                f"unrecorded; this one was reached elsewhere, or the call that found it did not run it. Run one "
                f"forward of the model before the traced call (`model(x)`, as torch advises before making the "
                f"optimizer).")


def _refuse_promotion_to_switched_default(func: Any, tensors: list[torch.Tensor], metas: tuple, caller: torch.dtype,
                                          index: int, source: Any) -> None:
    """An op that made a floating tensor of the default dtype from integer or bool tensors alone
    (`int_tensor * 0.1`, `int_tensor / 3`) under a default dtype the function set itself: the
    program runs its ops after the function, under the caller's default dtype, and would compute
    it in that one (float32 precision where eager had float64): refused by name."""
    default = torch.get_default_dtype()
    if not promotes_to_default_dtype(func, [t.dtype for t in tensors]):
        return
    if any(meta is not None and meta.dtype is default for meta in metas):
        raise NotImplementedError(
            f"tracejit: op #{index} {func} at {source} promotes an integer tensor to the default dtype, "
            f"{default}, which the traced function set itself ({caller} when the call began): its program "
            f"runs after the function, under the caller's default dtype, and would compute it in {caller}. "
            f"Set the default dtype before calling the traced function, or convert explicitly "
            f"(`x.to({default}) * 0.1`).")


def _refuse_non_strided(func: Any, tensors: list[torch.Tensor], verb: str, index: int, source: Any) -> None:
    """A trace holds strided tensors: handles watch storages, programs plan memory by strides and
    kernels index them. A sparse tensor (the gradient of `nn.Embedding(sparse=True)`, made inside
    `backward()`) has no storage to watch, so refuse it by name at the op rather than crash later."""
    for tensor in tensors:
        if tensor.layout is not torch.strided:
            raise _non_strided_error(func, f"{verb} a tensor of layout {tensor.layout}", index, source)


def _refuse_non_strided_constructor(func: Any, kwargs: dict, index: int, source: Any) -> None:
    """An op asked to build a sparse tensor (`_sparse_coo_tensor_with_dims_and_tensors`), refused
    before it runs: a symbolic recording's fake tensors cannot even build one."""
    layout = kwargs.get("layout")
    if isinstance(layout, torch.layout) and layout is not torch.strided:
        raise _non_strided_error(func, f"builds a tensor of layout {layout}", index, source)


def _non_strided_error(func: Any, what: str, index: int, source: Any) -> NotImplementedError:
    return NotImplementedError(
        f"tracejit: op #{index} {func} at {source} {what}: traced calls support strided (dense) "
        f"tensors only. A sparse gradient comes from nn.Embedding(sparse=True) or "
        f"F.embedding(..., sparse=True): use sparse=False (with SGD or Adam instead of SparseAdam), "
        f"or run backward() and the optimizer step inside tracejit.exclude_from_trace()."
    )


def _refuse_storage_arguments(func: Any, args: tuple, kwargs: dict, index: int, source: Any) -> None:
    """`t.set_(x.untyped_storage(), ...)` takes memory as a storage object, not a tensor: the
    record would keep this call's storage as a constant, so replays would read and write the first
    call's memory (the caller's old input). Refused by name at the op instead."""
    if any(isinstance(a, (torch.UntypedStorage, torch.TypedStorage)) for a in (*args, *kwargs.values())):
        raise NotImplementedError(
            f"tracejit: op #{index} {func} at {source} takes a storage object, whose memory a trace cannot "
            f"follow from call to call. `copy.deepcopy` of a tensor or a state_dict does this: copy with "
            f"`t.clone()` (`{{k: v.clone() for k, v in sd.items()}}`) instead. For `t.set_(x.untyped_storage(), ...)`, "
            f"make the tensor a view of the one it shares memory with (`x.as_strided(size, stride, offset)`). "
            f"Or run this code inside tracejit.exclude_from_trace().")


def _shares_memory(value: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    """Whether `value` lies in the memory of one of the op's input tensors (True when that cannot
    be told: tensors without storage)."""
    try:
        memory = value.untyped_storage()._cdata
        return any(t.untyped_storage()._cdata == memory for t in tensors if isinstance(t, torch.Tensor))
    except (RuntimeError, NotImplementedError):
        return True
