"""The interposition of a traced call and the per-thread call context.

A traced call runs the user function under a `TorchDispatchMode` that sees every aten op
(forward, autograd's backward, optimizer), with hooks on the `torch.Tensor` methods that read
values on the host without reaching the dispatcher (`numpy()`, `tolist()`, `repr`) or that
should stay out of the op sequence (`item()`, `bool()`). Both delegate to the call's *handler*:
a recorder on the first call, a replayer afterwards. The handler can be swapped while the call
runs (a replay that turns into a re-record).

Why hooks and not a `TorchFunctionMode`: a function mode intercepts every torch call of the
function (each `F.linear`, each tensor method and attribute the optimizer touches) in Python,
which made checked replay ~12% slower; the hooks cost nothing except on the reads themselves.
They are installed on `torch.Tensor` only while a traced call runs, and act only on the thread
that runs it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from .collectives import run_collective
from .rng import rng_state_calls
from .source import user_location

HOST_READ_METHODS = {
    "item": "item()",
    "tolist": "tolist()",
    "numpy": "numpy()",
    "__array__": "numpy.asarray()",
    "__repr__": "repr()",
    "__format__": "format()",
    "__bool__": "bool()",
    "__float__": "float()",
    "__int__": "int()",
    "__index__": "index()",
    "__complex__": "complex()",
}


# Methods that run a Python function on every element and write the tensor's memory themselves:
# no aten op is dispatched, so a trace can neither hold the write nor replay it. Refused by name.
PER_ELEMENT_METHODS = ("apply_", "map_", "map2_")

# Shape reads never reach the dispatcher either. They are hooked only while a call is recorded
# (to set the SHAPE_READ flag): torch's own Python code reads shapes often, and a replay needs no flag.
SHAPE_READ_METHODS = ("size", "dim", "numel", "stride", "__len__")


class Handler(Protocol):
    """A recorder or a replayer. A handler with `records_shape_reads = True` also gets
    `on_shape_read(tensor)` calls, and one with `notes_grad_clears = True` gets
    `on_grad_cleared(tensor)` calls; both attributes are optional and false by default. A handler
    with an `on_hidden_read(tensor, what)` method is told of the values torch reads in C++ (see
    HIDDEN_READS); one without it is not."""

    def on_op(self, func: Any, args: tuple, kwargs: dict) -> Any: ...

    def on_host_read(self, tensor: torch.Tensor, what: str) -> None: ...

    def on_excluded_block(self) -> None: ...


class _DispatchMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps __torch_dispatch__ in a dynamo-disable shim (~3.5 us per op here); a traced
        # call never runs under torch.compile, so the shim buys nothing.
        return False

    def __init__(self, context: CallContext):
        super().__init__()
        self.context = context

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # torch.distributed: recorded as tracejit's own collective ops (a higher-order op has no _namespace)
        if getattr(func, "_namespace", None) == "c10d":
            return run_collective(self.context.handler, func, args, kwargs or {})
        traits = _TRAITS.get(func)
        if traits is None:
            traits = _TRAITS[func] = _traits(func)
        seeded, written_lists = traits
        if seeded:
            return self.context.generator.draw(func, args, kwargs or {}, self.context)
        result = self.context.handler.on_op(func, args, kwargs or {})
        if written_lists:
            _bump_versions(args, written_lists)
        return result


# op -> (draws random numbers, positions of the tensor lists it writes that need a version bump)
_TRAITS: dict[Any, tuple[bool, tuple[int, ...]]] = {}


def _traits(func: Any) -> tuple[bool, tuple[int, ...]]:
    seeded = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
    schema = getattr(func, "_schema", None)
    written = ()
    if schema is not None and schema.name.startswith("aten::_foreach_"):
        # Eager's `_foreach_` kernels bump the version counter of every tensor they write, but
        # not when the op reaches them through a dispatch mode (torch 2.13): the recorded call,
        # checked calls at the aten level and the kernels of their fused groups would leave an
        # input's version as it was, and a caller's autograd graph that saved it would not see
        # the write. (`_fused_adam_` and friends bump nothing in eager either: left alone.)
        written = tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None
                        and a.alias_info.is_write and isinstance(a.type, torch.ListType) and not a.kwarg_only)
    return seeded, written


def _bump_versions(args: tuple, positions: tuple[int, ...]) -> None:
    for i in positions:
        if i < len(args):
            torch._C._increment_version(tuple(args[i]))


class GeneratorWatch:
    """Whether anything but the call's own random ops moves the default generator during the call.

    A compiled program draws all of a call's random numbers in record order from wherever the
    generator stands when it runs. The function may move the generator by ways tracejit does
    not patch (`torch.default_generator.set_state`, `manual_seed` imported before tracing, a
    random op inside `exclude_from_trace()`), and may draw from a `torch.Generator` of its own:
    comparing the generator's state before each random op with the state after the previous one
    (and at the ends of the call) finds all of them. Each finding is a call of `rng_calls`."""

    def __init__(self, found: list, position: Any):
        self.found = found
        self.position = position
        self.state: torch.Tensor | None = None  # after the last random op, or when the call began
        self.others: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # generators passed to ops

    def begin(self) -> None:
        """Take the generator's state now as the one the next random op must find."""
        self.state = torch.default_generator.get_state()

    def draw(self, func: Any, args: tuple, kwargs: dict, context: CallContext) -> Any:
        generator = kwargs.get("generator")
        if generator is not None and generator is not torch.default_generator:
            # the function's own generator: moves between its draws matter, and one before its
            # first draw (`g.manual_seed(42)` in the call), which a program run without the
            # function would miss; where it stands when the call begins is where the program
            # starts drawing from it. Such a first move is at position -1: a program that draws
            # after the function has run (the API level, symbolic recording) draws after it too.
            known = next((key for key, (other, _) in self.others.items() if same_generator(generator, other)), None)
            if known is not None and not torch.equal(generator.get_state(), self.others[known][1]):
                self.found.append((f"the state of a torch.Generator set before {func} at {user_location()}",
                                   self.position() + 1))
            elif known is None and _moved_since_the_call_began(generator, context.handler):
                self.found.append((f"the state of a torch.Generator set in the call before its first draw, {func} "
                                   f"at {user_location()}", -1))
            result = context.handler.on_op(func, args, kwargs)
            self.others[id(generator) if known is None else known] = (generator, generator.get_state())
            return result
        now = torch.default_generator.get_state()
        if self.state is not None and not torch.equal(now, self.state):
            self.found.append((f"the generator's state set before {func} at {user_location()}", self.position()))
        result = context.handler.on_op(func, args, kwargs)
        self.state = torch.default_generator.get_state()
        return result

    def end(self) -> None:
        with _disable_current_modes():  # tracejit's comparison, no op (nor host read) of the call
            if self.state is not None and not torch.equal(torch.default_generator.get_state(), self.state):
                self.found.append(("the generator's state set after the call's last random op", self.position() + 1))
            for generator, state in self.others.values():
                if not torch.equal(generator.get_state(), state):
                    self.found.append(("the state of a torch.Generator set after its last random op",
                                       self.position() + 1))
        self.others.clear()


def _moved_since_the_call_began(generator: torch.Generator, handler: Any) -> bool:
    """Whether the generator stands elsewhere than where the call's names found it as it began."""
    names = getattr(handler, "names", None)
    found = next((state for other, _, state in getattr(names, "generators", ()) if same_generator(generator, other)),
                 None)
    return found is not None and not torch.equal(generator.get_state(), found)


def same_generator(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether two Python objects stand for one torch generator: an op's `generator=` argument
    reaches a dispatch mode as a new Python object on every op. Told by where they stand (device,
    initial seed and state): nothing else of a generator is visible without changing it, which
    another thread drawing from it would see. Two generators seeded alike and not drawn from since
    stand for each other here; where that matters, both are guarded (hostfree._generator_guards)."""
    if a is b:
        return True
    return a.device == b.device and a.initial_seed() == b.initial_seed() and torch.equal(a.get_state(), b.get_state())


class _TorchInternal(threading.local):
    reading = False  # torch's own code reads a value (not the host); a class default: read on every host read


_torch_internal = _TorchInternal()


@contextlib.contextmanager
def torch_reads_unseen() -> Iterator[None]:
    """Reads torch makes itself while tracejit works (FakeTensorMode.from_tensor memoizes a 0-d
    integer tensor's value with item() since torch 2.14) are not the function's host reads."""
    before = _torch_internal.reading
    _torch_internal.reading = True
    try:
        yield
    finally:
        _torch_internal.reading = before


def _host_read_hook(original: Any, what: str) -> Any:
    def hook(self, *args, **kwargs):
        context = current_context()
        if context is None or context.excluded or _torch_internal.reading:
            return original(self, *args, **kwargs)
        # Neither the read (numpy's detach, item's _local_scalar_dense) nor what it takes to make
        # the value real is part of the program.
        with _disable_current_modes():
            context.handler.on_host_read(self, what)
            return original(self, *args, **kwargs)

    hook.__name__ = getattr(original, "__name__", what)
    hook.__doc__ = getattr(original, "__doc__", None)
    return hook


def _per_element_hook(original: Any, name: str) -> Any:
    def hook(self, *args, **kwargs):
        context = current_context()
        if context is None or context.excluded:
            return original(self, *args, **kwargs)
        raise NotImplementedError(
            f"tracejit: {context.function_name}(): Tensor.{name}() at {user_location()} runs a Python "
            f"function on every element and writes the tensor without a torch op, which a trace can neither "
            f"record nor replay. Write it with torch ops (arithmetic on whole tensors, torch.where), or run it "
            f"inside tracejit.exclude_from_trace() (checked calls only: without_host=True refuses such a block).")

    hook.__name__ = name
    hook.__doc__ = getattr(original, "__doc__", None)
    return hook


def _notify_shape_read(tensor: torch.Tensor) -> None:
    context = current_context()
    if context is not None and not context.excluded:
        notify = getattr(context.handler, "on_shape_read", None)  # None: a replay (or another thread's)
        if notify is not None:
            notify(tensor)


def _shape_read_hook(original: Any) -> Any:
    def hook(self, *args, **kwargs):
        _notify_shape_read(self)
        return original(self, *args, **kwargs)

    hook.__name__ = getattr(original, "__name__", "shape read")
    hook.__doc__ = getattr(original, "__doc__", None)
    return hook


def _shape_property(original: Any) -> property:
    def read(self):
        _notify_shape_read(self)
        return original.__get__(self)

    return property(read, doc=getattr(original, "__doc__", None))


class TensorHooks:
    """Methods of torch.Tensor (or attributes of another `owner`: the torch module, torch._VF)
    replaced while at least one traced call on any thread needs them."""

    def __init__(self, hooks: dict[str, Any], owner: Any = torch.Tensor):
        self.hooks = hooks
        self.owner = owner
        self.originals = {name: owner.__dict__.get(name) for name in hooks}
        self.lock = threading.Lock()
        self.users = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        with self.lock:
            if self.users == 0:
                for name, hook in self.hooks.items():
                    setattr(self.owner, name, hook)
            self.users += 1
        try:
            yield
        finally:
            with self.lock:
                self.users -= 1
                if self.users == 0:
                    for name, original in self.originals.items():
                        if original is None:
                            # inherited from TensorBase, or served by torch._VF's __getattr__
                            delattr(self.owner, name)
                        else:
                            setattr(self.owner, name, original)


_GRAD = torch._C.TensorBase.grad


def _set_grad(tensor: torch.Tensor, value: Any) -> None:
    # `p.grad = None` (opt.zero_grad()) dispatches nothing: the handler notes where in the op
    # sequence it happened, so a program that raises after that point leaves `.grad` None as eager
    # does (runtime/hostfree.py, FailureEffects). A recorder also notes, before any set, whether
    # the tensor held a `.grad` (Recorder.on_grad_set: the state its call began in)
    context = current_context()
    if context is not None and not context.excluded:
        handler = context.handler
        noted = getattr(handler, "on_grad_set", None)
        if noted is not None:
            noted(tensor)
        notify = getattr(handler, "on_grad_cleared", None) if value is None else None
        if notify is not None:  # None: another thread's call that does not note them
            notify(tensor)
    _GRAD.__set__(tensor, value)


_HOST_READ_HOOKS = TensorHooks({name: _host_read_hook(getattr(torch.Tensor, name), what)
                           for name, what in HOST_READ_METHODS.items()})
_PER_ELEMENT_HOOKS = TensorHooks({name: _per_element_hook(getattr(torch.Tensor, name), name) for name in PER_ELEMENT_METHODS})
_SHAPE_READ_HOOKS = TensorHooks({
    **{name: _shape_read_hook(getattr(torch.Tensor, name)) for name in SHAPE_READ_METHODS},
    "shape": _shape_property(torch.Tensor.shape),
})
# the getter stays torch's own C function: only the setter runs Python
_GRAD_CLEAR_HOOKS = TensorHooks({"grad": property(_GRAD.__get__, _set_grad, _GRAD.__delete__, _GRAD.__doc__)})


# Hidden reads: torch functions whose C++ code reads the values of a CPU tensor argument through its
# data pointer, with no op dispatched for the read, and decides from them which ops it dispatches
# (the slices of `tensor_split`, the copies of `pad_packed_sequence`, the steps of an RNN over a
# PackedSequence). A trace sees the ops but not the read: the API level, which matches the call as a
# whole, and a program without the function would keep the recorded ops for other values. Each
# entry: the function's name on its owner, what it reads, and which argument it reads (or None).
def _tensor_indices(args: tuple, kwargs: dict) -> torch.Tensor | None:
    # tensor_split(input, tensor_indices_or_sections, dim=0); split points as ints read nothing
    return next((a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.Tensor)), None)


def _batch_sizes(args: tuple, kwargs: dict) -> torch.Tensor | None:
    # _pad_packed_sequence(data, batch_sizes, batch_first, padding_value, total_length)
    return args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else kwargs.get("batch_sizes")


def _packed_batch_sizes(args: tuple, kwargs: dict) -> torch.Tensor | None:
    # lstm/gru/rnn_*(data, batch_sizes, hx, params, ...) over a PackedSequence; the padded form
    # (input, hx, params, ...) reads nothing: its hx is a tuple (lstm) or its params come third
    if len(args) > 3 and isinstance(args[1], torch.Tensor) and isinstance(args[3], (list, tuple)):
        return args[1]
    return None


HIDDEN_READS = {
    torch: {"tensor_split": ("torch.tensor_split() reads its tensor of split points", _tensor_indices)},
    torch.Tensor: {"tensor_split": ("Tensor.tensor_split() reads its tensor of split points", _tensor_indices)},
    torch._VF: {
        "_pad_packed_sequence": ("pad_packed_sequence() reads the PackedSequence's batch_sizes", _batch_sizes),
        **{name: (f"nn.{module}() over a PackedSequence reads its batch_sizes", _packed_batch_sizes)
           for name, module in (("lstm", "LSTM"), ("gru", "GRU"), ("rnn_tanh", "RNN"), ("rnn_relu", "RNN"))},
    },
}


def _hidden_read_hook(original: Any, what: str, read_argument: Any, notice: str = "on_hidden_read") -> Any:
    """`original`, telling the handler of a traced call (its method `notice`, if it has one) of
    the tensor `read_argument` finds in the arguments."""
    def hook(*args, **kwargs):
        context = current_context()
        if context is not None and not context.excluded:
            tensor = read_argument(args, kwargs)
            notify = getattr(context.handler, notice, None)
            if tensor is not None and notify is not None:
                notify(tensor, what)
        return original(*args, **kwargs)

    hook.__name__ = getattr(original, "__name__", what)
    hook.__doc__ = getattr(original, "__doc__", None)
    return hook


_HIDDEN_READ_HOOKS = tuple(
    TensorHooks({name: _hidden_read_hook(getattr(owner, name), what, read) for name, (what, read) in entries.items()},
                owner=owner)
    for owner, entries in HIDDEN_READS.items())


class CallContext:
    """State of one traced call in progress on this thread."""

    def __init__(self, trace: Any, handler: Handler, capture_as_const: bool):
        self.trace = trace
        self.handler = handler
        self.capture_as_const = capture_as_const
        self.excluded = 0
        # torch.manual_seed(), set_rng_state()... made during the call, with the ops dispatched by then
        self.rng_calls: list[tuple[str, int]] = []
        self.generator = GeneratorWatch(self.rng_calls, lambda: _ops_so_far(self.handler))

    @property
    def function_name(self) -> str:
        return self.trace.__name__


class _Local(threading.local):
    context: CallContext | None = None  # read on every call: a class default, never a failed lookup


_local = _Local()


def current_context() -> CallContext | None:
    return _local.context


@contextlib.contextmanager
def _handler_hooks(handler: Handler) -> Iterator[None]:
    """The hooks a handler asks for besides the host reads' (see Handler): shape reads, `.grad` clears."""
    with contextlib.ExitStack() as hooks:
        if getattr(handler, "records_shape_reads", False):
            hooks.enter_context(_SHAPE_READ_HOOKS.installed())
        if getattr(handler, "notes_grad_clears", False):
            hooks.enter_context(_GRAD_CLEAR_HOOKS.installed())
        yield


# Reads torch skips on a stand-in: aten::one_hot checks the range of its input's values (an
# aminmax and two host reads) on every real tensor, but skips the check on a FakeTensor. A trace
# recorded on the stand-ins of symbolic_shape would lack ops that every real call runs, so a handler
# with an `on_stand_in_read(tensor, what)` method is told of the input and refuses it when it is a
# stand-in (record/symbolic.py); on real tensors the reads are dispatched and seen as usual.
def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


def _stand_in_read_hook(original: Any, what: str) -> Any:
    return _hidden_read_hook(original, what, _first_tensor, notice="on_stand_in_read")


_ONE_HOT = "one_hot() checks the range of its input's values"
# F.one_hot is torch._C._nn.one_hot: both names, as code may reach it through either
_STAND_IN_READ_HOOKS = tuple(
    TensorHooks({"one_hot": _stand_in_read_hook(owner.__dict__["one_hot"], _ONE_HOT)}, owner=owner)
    for owner in (torch.nn.functional, torch._C._nn))


@contextlib.contextmanager
def _hidden_read_hooks() -> Iterator[None]:
    with contextlib.ExitStack() as hooks:
        for owner_hooks in (*_HIDDEN_READ_HOOKS, *_STAND_IN_READ_HOOKS):
            hooks.enter_context(owner_hooks.installed())
        yield


@contextlib.contextmanager
def traced_call(context: CallContext) -> Iterator[CallContext]:
    """Run a block as a traced call: install both modes and the thread's call context."""
    outer = check_not_nested(context.function_name)
    _local.context = context
    try:
        with _HOST_READ_HOOKS.installed(), _PER_ELEMENT_HOOKS.installed(), _hidden_read_hooks(), \
                _handler_hooks(context.handler), \
                rng_state_calls(context.rng_calls, lambda: _ops_so_far(context.handler)), _DispatchMode(context):
            context.generator.begin()
            yield context
            context.generator.end()
    finally:
        _local.context = outer


class _Composite(TorchFunctionMode):
    """A torch function mode that only passes calls on: its presence is what turns torch's fused
    attention fast path off (see _composite_attention)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _composite_attention(forward: Any) -> Any:
    """nn.MultiheadAttention and the Transformer encoder layers run one fused aten op
    (`_native_multi_head_attention`, `_transformer_encoder_layer_fwd`, a nested tensor for a padding
    mask) in eval under no_grad, unless a torch function mode is active. Checked calls at the API
    level run under one (the checker), so a call that records or replays at the aten level must
    take the same path, the composite one: their forward runs under a pass-through mode there.
    Thread-local, as the mode stack is; eager calls and excluded blocks keep the fast path."""
    @functools.wraps(forward)
    def composite(module, *args, **kwargs):
        context = _local.context
        if context is None or context.excluded or torch._C._is_torch_function_mode_enabled():
            return forward(module, *args, **kwargs)
        with _Composite():
            return forward(module, *args, **kwargs)
    composite.__tracejit_composite__ = True
    return composite


for _attention in (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerEncoder):
    if not getattr(_attention.forward, "__tracejit_composite__", False):
        _attention.forward = _composite_attention(_attention.forward)


def _ops_so_far(handler: Any) -> int:
    ops = getattr(handler, "ops", None)  # a recorder; a replayer counts its position
    return len(ops) if ops is not None else getattr(handler, "position", 0)


def enter_api_checked_call(context: CallContext) -> CallContext | None:
    """Make `context` the thread's call context for a call checked at the torch API level (no
    dispatch mode and no hooks: the checker, a TorchFunctionMode, sees every torch call); returns
    the outer context, for `leave_api_checked_call` (in a `finally`)."""
    outer = _local.context  # check_not_nested's test, inline: this runs on every checked call
    if outer is not None and not outer.excluded:
        check_not_nested(context.function_name)
    _local.context = context
    return outer


def leave_api_checked_call(outer: CallContext | None) -> None:
    _local.context = outer


def check_not_nested(function_name: str) -> CallContext | None:
    """Refuse a traced call inside another one (outside an excluded block); return the context."""
    outer = current_context()
    if outer is not None and not outer.excluded:
        raise RuntimeError(
            f"tracejit: {function_name}() was called while {outer.function_name}() is being "
            f"traced. Nested traced functions are not supported: call the inner function undecorated "
            f"(its ops become part of the outer trace), or call it inside tracejit.exclude_from_trace()."
        )
    return outer


def is_tracing() -> bool:
    """True inside a traced call (recording or replaying), False inside exclude_from_trace()."""
    context = _local.context
    return context is not None and not context.excluded


@contextlib.contextmanager
def exclude_from_trace() -> Iterator[None]:
    """Run the block eagerly on every call, outside the trace.

    The block may read traced tensors (they are real by the time it runs) and may modify them in
    place; tensors it creates enter the trace as external inputs wherever later code uses them.
    """
    context = current_context()
    if context is None or context.excluded:
        yield
        return
    if context.capture_as_const:
        raise RuntimeError(
            f"tracejit: exclude_from_trace() inside {context.function_name}(), which is traced with "
            f"capture_as_const=True. A graph with captured constants must be self-contained; move the "
            f"excluded code out of the traced function or trace without capture_as_const."
        )
    context.excluded += 1
    try:
        with _suspended_modes():
            context.handler.on_excluded_block()
            yield
    finally:
        context.excluded -= 1
        # the block's own draws run eagerly at their place (checked calls stay at the aten level
        # around such a block; a symbolic recording realizes the draws before it first)
        context.generator.begin()


def _suspended_modes():
    return _disable_current_modes()
