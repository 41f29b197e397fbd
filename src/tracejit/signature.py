"""Input signatures: what makes two calls share a trace."""

from __future__ import annotations

import functools
import itertools
import operator
import types
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.nn.utils.parametrize as _parametrize
from torch.utils._device import DeviceContext

from .record.names import plain_object
from .record.record import describe_math_bits, math_bits


def tensor_key(tensor: torch.Tensor) -> tuple:
    # an inference tensor (made under torch.inference_mode()) cannot be saved for backward: a
    # training step given one raises in eager, so it is another trace, whose recording raises too.
    # A negative or conjugate view (record.math_bits) is another trace too: the program of a plain
    # input would hand its memory to a fused kernel, which does not negate or conjugate.
    # An input requiring grad with a gradient hook (`x.register_hook(...)`) is 2, not 1: its backward
    # runs the hook's ops, which a call of an input without one does not (another trace, no mismatch).
    # The Python type too: a subclass's __torch_function__ decides which ops its calls dispatch.
    # And whether an input requiring grad holds a `.grad` (holds_grad): its backward stores a first
    # gradient but accumulates into one it has, other ops (`delta.grad = None` every few calls of
    # an accumulating step is another trace, as for a keyword module's parameters).
    requires_grad = tensor.requires_grad
    if requires_grad and any_gradient_hooks((tensor,)):
        requires_grad = 2
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, requires_grad, tensor.is_inference(),
            math_bits(tensor), type(tensor), requires_grad and holds_grad(tensor))


def holds_grad(tensor: torch.Tensor) -> bool:
    """Whether a tensor that requires grad holds a `.grad` (read only where one can be: a leaf, or
    a non-leaf that retains its gradient; torch warns when a non-leaf's `.grad` is read)."""
    return (tensor.is_leaf or tensor.retains_grad) and tensor.grad is not None


def input_grads(key: tuple) -> tuple[bool, ...]:
    """For each tensor input of a signature (positional, then keyword by name), whether it held a
    `.grad` when the call began (tensor_key)."""
    positional, keyword, *_ = key
    return tuple(bool(k[8]) for k in positional) + tuple(bool(k[8]) for _, k in keyword)


def signature(args: tuple, kwargs: dict) -> tuple:
    """Shapes, strides, dtypes, devices, requires_grad, math bits and Python types of the tensor inputs, and
    whether those that require grad hold a `.grad` (tensor_key); which tensor inputs are
    the same object (`step(x, x)` for an autoencoder dispatches other handles than `step(x, y)`);
    which lie in one another's memory (see shared_memory); and the training flags of keyword
    modules and all their submodules (`model.eval()`, or only `model.bn.eval()`, selects a trace of
    its own), and their classes (`loss_fn=nn.L1Loss()` after `nn.MSELoss()` runs other ops: a
    trace of its own rather than a mismatch); which function each keyword function is
    (callable_key: `loss_fn=F.l1_loss` after `F.mse_loss` is a trace of its own too, while a
    lambda made anew on every call is the same function); and the value of every bool keyword argument: a flag like `do_step` of a
    gradient-accumulation loop usually decides which ops run, so each value gets its own trace
    rather than a mismatch (other primitive values, such as a step counter, would make a trace
    per call); and the torch context of the call (call_context_key): under another grad mode,
    autocast state, default dtype or determinism the function dispatches other ops or needs
    outputs with an autograd graph, so evaluating under no_grad and training with grad are two
    traces, not a mismatch (torch.compile recompiles for them too)."""
    keyword = [(name, v) for name, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor)]
    tensors = [*args, *(v for _, v in keyword)]
    return (
        tuple(tensor_key(a) for a in args),
        tuple((name, tensor_key(v)) for name, v in keyword),
        tuple((type(v), training_flags(v)) for _, v in keyword_modules(kwargs)),
        _repeated_inputs(tensors) if len({id(t) for t in tensors}) != len(tensors) else (),
        shared_memory(tensors) if len(tensors) > 1 else (),
        tuple((name, v) for name, v in sorted(kwargs.items()) if isinstance(v, bool)),
        keyword_callables(kwargs),
        call_context_key(),
    )


def _keyword_items(kwargs: dict) -> Iterator[tuple[Callable[[], str], object]]:
    """(its expression, made when asked; value) of each keyword argument and, two levels deep, of
    the items of a keyword dict, list or tuple and the attributes of an object of the user's class
    (`st={"models": [m]}`, `trainer.model`), KEYWORD_ITEMS in all, in keyword order."""
    budget = [KEYWORD_ITEMS]  # items looked at in all (a vocabulary is not walked on every call)
    for name, value in kwargs.items():
        yield from _items_of(lambda name=name: f"kw[{name!r}]", value, 2, budget)


def _items_of(expr: Callable[[], str], value: object, depth: int,
              budget: list[int]) -> Iterator[tuple[Callable[[], str], object]]:
    budget[0] -= 1
    if budget[0] < 0:
        return
    if depth and type(value) is dict:
        for key, item in list(itertools.islice(value.items(), max(budget[0], 0))):
            if type(key) in (str, int):
                yield from _items_of(lambda expr=expr, key=key: f"{expr()}[{key!r}]", item, depth - 1, budget)
    elif depth and type(value) in (list, tuple):
        for i, item in enumerate(value[:max(budget[0], 0)]):
            yield from _items_of(lambda expr=expr, i=i: f"{expr()}[{i}]", item, depth - 1, budget)
    elif depth and plain_object(value):
        yield expr, value  # itself (a callable object of the user's class), then what it holds
        for key, item in list(itertools.islice(vars(value).items(), max(budget[0], 0))):
            if key.isidentifier() and not key.startswith("_"):
                yield from _items_of(lambda expr=expr, key=key: f"{expr()}.{key}", item, depth - 1, budget)
    else:
        yield expr, value


# the items of a keyword container looked at: a list of models or losses is, a vocabulary is not
# walked on every call
KEYWORD_ITEMS = 4096


def keyword_modules(kwargs: dict) -> list[tuple[str, torch.nn.Module]]:
    """(expression, module) of each keyword module, and of each module a keyword dict, list or
    tuple holds (`st={"model": m, "opt": o}`), and of each module whose bound method is such a
    keyword (`score_fn=head.score`), in keyword order."""
    found = []
    for expr, value in _keyword_items(kwargs):
        if isinstance(value, torch.nn.Module):
            found.append((expr(), value))
        elif type(value) is types.MethodType and isinstance(value.__self__, torch.nn.Module):
            found.append((f"{expr()}.__self__", value.__self__))
    return found


def keyword_callables(kwargs: dict) -> tuple:
    """(expression, callable_key) of each keyword function, and of each one a keyword dict, list or
    tuple holds, by keyword name."""
    if not kwargs:
        return ()
    found = []
    for expr, value in _keyword_items(dict(sorted(kwargs.items()))):
        if callable(value):
            key = callable_key(value)
            if key is not None:
                found.append((expr(), key))
    return tuple(found)


def callable_key(value: object, depth: int = 0) -> object | None:
    """What tells two functions apart for a trace: a Python function by its code (a lambda or
    closure made anew on each call runs the same code: its captured values reach the ops, which
    a checked call compares), a bound method by its function and its instance's class, a
    `functools.partial` by its function and the names it binds, a builtin (`torch.tanh`) by
    itself, a class by itself and another callable object by its class. None for values that are
    not callable, and for modules, whose class the signature has already."""
    kind = type(value)
    if kind is types.FunctionType:
        if depth >= 3 or not (value.__closure__ or hasattr(value, "__wrapped__")):
            return value.__code__
        # a decorator's wrapper, torch's boolean_dispatch (F.max_pool1d and F.max_pool2d): one code
        # object around other functions, which tell them apart
        inner = []
        for cell in value.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(contents):
                inner.append(callable_key(contents, depth + 1))
        wrapped = getattr(value, "__wrapped__", None)
        return (value.__code__, tuple(inner), callable_key(wrapped, depth + 1) if callable(wrapped) else None)
    if kind is types.MethodType:
        return ("method", callable_key(value.__func__, depth + 1), type(value.__self__))
    if kind is functools.partial:
        return ("partial", callable_key(value.func, depth + 1), len(value.args), tuple(sorted(value.keywords)))
    if kind is types.BuiltinFunctionType:
        owner = value.__self__
        return value if owner is None or type(owner) is types.ModuleType else ("builtin", type(owner), value.__name__)
    if isinstance(value, type):
        return value
    if isinstance(value, (torch.nn.Module, torch.Tensor)) or not callable(value):
        return None
    return ("object", kind)


def shared_memory(tensors: list[torch.Tensor]) -> tuple[tuple[int, int, int], ...]:
    """(input, earlier input, byte offset between them) for each tensor input that lies in the
    storage of an earlier one and is not the same object: `f(a, a.t())`, `f(x[0], x[1])`.

    With the shapes and strides, this fixes exactly which elements of the inputs overlap. The
    program was compiled for the overlap of the recorded call: a fused kernel reading one input
    while writing another gives other numbers when they overlap, where eager raises its overlap
    error or computes in its own order. Another overlap therefore records a trace of its own, and
    the eager run of that first call does what eager does."""
    first: dict[int, tuple[int, int]] = {}  # storage address -> (first input in it, its data address)
    shared = []
    for i, tensor in enumerate(tensors):
        storage = tensor.untyped_storage().data_ptr()
        if storage == 0:  # no memory at all: overlaps nothing
            continue
        j, address = first.setdefault(storage, (i, tensor.data_ptr()))
        if j != i and tensors[j] is not tensor:
            shared.append((i, j, tensor.data_ptr() - address))
    return tuple(shared)


_any_autocast = torch._C._is_any_autocast_enabled


def autocast_state() -> tuple | None:
    """None outside autocast (one C call); else each device's enabled flag and dtype: a torch call
    made under another state dispatches other ops (bf16 matmuls, casts)."""
    if not _any_autocast():
        return None
    return (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"))


_anomaly = torch.is_anomaly_enabled
_anomaly_nan = torch.is_anomaly_check_nan_enabled
_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack


def _entered_modes() -> list:
    """The TorchFunctionMode and TorchDispatchMode objects on the stacks, innermost last, without
    tracejit's own (an exclude_from_trace() block inside a traced call)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = [torch._C._get_function_stack_at(i) for i in range(_function_modes())]
    modes += _get_current_dispatch_mode_stack()
    return [mode for mode in modes if type(mode).__module__.split(".")[0] != "tracejit"]


def modes_key() -> tuple:
    """The caller's torch modes as part of the call context: `torch.device(...)` as a context
    manager, or `torch.set_default_device`, by its device (it only decides where factory calls
    put their results), any other mode by identity (see user_modes)."""
    if not (_function_modes() or _dispatch_modes()):
        return ()
    return tuple((type(m), str(m.device)) if isinstance(m, DeviceContext) else (type(m), id(m))
                 for m in _entered_modes())


def user_modes() -> list[str]:
    """The modes the caller entered that see the calls of the function (a FlopCounterMode, a
    mode of its own): their Python code runs on every torch call or aten op, changes results as
    it likes and keeps its own state, which no trace can replay; and the transforms that change
    what every op computes (a forward-mode AD level, whose dual tensors carry tangents the
    recorded ops do not; a torch.func transform: jvp, grad, vmap). Such calls run eagerly."""
    found = [what for what, on in zip(_TRANSFORMS, transforms()) if on]
    if _function_modes() or _dispatch_modes():
        found += [type(m).__qualname__ for m in _entered_modes() if not isinstance(m, DeviceContext)]
    return found


_TRANSFORMS = ("forward-mode AD (torch.autograd.forward_ad.dual_level)", "a torch.func transform (jvp, grad, vmap)",
               "torch.nn.utils.parametrize.cached()")
_functorch_stack = torch._C._functorch.peek_interpreter_stack


def transforms() -> tuple[bool, bool, bool]:
    """Whether a forward-mode AD level, a torch.func transform and the caller's
    `parametrize.cached()` are active (see user_modes). Inside `cached()`, a parametrized weight is
    computed by the first access in the block and read from the cache after, a call of the block
    before this one included: which ops a call dispatches depends on the calls before it."""
    return _forward_ad._current_level >= 0, _functorch_stack() is not None, _parametrize._cache_enabled > 0


def call_context_key() -> tuple:
    """The global state that decides which ops a torch call dispatches (grad and inference mode,
    autocast state, the autocast dtypes, default dtype, deterministic algorithms, anomaly
    detection and its NaN check, whose backward reads every gradient on the host and raises on a
    NaN, the caller's torch modes, see modes_key, and the attention backends enabled): a call made under another one may dispatch
    other ops than the trace holds. The autocast dtypes count even with autocast off: a function
    entering `torch.autocast("cpu")` without a dtype takes `torch.get_autocast_dtype("cpu")`."""
    modes = modes_key() if _function_modes() or _dispatch_modes() else ()
    dtypes = (_autocast_dtype("cpu"), _autocast_dtype("cuda") if _CUDA_BUILD else None)
    # the attention kernels torch may pick (`sdpa_kernel(SDPBackend.MATH)`: CPU's flash kernel
    # rounds otherwise)
    attention = attention_backends()
    # last: whether the caller's saved_tensors_hooks are on (see under_saved_tensor_hooks)
    hooked = _saved_hooks(False) is not None
    if not _any_autocast():  # the usual case, in one call
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), False, dtypes, False,
                torch.get_default_dtype(), _deterministic(), _anomaly() and _anomaly_nan(),
                modes, attention, transforms(), hooked)
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
            dtypes, torch.is_autocast_enabled("cuda"), torch.get_default_dtype(),
            _deterministic(), _anomaly() and _anomaly_nan(), modes, attention, transforms(), hooked)


def under_saved_tensor_hooks(context: tuple) -> bool:
    """Whether a call of this context (call_context_key) ran under the caller's
    `torch.autograd.graph.saved_tensors_hooks`: Python that runs in the call's forward and backward
    (activation offloading, compression), which the API level and a call without the function
    would skip. Such calls run at the aten level, where autograd runs the hooks and each op they
    dispatch is checked."""
    return context[-1]


_saved_hooks = torch._C._autograd._top_saved_tensors_default_hooks


_flash_sdp = torch._C._get_flash_sdp_enabled
_math_sdp = torch._C._get_math_sdp_enabled
_efficient_sdp = torch._C._get_mem_efficient_sdp_enabled
_cudnn_sdp = torch._C._get_cudnn_sdp_enabled


def attention_backends() -> tuple[bool, ...]:
    """Which attention kernels torch may pick now (`sdpa_kernel(...)` switches them)."""
    return _flash_sdp(), _math_sdp(), _efficient_sdp(), _cudnn_sdp()


_autocast_dtype = torch.get_autocast_dtype
_deterministic = torch._C._get_deterministic_algorithms  # torch.are_deterministic_algorithms_enabled, one frame less
_CUDA_BUILD = torch.backends.cuda.is_built()  # a CPU wheel runs no cuda autocast: one call less per call
_DEFAULT_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)  # torch's for cpu and cuda


def _repeated_inputs(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """For each tensor input (positional, then keyword by name), the first input that is the same object."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), i) for i, t in enumerate(tensors))


_submodules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def training_flags(module: torch.nn.Module) -> int:
    """The training flags of a module and its submodules as the bits of one int, the module's own flag
    lowest, above the last flag a 1 that marks how many there are.

    The submodules are listed once per module: one replaced later is not watched (a call that then
    diverges raises TraceMismatchError rather than computing something else)."""
    submodules = _submodules.get(module)
    if submodules is None:  # without the module itself: a value holding its key would keep it alive
        submodules = _submodules[module] = tuple(module.modules())[1:]
    flags = 1
    for sub in reversed(submodules):
        flags = (flags << 1) | sub.training
    return (flags << 1) | module.training


_parameters: dict[int, _Parameters] = {}  # id(module) -> its parameters (see _parameters_of)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD = operator.attrgetter("grad")
_NONES = itertools.repeat(None)


def gradient_state(kwargs: dict, watched: Sequence[weakref.ref] = ()) -> tuple[int, ...]:
    """Which parameters of keyword modules (and of the modules a keyword dict, list or tuple holds)
    require grad and which hold a `.grad`, and the state of
    a DistributedDataParallel module (`_ddp_state`); then the same of the `watched` modules, the
    DDP modules a traced function reaches without a keyword (a closure, a global), -1 for one
    that is gone.

    This decides what autograd dispatches (a first gradient is stored, a later one accumulated
    with `add_`; DDP's reducer all-reduces or not), so a step that accumulates gradients over
    several calls gets one trace per state instead of a mismatch. The number of param groups of
    each keyword optimizer comes last: `add_param_group` (unfreezing layers) adds parameters whose
    state the next step creates. It is computed only for traces whose recorded call touched
    gradients. (The parameters a trace reads that no keyword module holds are checked per trace:
    reached_gradient_state; the inputs' `.grad` is part of their signature, tensor_key.)
    """
    values = list(kwargs.values())
    for value in kwargs.values():  # a keyword dict, list or tuple's modules and optimizers (`st={"model": m}`)
        if type(value) is dict:
            values += value.values()
        elif type(value) in (list, tuple):
            values += value
    states = [_module_state(module) for module in values if isinstance(module, torch.nn.Module)]
    states += [len(opt.param_groups) for opt in values if isinstance(opt, torch.optim.Optimizer)]
    for ref in watched:
        module = ref()
        states.append(-1 if module is None else _module_state(module))
    return tuple(states)


def reached_gradient_state(parameters: Sequence[weakref.ref]) -> int:
    """A byte a parameter, the first one highest: requires_grad in bit 1, has a `.grad` in bit 0 (a
    freed one: 0), as _module_state's for a keyword module. Freezing a layer of a model a trace
    reaches without a keyword (a closure's, a global's) selects a trace of its own with it, and
    so does clearing its gradients (`model.zero_grad()` every few calls of an accumulating step:
    backward stores a first gradient, but adds into one that is there)."""
    return int.from_bytes(bytes(map(_gradient_state_or_freed, map(operator.call, parameters))))


def gradient_byte(requires_grad: bool, held: bool) -> int:
    """One parameter's byte of reached_gradient_state."""
    return requires_grad << 1 | held


def _gradient_state_or_freed(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.requires_grad << 1 | (tensor.grad is not None)


_BACKWARD_HOOKS = operator.attrgetter("_backward_hooks")
_POST_ACCUMULATE_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


def any_gradient_hooks(tensors: Sequence[torch.Tensor]) -> bool:
    """True if one of the tensors has a gradient hook (`register_hook`,
    `register_post_accumulate_grad_hook`); two C-level passes. A removed hook leaves an empty
    dict, which counts as none."""
    return any(map(_BACKWARD_HOOKS, tensors)) or any(map(_POST_ACCUMULATE_HOOKS, tensors))


def gradient_hooks(tensor: torch.Tensor) -> tuple:
    """The handles of a tensor's gradient hooks, ((), ()) for none."""
    return tuple(tensor._backward_hooks or ()), tuple(tensor._post_accumulate_grad_hooks or ())


# Bumped whenever any module registers a parameter or a submodule (assigning one included):
# torch.nn's process-wide registration hooks, which only ever return None here.
_REGISTRATIONS = [0]


def _registered(*_: object) -> None:
    _REGISTRATIONS[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_module_registration_hook(_registered)
_MISSING = object()


class _Parameters:
    """A module's parameters, with what tells whether they still are: the objects under each name
    of every submodule's `_parameters` and `_modules` dicts, and their sizes. Replacing a parameter
    (`lin.weight = nn.Parameter(w)`, `load_state_dict(assign=True)`), registering one or adding,
    replacing or removing a submodule changes one of them; the next call lists them again. They
    are compared only after some module registered something (_REGISTRATIONS), which the
    replacements do (a `del` alone does not, nor writing `_parameters` directly)."""

    __slots__ = ("ref", "parameters", "dicts", "names", "values", "held", "sizes", "seen")

    def __init__(self, module: torch.nn.Module, ref: weakref.ref) -> None:
        self.ref = ref
        self.seen = _REGISTRATIONS[0]
        self.parameters = tuple(module.parameters())
        modules = tuple(module.modules())
        held = tuple(entries for sub in modules for entries in (sub._parameters, sub._modules))
        self.dicts = tuple(entries for entries in held for _ in entries)
        self.names = tuple(name for entries in held for name in entries)
        self.values = tuple(value for entries in held for value in entries.values())
        self.held = held  # how many entries each holds (a dict replaced as a whole goes unseen)
        self.sizes = tuple(map(len, held))

    def current(self) -> bool:
        """True while no parameter or submodule was replaced, added or removed (C-level loops)."""
        if self.seen == _REGISTRATIONS[0]:
            return True
        # a name missing now reads as _MISSING: a None entry (`bias=False`) removed is a change too
        if (all(map(operator.is_, map(dict.get, self.dicts, self.names, itertools.repeat(_MISSING)), self.values))
                and tuple(map(len, self.held)) == self.sizes):
            self.seen = _REGISTRATIONS[0]
            return True
        return False


def _parameters_of(module: torch.nn.Module) -> tuple:
    known = _parameters.get(id(module))
    if known is None or known.ref() is not module or not known.current():
        key = id(module)
        ref = known.ref if known is not None and known.ref() is module else weakref.ref(
            module, lambda _, key=key: _parameters.pop(key, None))
        known = _parameters[key] = _Parameters(module, ref)
    return known.parameters


def _module_state(module: torch.nn.Module) -> int:
    params = _parameters_of(module)
    # a byte a parameter, the first one highest: requires_grad in bit 1, has a .grad in bit 0
    # (built by C loops: this runs on every checked call); then the DDP state, and whether a
    # gradient hook is registered (backward runs it: a trace of its own, which runs backward)
    requires_grad = int.from_bytes(bytes(map(_REQUIRES_GRAD, params)))
    held = int.from_bytes(bytes(map(operator.is_not, map(_GRAD, params), _NONES)))
    return ((requires_grad << 1 | held) << 4 | _ddp_state(module)) << 1 | any_gradient_hooks(params)


def _ddp_state(module: torch.nn.Module) -> int:
    """What decides the collectives a DistributedDataParallel module issues in a call, as 4 bits
    (0 for other modules): whether backward all-reduces (not inside `no_sync()`), whether forward
    broadcasts the buffers (not after a `no_sync()` forward, nor with `broadcast_buffers=False`,
    which sets `forward_sync_buffers`), and whether the buckets were rebuilt (the first
    synchronized forward after the first synchronized backward rebuilds them once, with a
    broadcast: that call must not share a trace with the calls before or after it)."""
    if "require_backward_grad_sync" not in module.__dict__:  # not hasattr: a Module's __getattr__ raises for it
        return 0
    return (module.require_backward_grad_sync << 3 | bool(getattr(module, "forward_sync_buffers", True)) << 2
            | bool(getattr(module, "require_forward_param_sync", True)) << 1
            | bool(getattr(module, "_has_rebuilt_buckets", True)))


def gradient_snapshot(kwargs: dict) -> list[tuple]:
    """Every parameter's .grad object, its version and requires_grad, to see what a call changed."""
    snapshot = []
    for module in kwargs.values():
        if isinstance(module, torch.nn.Module):
            for p in module.parameters():
                grad = p.grad
                snapshot.append((id(grad), grad._version if grad is not None else -1, p.requires_grad))
    return snapshot


def describe_signature(key: tuple, arg_names: list[str], grad_state: tuple | None = None) -> str:
    def one(k: tuple) -> str:
        shape, stride, dtype, device, requires_grad, inference, bits, kind, held = k
        # a layout other than the contiguous one is a signature of its own: say so, or two traces
        # of the same shape read alike (a size-1 dim's stride differs after t() or as_strided)
        layout = "" if stride == _contiguous_strides(shape) else f", strides {tuple(stride)}"
        grad = layout + (", requires_grad" if requires_grad else "")
        grad += ", with gradient hooks" if requires_grad == 2 else ""
        grad += ", holding a .grad" if held else ""
        made = ", an inference tensor" if inference else ""
        subclass = "" if kind is torch.Tensor else f", a {kind.__qualname__}"
        return (f"{device.type} {str(dtype).removeprefix('torch.')}{list(shape)}{grad}{made}{describe_math_bits(bits)}"
                f"{subclass}")

    positional, keyword, training, repeated, shared, flags, functions, context = key
    parts = [f"{arg_names[i] if i < len(arg_names) else f'arg{i}'}: {one(k)}" for i, k in enumerate(positional)]
    parts += [f"{name}=: {one(k)}" for name, k in keyword]
    parts += [_describe_training(flags) for _, flags in training]  # (class, flags) of each keyword module
    parts += [f"input {i} is input {j}" for i, j in enumerate(repeated) if i != j]
    parts += [f"input {i} lies in the memory of input {j} (offset {offset} bytes)" for i, j, offset in shared]
    parts += [f"{name}={value}" for name, value in flags]
    parts += [f"{expr}: {_describe_callable(k)}" for expr, k in functions]
    if grad_state:
        parts += [f"gradient state {state:#x}" for state in grad_state]
    parts += describe_context(context)
    return "(" + ", ".join(parts) + ")"


def _describe_callable(key: object) -> str:
    if isinstance(key, types.CodeType):
        return f"function {key.co_qualname}"
    if isinstance(key, type):
        return f"class {key.__qualname__}"
    if isinstance(key, tuple):
        kind, *rest = key
        if kind == "method":
            return f"method {_describe_callable(rest[0]).removeprefix('function ')} of a {rest[1].__qualname__}"
        if kind == "partial":
            return f"partial of {_describe_callable(rest[0])}"
        if kind == "builtin":
            return f"builtin {rest[1]} of a {rest[0].__qualname__}"
        return f"a {rest[0].__qualname__}"
    return f"builtin {getattr(key, '__name__', key)}"


def _contiguous_strides(shape: tuple) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def describe_context(context: tuple) -> list[str]:
    """The parts of a call context that differ from torch's defaults, readably."""
    (grad, inference, cpu_autocast, dtypes, cuda_autocast, default_dtype, deterministic, anomaly, modes, attention,
     transforms_on, hooked) = context
    parts = [] if grad else ["no_grad"]
    parts += ["inference_mode"] if inference else []
    parts += [f"autocast cpu {str(dtypes[0]).removeprefix('torch.')}"] if cpu_autocast else []
    parts += [f"autocast cuda {str(dtypes[1]).removeprefix('torch.')}"] if cuda_autocast else []
    parts += [f"autocast dtype {device} {str(dtype).removeprefix('torch.')}"
              for device, dtype, default, on in zip(("cpu", "cuda"), dtypes, _DEFAULT_AUTOCAST_DTYPES,
                                                    (cpu_autocast, cuda_autocast))
              if dtype is not None and dtype != default and not on]
    parts += [f"default dtype {str(default_dtype).removeprefix('torch.')}"] if default_dtype != torch.float32 else []
    parts += ["deterministic algorithms"] if deterministic else []
    parts += ["anomaly detection"] if anomaly else []
    parts += [f"default device {mode[1]}" if mode[0] is DeviceContext else f"inside {mode[0].__qualname__}" for mode in modes]
    parts += [f"attention backends {'/'.join(name for name, on in zip(_ATTENTION, attention) if on) or 'none'}"
              ] if not all(attention) else []
    parts += [what for what, on in zip(_TRANSFORMS, transforms_on) if on]
    parts += ["saved_tensors_hooks"] if hooked else []
    return parts


_ATTENTION = ("flash", "math", "efficient", "cudnn")  # call_context_key's order; torch enables all by default


def _describe_training(flags: int) -> str:
    bits = bin(flags)[3:][::-1]  # without the marker, the module's own flag first
    own, submodules = bits[0] == "1", bits[1:]
    odd = submodules.count("0" if own else "1")
    if not odd:
        return "training" if own else "eval"
    return f"{'training' if own else 'eval'}, {odd} of {len(submodules)} submodules {'in eval' if own else 'training'}"
