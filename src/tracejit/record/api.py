"""The torch-level calls of a host-run call: what checked replay at the API level matches.

While a checked replay runs at the aten level (every op dispatched, matched and computed), an
`ApiTracer` (a `TorchFunctionMode`) notes each torch-level call the function makes: `F.linear`,
`loss.backward()`, `torch._fused_adam_`, a `p.grad` read. For each it keeps the function, its
arguments with every tensor replaced by a reference (an input, an external object, or the handle
of a value the trace computes), what it returned, and the span of aten ops it dispatched.

Later calls can then run the function under `runtime/api_replay.py`'s checker, which matches the
calls by position and answers them without computing anything; the host-free program computes.
That is sound only for programs whose Python side the checker can stand in for, so the tracer
also decides whether the trace is *replayable at the API level* and says why not when it is not:
Python code running inside `backward()` (hooks, custom autograd functions, checkpointing), calls
that change state the checker does not model, tensors it cannot follow, the RNG reseeded.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..signature import attention_backends, autocast_state
from .amp import is_inf_check
from .calls import data_dependent_size
from .function_calls import FunctionCall, FunctionCalls
from .modes import _HIDDEN_READ_HOOKS, _HOST_READ_HOOKS, _STAND_IN_READ_HOOKS, HOST_READ_METHODS
from .module_calls import ModuleCall, ModuleCalls
from .optimizer_calls import OptimizerCall, OptimizerCalls
from .record import Flag, HostRead, Kind, Record
from .source import SourceLocation, user_location

# Values an answer may hold as recorded (anything else is run for real, or refused).
PLAIN_TYPES = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout,
               torch.memory_format, slice, type(Ellipsis))

# Calls that change state outside the tensors the program computes: replaying them virtually would
# lose the change, running them for real would change it before the check is done. (`Tensor.set_`
# reaches no torch function mode: trace.py refuses a record with its aten op.)
STATE_CHANGES = frozenset({
    "requires_grad_", "retain_grad", "register_hook", "register_post_accumulate_grad_hook", "share_memory_",
    "_fix_weakref", "__setstate__", "resize_", "__set_name__",
})
# Calls without tensor effects that must happen when the function runs (grad mode, profiler ranges).
RUN_FOR_REAL = frozenset({"_set_grad_enabled", "_record_function_enter_new", "_record_function_exit",
                          "_record_function_enter", "is_grad_enabled"})
HOST_READS = frozenset(HOST_READ_METHODS)
BACKWARD = frozenset({"Tensor.backward", "backward", "grad", "_engine_run_backward"})
_C10D_MODULE = "torch.distributed.distributed_c10d"  # where dist.all_reduce & co. live


def _watch_state_reads(note: Callable[[], None]) -> list:
    """Wrap torch.get_rng_state (torch's and torch.random's bindings) to call `note` first."""
    patched = []
    for module in (torch, torch.random):
        original = module.get_rng_state

        def read(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
            note()
            return __original(*args, **kwargs)

        module.get_rng_state = read
        patched.append((module, original, read))
    return patched


def _unwatch_state_reads(patched: list) -> None:
    for module, original, read in patched:
        if module.get_rng_state is read:
            module.get_rng_state = original


class RefKind:
    INPUT = "input"  # the i-th tensor input of the call (positional, then keyword by name)
    EXTERNAL = "external"  # an object from outside the call, held weakly
    VALUE = "value"  # a value the trace computes (handle)
    LITERAL = "literal"  # a tensor made from Python data each call (torch.tensor(1.0)): equal values


@dataclass(frozen=True)
class TensorRef:
    kind: str
    key: Any  # input index, external slot, or handle


class CallKind:
    COMPUTE = "compute"  # dispatched aten ops: answered from references, the program computes
    HOST_READ = "host_read"  # item(), bool(), tolist()...: the value is computed when read (a slice)
    VIRTUAL = "virtual"  # no aten ops: answered as recorded (metadata, .grad reads and writes)
    REAL = "real"  # no aten ops, no state: run for real (grad mode, profiler ranges, grouping helpers)


@dataclass
class ApiCall:
    index: int
    func: Any
    name: str
    kind: str
    span: tuple[int, int]  # aten positions [start, end)
    args: Any  # args with tensors as TensorRef
    kwargs: dict
    result: Any  # result with tensors as TensorRef (COMPUTE, VIRTUAL)
    source: SourceLocation
    read: tuple[int, int] | None = None  # HOST_READ: (ops before the read, handle read)
    # HOST_READ: the tensor read required grad (its repr() then shows `grad_fn=<...>`)
    read_requires_grad: bool = False
    requires_grad: bool | None = None  # a requires_grad_ that changed nothing: the flag it kept
    # the autocast state it was made under (signature.autocast_state): the function may enter or
    # leave autocast itself, which changes what a call dispatches without reaching the mode
    autocast: tuple | None = None
    # likewise the default dtype (`torch.set_default_dtype` inside the function: what a factory or
    # a scalar promotes to) and, for attention calls, the attention kernels enabled (`sdpa_kernel`)
    default_dtype: torch.dtype | None = None
    attention: tuple | None = None


@dataclass
class ApiTrace:
    """The torch-level calls of one host-run call, and whether the API level can replay them."""

    calls: list[ApiCall] = field(default_factory=list)
    externals: list[weakref.ref] = field(default_factory=list)  # slot -> object
    # slot -> the record's handle of its object, noted while the object was alive: a gradient the
    # call frees (`zero_grad()` after the step) is gone when the API program is built
    external_handles: dict[int, int] = field(default_factory=dict)
    refused: str | None = None  # why the API level cannot replay this trace
    output: Any = None  # the call's result with tensors as TensorRef
    output_objects: Any = None  # the call's result itself, until the API program is built
    ran_backward: bool = False  # a backward pass ran inside the call (it consumed the outputs' graph)
    live_graph: Any = None  # tensor -> True if it has autograd history the call's backward did not free
    optimizer_calls: list[OptimizerCall] = field(default_factory=list)  # step()/zero_grad() spans of calls
    module_calls: list[ModuleCall] = field(default_factory=list)  # torch.nn module forwards' spans of calls
    function_calls: list[FunctionCall] = field(default_factory=list)  # gradient clipping's spans of calls
    # the literals that require grad as the call made them (`torch.tensor(data, requires_grad=True)`):
    # the answers copying them do too (runtime/api_replay.py)
    literals_requiring_grad: set[int] = field(default_factory=set)

    def refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason


def record_refusal(record: Record) -> str | None:
    """Why the API level cannot check the calls of `record`, as its ops and host reads tell; None
    if they do not. (The calls the tracer notes tell the rest.)"""
    if record.excluded_blocks:  # it runs the whole program at once; a block cuts the trace
        return f"an exclude_from_trace() block at {record.excluded_blocks[0].source} runs eager code in the middle of the call"
    dynamic = next((op for op in record.ops if data_dependent_size(op, record)), None)
    if dynamic is not None:  # its program has one output size per op; variants switch mid-call
        return f"op #{dynamic.index} {dynamic.name} at {dynamic.source} has a data-dependent output shape"
    if record.hidden_reads:  # the call is matched as a whole, by its arguments, never by their values
        read = record.hidden_reads[0]
        return (f"{read.describe()} inside torch's C++ code and chooses the ops it dispatches from those values, "
                f"which the API level would not compare")
    swap = next((op for op in record.ops if op.op.overloadpacket is torch.ops.aten.set_), None)
    if swap is not None:  # Tensor.set_ reaches no torch function mode: the checker would not see it
        return (f"op #{swap.index} {swap.name} at {swap.source} makes a tensor use other memory (Tensor.set_), "
                f"which the API level cannot follow")
    check = next((r for r in record.host_reads if is_inf_check(r.what)), None)
    if check is not None:  # an overflow moves the call to another variant mid-call (runtime/replay.py)
        return (f"GradScaler checks for inf on the host at {check.source}, so the optimizer step may be skipped "
                f"mid-call (an optimizer taking the scaler on the device, such as Adam(fused=True), has no such check)")
    array = next((r for r in record.host_reads if array_in_use(record, r)), None)
    if array is not None:
        return (f"the host takes {array.what} of t{array.handle} at {array.source}, an array over its memory, which "
                f"the program reads, returns or keeps after the function ran: a write through the array would not "
                f"reach the program")
    return None


ARRAY_READS = frozenset({"numpy()", "numpy.asarray()"})  # host reads that hand out the tensor's own memory


def array_in_use(record: Record, read: HostRead) -> bool:
    """Whether a write through the array a host read hands out (`y.numpy()[0] = 1`) would be lost at
    the API level: the array is over the value the read computed on its own, and over the real
    memory of an input or external only while the function runs, before the program. It matters
    where an op after the read uses that memory (any op, for memory from outside the call, which
    the program reads after the function ran) or the call returns or keeps it."""
    if read.what not in ARRAY_READS:
        return False
    tensors = record.tensors
    root = _storage_root(tensors, read.handle)
    sharing = {info.handle for info in tensors if _storage_root(tensors, info.handle) == root}
    if tensors[root].kind is Kind.INTERNAL and any(tensors[h].flags & (Flag.RETURNED | Flag.ESCAPED) for h in sharing):
        return True
    after = read.position if tensors[root].kind is Kind.INTERNAL else 0
    return any(sharing.intersection(op.inputs) or sharing.intersection(op.mutated) for op in record.ops[after:])


def _storage_root(tensors: list, handle: int) -> int:
    while tensors[handle].base is not None:
        handle = tensors[handle].base
    return handle


def function_name(func: Any) -> str:
    """A readable name: `linear`, `Tensor.add_`, `TensorBase.grad.__get__`."""
    owner = getattr(func, "__self__", None)
    if type(owner).__name__ == "getset_descriptor":
        return f"{owner.__objclass__.__name__}.{owner.__name__}.{func.__name__}"
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return qualname.replace("_VariableFunctionsClass.", "").replace("_TensorBase.", "Tensor.")


def _restore_profiler(previous: Any) -> None:
    """Put back the profiler that ran before a watched backward pass: a Python function with
    sys.setprofile; cProfile's, a C profiler that sys.getprofile answers with its Profile object
    (which sys.setprofile cannot take: the next event raises TypeError in the user's code), by
    enabling it again."""
    if previous is None or callable(previous):
        sys.setprofile(previous)
        return
    sys.setprofile(None)
    enable = getattr(previous, "enable", None)
    if enable is not None:
        enable()


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TRACEJIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
# torch's own Python that runs user code or is user-visible state inside backward
_TORCH_HOOK_FILES = ("utils/hooks.py", "utils/checkpoint.py", "autograd/function.py", "nn/parallel/", "random.py",
                     "distributed/")


_OWN_WAITS = frozenset(os.path.join(_TRACEJIT_DIR, "record", name) for name in ("ranks.py", "collectives.py"))


def _foreign_frame(filename: str) -> bool:
    """True for Python code that the checker would skip: the user's, or torch's hook machinery."""
    if filename.startswith(_TRACEJIT_DIR) or filename.startswith(_STDLIB_DIR):
        return False
    if filename.startswith(_TORCH_DIR):
        return filename[len(_TORCH_DIR):].startswith(_TORCH_HOOK_FILES)
    # generated code: tracejit's own steps, frozen standard modules and the methods dataclasses and
    # namedtuples generate (`<string>`, which torch builds inside backward) are not the user's;
    # code typed at a prompt (`<stdin>`, `<ipython-input-3-...>`, `<console>`) is
    return not filename.startswith(("<tracejit", "<frozen", "<string>"))


def _kept_requires_grad(name: str, args: tuple, kwargs: dict) -> bool | None:
    """The flag a `requires_grad_` call sets where the tensor has it already (a no-op the checker
    can check and answer), else None."""
    if _short(name) != "requires_grad_" or not args or not isinstance(args[0], torch.Tensor):
        return None
    wanted = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    return bool(wanted) if type(wanted) is bool and args[0].requires_grad == wanted else None


def _code_of(callback: Any) -> Any:
    return getattr(getattr(callback, "__func__", callback), "__code__", None)


class ApiTracer(TorchFunctionMode):
    """Notes the torch-level calls of a checked replay (see module docstring)."""

    def __init__(self, replayer: Any, record: Record, args: tuple, kwargs: dict):
        super().__init__()
        self.replayer = replayer
        self.record = record
        self.trace = ApiTrace()
        self.known: dict[int, tuple[TensorRef, weakref.ref]] = {}
        inputs = [*args, *(v for _, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor))]
        for index, tensor in enumerate(inputs):
            self.known.setdefault(id(tensor), (TensorRef(RefKind.INPUT, index), weakref.ref(tensor)))
        self._profiling = False
        self._optimizer_calls = OptimizerCalls()
        self._module_calls = ModuleCalls(self)
        self._function_calls = FunctionCalls(self)

    def __enter__(self):
        self._module_calls.install()
        self._function_calls.install()
        self._state_reads = _watch_state_reads(self._read_state)
        try:
            return super().__enter__()
        except BaseException:
            self._module_calls.remove()
            self._function_calls.remove()
            _unwatch_state_reads(self._state_reads)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._module_calls.remove()
            self._function_calls.remove()
            _unwatch_state_reads(self._state_reads)

    def _read_state(self) -> None:
        """`torch.get_rng_state()` in the call: at the API level the program draws the call's random
        numbers after the function ran, so a read after a random op would return the state before it."""
        record = self.replayer.record
        if any(torch.Tag.nondeterministic_seeded in getattr(op.op, "tags", ())
               for op in record.ops[:self._position()]):
            self.trace.refuse(f"it reads the generator's state (torch.get_rng_state() at {user_location()}) "
                              f"after a random op, which the API level draws after the function has run")

    # -- the mode -------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.trace.refused is not None:
            return func(*args, **kwargs)
        func = _HOOKED.get(func, func)  # the host-read hooks of record/modes.py stand for torch's methods
        name = function_name(func)
        start = self._position()
        backward = _short(name) in BACKWARD or name == "Tensor.backward"
        kept = _kept_requires_grad(name, args, kwargs)
        reads = self.replayer.host_reads
        if backward:
            self.trace.ran_backward = True
            result = self._watch_backward(func, args, kwargs)
        else:
            result = func(*args, **kwargs)
        end = self._position()
        if self.trace.refused is not None:  # the call records again (an optimizer's branch): nothing to note
            return result
        try:
            self._note(func, name, args, kwargs, result, start, end, kept,
                       read_inside=self.replayer.host_reads != reads)
        except _Unfollowable as reason:
            self.trace.refuse(f"{name} at {user_location()}: {reason}")
        if _short(name) == "_record_function_enter_new":
            self._optimizer_calls.enter(args[0] if args else None, len(self.trace.calls) - 1)
        elif "_record_function_exit" in name:
            self._optimizer_calls.exit(len(self.trace.calls) - 1)
        return result

    def _position(self) -> int:
        if self.replayer.recorder is not None:
            self.trace.refuse("the call re-recorded")
            return len(self.replayer.recorder.ops)
        return self.replayer.position

    def _watch_backward(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run a backward pass watching for Python code the checker would not run (hooks)."""
        previous = sys.getprofile()
        if previous is not None and not callable(previous) and not hasattr(previous, "enable"):
            # a C profiler that cannot be put back afterwards (torch.profiler's with_stack=True)
            self.trace.refuse("backward() ran under a profiler of Python calls (torch.profiler with "
                              "with_stack=True) when the call was noted, which tracejit cannot watch it beside")
            return func(*args, **kwargs)
        seen: list[str] = []
        # A collection that happens to start inside backward runs gc callbacks (a profiler's, a
        # test framework's): they are not part of the step, so they and what they call are skipped.
        # So is what tracejit's own wait for a collective DDP issues in backward calls (the store
        # it posts a blocked wait to, when a peer is slow: torch.distributed's Python)
        collecting = {_code_of(callback) for callback in gc.callbacks} - {None}
        depth = 0  # > 0 while inside a gc callback or tracejit's collective wait

        def profile(frame, event, arg):
            nonlocal depth
            if event == "call":
                if depth or frame.f_code in collecting or frame.f_code.co_filename in _OWN_WAITS:
                    depth += 1
                elif not seen and _foreign_frame(frame.f_code.co_filename):
                    seen.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})")
            elif event == "return" and depth:
                depth -= 1

        sys.setprofile(profile)
        try:
            return func(*args, **kwargs)
        finally:
            _restore_profiler(previous)
            if seen:
                self.trace.refuse(f"Python code runs inside backward(): {seen[0]}")

    def finish(self, result: Any) -> ApiTrace:
        self.trace.output_objects = result  # for the kept-values check right after the call
        try:
            self.trace.output = self._template(result)
        except _Unfollowable as reason:
            self.trace.refuse(f"the function returns {reason}")
        if not self.trace.calls:
            self.trace.refuse("the function makes no torch call")
        self.trace.optimizer_calls = self._optimizer_calls.found
        self.trace.module_calls = self._module_calls.found
        self.trace.function_calls = self._function_calls.found
        return self.trace

    # -- references -----------------------------------------------------------------------------

    def _ref(self, tensor: torch.Tensor) -> TensorRef:
        """A reference to `tensor` that sticks to the object: Python's view of identity is what the
        checker compares."""
        known = self.known.get(id(tensor))
        if known is not None and known[1]() is tensor:
            return known[0]
        handle = self.replayer.handles.get(tensor)
        if handle is not None and self.record.tensors[handle].kind is Kind.INTERNAL:
            return self._remember(tensor, TensorRef(RefKind.VALUE, handle))
        if handle is not None and self.record.tensors[handle].literal:
            if tensor.requires_grad:
                self.trace.literals_requiring_grad.add(handle)
            return self._remember(tensor, TensorRef(RefKind.LITERAL, handle))
        self.trace.externals.append(weakref.ref(tensor))
        slot = len(self.trace.externals) - 1
        if handle is not None:
            self.trace.external_handles[slot] = handle
        return self._remember(tensor, TensorRef(RefKind.EXTERNAL, slot))

    def _remember(self, tensor: torch.Tensor, ref: TensorRef) -> TensorRef:
        self.known[id(tensor)] = (ref, weakref.ref(tensor))
        return ref

    def _template(self, value: Any) -> Any:
        """`value` with tensors replaced by references; raises _Unfollowable for what cannot be kept."""
        if isinstance(value, torch.Tensor):
            return self._ref(value)
        if isinstance(value, PLAIN_TYPES):
            return value
        if isinstance(value, torch.Size):
            return value
        if isinstance(value, (list, tuple)):
            items = [self._template(v) for v in value]
            if type(value) in (list, tuple):
                return type(value)(items)
            if isinstance(value, tuple) and hasattr(type(value), "n_fields"):  # torch.return_types
                return _StructSeq(type(value), tuple(items))
            raise _Unfollowable(f"a {type(value).__name__}")
        if type(value) is dict and all(isinstance(k, str) for k in value):
            return {k: self._template(v) for k, v in value.items()}
        if isinstance(value, torch.autograd.graph.Node):
            return RecordedNode(value.name())
        raise _Unfollowable(f"a {type(value).__name__}")

    # -- classification -------------------------------------------------------------------------

    def _note(self, func: Any, name: str, args: tuple, kwargs: dict, result: Any, start: int, end: int,
              kept_requires_grad: bool | None = None, read_inside: bool = False) -> None:
        short = _short(name)
        if kept_requires_grad is not None:  # `opt.zero_grad(set_to_none=False)` on a gradient
            self.trace.calls.append(ApiCall(len(self.trace.calls), func, name, CallKind.VIRTUAL, (start, end),
                                            self._template(args), {k: self._template(v) for k, v in kwargs.items()},
                                            self._template(result), user_location(),
                                            requires_grad=kept_requires_grad))
            return
        if short in STATE_CHANGES or (short == "__set__" and ".grad." not in name):
            raise _Unfollowable("it changes state the API-level replay does not model")
        if getattr(func, "__module__", None) == _C10D_MODULE:  # dist.all_reduce(p.grad), dist.broadcast(...)
            raise _Unfollowable("the function issues this collective itself, which at the API level would run on "
                                "placeholder tensors before the program computes them (only the collectives of a "
                                "DistributedDataParallel call answered whole are replayed there)")
        index = len(self.trace.calls)
        source = user_location()
        if short in HOST_READS and args and isinstance(args[0], torch.Tensor):
            handle = self.replayer.handles.get(args[0])
            if handle is None:
                raise _Unfollowable("reads a tensor the trace does not know")
            self.trace.calls.append(ApiCall(index, func, name, CallKind.HOST_READ, (start, end),
                                            self._template(args), self._template(kwargs), None, source,
                                            read=(start, handle), read_requires_grad=args[0].requires_grad))
            return
        if short in RUN_FOR_REAL:
            kind = CallKind.REAL
        elif end > start:
            kind = CallKind.COMPUTE
            if read_inside:
                # torch read a tensor's value to pass it on as a number (`p.add_(g, alpha=lr)` with a
                # tensor lr): the program would pass the number the record read, whatever it holds now
                raise _Unfollowable("it reads a tensor's value on the host inside the call (a tensor passed "
                                    "where torch takes a number)")
        else:
            kind = CallKind.VIRTUAL
            if read_inside:
                # torch.equal, torch.allclose, is_nonzero: a Python answer from the tensors' values,
                # which the recorded answer would stand for on every call
                raise _Unfollowable("it answers from tensor values it reads on the host inside the call")
        if kind is CallKind.COMPUTE or kind is CallKind.VIRTUAL:
            try:
                template_args = self._template(args)
                template_kwargs = {k: self._template(v) for k, v in kwargs.items()}
                template_result = self._template(result)
            except _Unfollowable:
                if kind is CallKind.COMPUTE:
                    raise
                # helpers such as torch._group_tensors_by_device_and_dtype: pure, run for real
                kind, template_args, template_kwargs, template_result = CallKind.REAL, None, None, None
        else:
            template_args = template_kwargs = template_result = None
            if short == "_set_grad_enabled" and len(args) == 1 and type(args[0]) is bool and not kwargs:
                template_args = (args[0],)  # the mode decides what the calls after it record
        self.trace.calls.append(ApiCall(index, func, name, kind, (start, end), template_args, template_kwargs,
                                        template_result, source, autocast=autocast_state(),
                                        default_dtype=torch.get_default_dtype(),
                                        attention=attention_backends() if "attention" in short else None))


# hook -> the torch.Tensor method it wraps, as the checker sees it called (no hooks installed then);
# the hidden-read hooks too (`x.tensor_split(2)` reaches the mode as the hook while one is installed)
_HOOKED = {hook: _HOST_READ_HOOKS.originals.get(name) or getattr(torch._C.TensorBase, name)
           for name, hook in _HOST_READ_HOOKS.hooks.items()}
_HOOKED.update({hook: hooks.originals.get(name) or getattr(torch._C.TensorBase, name)
                for hooks in _HIDDEN_READ_HOOKS if hooks.owner is torch.Tensor for name, hook in hooks.hooks.items()})
# torch's C++ names a function to the mode by looking it up on its module (torch._C._nn.one_hot):
# while the stand-in-read hooks are installed, that is the hook, which has already run by then
_HOOKED.update({hook: hooks.originals[name] for hooks in _STAND_IN_READ_HOOKS for name, hook in hooks.hooks.items()})


class _Unfollowable(Exception):
    pass


@dataclass(frozen=True)
class _StructSeq:
    """A torch.return_types result (values, indices), rebuilt as its type on replay."""

    type: type
    items: tuple


@dataclass(frozen=True)
class RecordedNode:
    """Stands for the `grad_fn` a replayed value had when recorded (the replay builds no graph)."""

    recorded_name: str

    def name(self) -> str:
        return self.recorded_name

    def __repr__(self) -> str:
        return f"<{self.recorded_name} (recorded)>"


StructSeq = _StructSeq
