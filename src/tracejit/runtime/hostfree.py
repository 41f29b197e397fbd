"""without_host=True: run a trace without its Python function.

For every binding one function is generated, `call(args, kw)`. It checks the inputs' signature,
then what the skipped function would have established by running: the keyword arguments are
the recorded ones (same primitive values), every external tensor is still where the function
finds it (same object, reached through the same module/optimizer attributes, same
shape/dtype/device). It binds the inputs and the learning rates read from `param_groups`, runs
the program, writes the values that escaped into Python state (`.grad`, state created inside
the call) into the objects Python holds, and returns fresh outputs. A failed check is not an
error: `call` returns MISS and the call falls back to a checked replay, which runs the function
and rebinds.
"""

from __future__ import annotations

import collections
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import HostDependencyError
from ..ir.graph import Graph
from ..record.amp import is_inf_check
from ..record.autocast_keys import any_autocast_enabled, outside_autocast
from ..record.calls import data_dependent_size
from ..record.ddp_calls import is_ddp, stateful_comm_hooks
from ..record.modes import same_generator
from ..record.names import (
    ExternalNames,
    Locator,
    code_owner,
    container_expression,
    differs_expression,
    group_suffix,
    keys_read_through,
    module_roots,
    plain_copy,
    plain_roots,
    plain_set,
    plain_value,
    resolve,
    root_expression,
    same_value,
)
from ..record.reads import storage_root
from ..record.record import Flag, Kind, OutputSpec, Record, math_bits
from ..record.recorder import storage_address
from ..record.rng import rng_dependency
from ..signature import (
    KEYWORD_ITEMS,
    any_gradient_hooks,
    call_context_key,
    gradient_hooks,
    gradient_state,
    holds_grad,
    keyword_callables,
    keyword_modules,
    reached_gradient_state,
    shared_memory,
)
from .codegen import RunParts
from .meta_guard import MetaGuard
from .module_guards import guarded_modules, module_guards
from .optimizer_settings import (
    find_bindings,
    optimizer_hook_guards,
    param_ids,
    reached_optimizers,
    scaler_guards,
    setting_guards,
    stepped_optimizers,
)
from .program import HostFreeProgram, scalar_layout
from .state_holders import Holder, Place, find_holders, parameters_of

_PRIMITIVES = (bool, int, float, str, type(None))


class GuardFailure(Exception):
    """An external of the last host-run call is gone: the next call runs the function."""


def refuse_host_dependencies(record: Record) -> None:
    """Raise if skipping the function would freeze a value the host computes from tensor data."""
    if record.host_reads:
        lines = "\n".join(f"    {r.what} of t{r.handle} at {r.source}: {r.source.code}" for r in record.host_reads[:5])
        if any(is_inf_check(r.what) for r in record.host_reads):
            lines += ("\n  torch.amp.GradScaler reads found_inf on the host to skip optimizer.step() on an overflow, "
                      "unless the optimizer takes the scaler on the device: torch.optim.Adam/AdamW(fused=True) "
                      "get grad_scale and found_inf and skip the update themselves, so such a step runs without "
                      "the host.")
        raise HostDependencyError(
            f"without_host=True cannot skip {record.function_name}(): the traced call reads tensor values "
            f"on the host, and without the function those values would be frozen at their recorded "
            f"value:\n{lines}\n"
            f"Remedies: keep such reads out of the traced function (return the tensor and read it after "
            f"the call); pass changing values as tensors; for torch.optim use fused=True (Adam/AdamW "
            f"read step.item() otherwise) or capturable=True; or trace without without_host."
        )
    if record.outside_reads:
        lines = "\n".join(f"    {r.what} of a tensor no op of the call had used at {r.source}: {r.source.code}"
                          for r in record.outside_reads[:5])
        raise HostDependencyError(
            f"without_host=True cannot skip {record.function_name}(): the traced call reads on the host the value "
            f"of tensors it finds (a buffer, a global, an attribute), and without the function that value would be "
            f"frozen at the one it read when the trace was recorded:\n{lines}\n"
            f"Remedies: read such values outside the traced function and pass them as arguments, use the tensor "
            f"in ops instead of reading it (torch.where rather than `if t:`), or trace without without_host."
        )
    if record.hidden_reads:
        lines = "\n".join(f"    {r.describe()}: {r.source.code}" for r in record.hidden_reads[:5])
        raise HostDependencyError(
            f"without_host=True cannot skip {record.function_name}(): torch reads tensor values on the host "
            f"inside these calls (in C++, with no op for the read) and chooses from them which ops to run, so a "
            f"program run without the function would run the recorded ops whatever the values:\n{lines}\n"
            f"Remedies: pass split points as Python ints (x.tensor_split([2, 5])), keep packing and padding "
            f"of variable-length sequences outside the traced function, or trace without without_host: checked "
            f"calls compare the ops each call runs."
        )
    dynamic = [op for op in record.ops if data_dependent_size(op, record)]
    if dynamic:
        lines = "\n".join(f"    op #{op.index} {op.name} at {op.source}: {op.source.code}" for op in dynamic[:5])
        raise HostDependencyError(
            f"without_host=True cannot skip {record.function_name}(): the size of what these ops produce "
            f"depends on tensor values (a data-dependent shape), and a program run without the function "
            f"would keep the recorded sizes:\n{lines}\n"
            f"Remedies: compute such values outside the traced function, replace them by a fixed-size form "
            f"(torch.where(mask, x, 0) rather than x[mask]), or trace without without_host: checked calls "
            f"record a trace per output size."
        )
    dependency = rng_dependency(record)
    if dependency:
        raise HostDependencyError(
            f"without_host=True cannot skip {record.function_name}(): {dependency}, and the program run "
            f"without the function would draw its random numbers in one stream (torch.utils.checkpoint "
            f"restores the state to recompute dropout in backward). Trace it without without_host: checked "
            f"calls run the function around every random op.")
    if record.excluded_blocks:
        block = record.excluded_blocks[0]
        raise HostDependencyError(
            f"without_host=True cannot skip {record.function_name}(): it contains an exclude_from_trace() "
            f"block at {block.source}, which must run on every call. Move it out of the traced function "
            f"or trace without without_host."
        )


def refuse_stateful_comm_hooks(record: Record, kwargs: dict) -> None:
    """Raise if a DistributedDataParallel module the call ran has a communication hook with Python
    state: the hook runs in Python in every backward, reads and changes its state (PowerSGD counts
    iterations and switches from all-reduce to compression at `start_powerSGD_iter`), and a
    program run without the function would repeat the recorded call's gradient exchange forever."""
    keyword = {name: value for name, value in kwargs.items() if isinstance(value, torch.nn.Module)}
    for module in guarded_modules([*map(weakref.ref, keyword.values()), *record.modules_called]):
        hooks = stateful_comm_hooks(module) if is_ddp(module) else []
        if hooks:
            raise HostDependencyError(
                f"without_host=True cannot skip {record.function_name}(): the DistributedDataParallel module "
                f"{_module_name(module, keyword)} has a communication hook with Python state ("
                f"{', '.join(hooks)}). The hook runs in Python in every backward and may change its state "
                f"and what it computes (PowerSGD counts iterations and switches from all-reduce to "
                f"compression at start_powerSGD_iter), which a program run without the function would "
                f"never do: it would repeat the recorded call's gradient exchange forever.\n"
                f"Remedies: a stateless hook (state None or a process group: allreduce_hook, "
                f"fp16_compress_hook, bf16_compress_hook) runs without the host; or trace without "
                f"without_host: checked calls run the hook, and raise TraceMismatchError when it changes what "
                f"it computes.")


def _module_name(module: torch.nn.Module, keyword: dict[str, torch.nn.Module]) -> str:
    """How the function's caller knows a module: a keyword argument or a submodule of one."""
    for name, value in keyword.items():
        for path, sub in value.named_modules():
            if sub is module:
                return f"`{name}{'.' + path if path else ''}`"
    return f"around a {type(getattr(module, 'module', module)).__qualname__}, reached without a keyword argument,"


class _Source:
    """Accumulates generated code and the constants it refers to by name."""

    def __init__(self, function: Any) -> None:
        function = code_owner(function)
        self.namespace: dict[str, Any] = {
            "EMPTY": {},
            "GLOBALS": getattr(function, "__globals__", {}),
            "CELLS": getattr(function, "__closure__", None) or (),
        }
        self.resolved: dict[Locator, str] = {}  # locators already bound to a local
        self.prefixes: dict[str, str] = {}  # module paths already bound to a local
        self.pending: list[str] = []  # assignments of new prefix locals, to emit before use

    def constant(self, value: Any, prefix: str) -> str:
        name = f"{prefix}{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def locator(self, locator: Locator) -> str:
        """An expression for the tensor at `locator`; module paths shared by several tensors are
        looked up once per call (the assignments go to `pending`)."""
        if locator in self.resolved:
            return self.resolved[locator]
        expr = root_expression(locator.root)
        for step, name in locator.steps:
            if step in ("module", "attr", "item"):  # containers: looked up once per call
                expr = self._shared(f"{expr}._modules[{name!r}]" if step == "module" else
                                    f"{expr}.{name}" if step == "attr" else f"{expr}[{name!r}]")
            elif step == "grad":
                expr += ".grad"
            else:
                expr += {"param": "._parameters", "buffer": "._buffers"}[step] + f"[{name!r}]"
        if locator.state_of is not None:
            return f"{self._shared(expr)}.state.get({self.locator(locator.state_of)}, EMPTY).get({locator.state_key!r})"
        if locator.group is not None:  # a tensor setting of a param group (a fused step's `lr`)
            return f"{self._shared(expr)}{group_suffix(locator.group)}"
        return expr

    def _shared(self, expr: str) -> str:
        if expr not in self.prefixes:
            self.prefixes[expr] = f"m{len(self.prefixes)}"
            self.pending.append(f"{self.prefixes[expr]} = {expr}")
        return self.prefixes[expr]

    def function(self, name: str, params: str, body: list[str]) -> tuple[str, Any]:
        source = f"def {name}({params}):\n" + "\n".join(f"    {line}" for line in body or ["pass"]) + "\n"
        exec(compile(source, f"<tracejit {name}>", "exec"), self.namespace)
        return source, self.namespace[name]


MISS = object()  # what a generated call returns when it cannot serve the call
_FORWARD_SYNC = "require_forward_param_sync"


def _other_device(expr: str, device: torch.device, src: _Source) -> str:
    """A condition true when the tensor `expr` is not on `device` (`is_cpu` is the cheapest read)."""
    if device.type == "cpu":
        return f"not {expr}.is_cpu"
    return f"{expr}.device != {src.constant(device, 'v')}"


def _other_math_bits(expr: str, bits: int, src: _Source) -> str:
    """A condition true when the tensor `expr` has other negation and conjugation bits than `bits`
    (record.math_bits): the program's kernels read the memory of tensors recorded without them."""
    if not bits:
        return f"{expr}.is_neg() or {expr}.is_conj()"
    src.namespace["MATH_BITS"] = math_bits
    return f"MATH_BITS({expr}) != {bits}"


def _training_flags_differ(expr: str, module: torch.nn.Module, src: _Source) -> str:
    """A condition true when the training flag of the module or of one of its submodules (held
    weakly, listed once as signature.training_flags lists them) is not the recorded one, or the
    module is of another class (part of the signature too)."""
    checks = [f"type({expr}) is not {src.constant(type(module), 'mt')}", f"{expr}.training is not {module.training}"]
    for sub in tuple(module.modules())[1:]:
        checks.append(f"{src.constant(weakref.ref(sub), 'r')}().training is not {sub.training}")
    return " or ".join(checks)


def _expected(value: Any) -> tuple:
    """How a later call's object stands for `value` (see same_object): the same object, held
    weakly where it can be; a bound method, made anew on every attribute access
    (`loss_fn=trainer.loss`), by its instance and function; a slice, range or set by value."""
    if isinstance(value, types.MethodType):
        # the settings of a plain object the method reads (`trainer.loss_scale`) as they are now;
        # one whose settings cannot all be read (slots, thousands of attributes) is compared by
        # the method object itself, made anew on each access: the call runs the function
        owner = value.__self__
        if isinstance(owner, torch.nn.Module):  # guarded as a keyword module (module_guards)
            return "method", _reference(owner), (value.__func__, None)
        attributes = plain_attributes(owner)
        if attributes is None:
            return "is", _reference(value), None
        return "method", _reference(owner), (value.__func__, attributes)
    if type(value) in (slice, range, frozenset, set) and (plain_value(value) or plain_set(value)):
        return "value", plain_copy(value), type(value)
    return "is", _reference(value), None


def plain_attributes(owner: Any) -> dict | None:
    """The plain values among an object's attributes and its classes' (`scale = 2.0` in the class
    body), as copies; None where they cannot all be read: no `__dict__`, `__slots__`, more than
    _PLAIN_ATTRIBUTES attributes."""
    attributes = getattr(owner, "__dict__", None)
    cls = type(owner)
    if (type(attributes) is not dict or len(attributes) > _PLAIN_ATTRIBUTES
            or any("__slots__" in vars(c) for c in cls.__mro__[:-1])):
        return None
    found = {key: plain_copy(value) for key, value in attributes.items() if plain_value(value)}
    for c in cls.__mro__[:-1]:
        for key, value in vars(c).items():
            if not key.startswith("__") and key not in found and key not in attributes and plain_value(value):
                found[key] = plain_copy(value)
    return found


def _reference(value: Any) -> Any:
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


def same_object(now: Any, expected: tuple) -> bool:
    """Whether a keyword (or an item of a keyword container) stands for what `expected` (_expected)
    describes."""
    how, held, extra = expected
    if how == "is":
        return now is held()
    if how == "method":
        function, attributes = extra
        if type(now) is not types.MethodType or now.__func__ is not function or now.__self__ is not held():
            return False
        return attributes is None or same_value(plain_attributes(now.__self__), attributes)
    return type(now) is extra and same_value(now, held)


def _held_objects(value: Any) -> tuple | None:
    """For a keyword list, tuple or dict: (its type, its keys, (key, _expected) of each item that
    is not a tensor or plain value); None for any other value."""
    if type(value) in (list, tuple):
        items = list(enumerate(value))
    elif type(value) is dict:
        items = list(value.items())
    else:
        return None
    held = [(key, _expected(item)) for key, item in items[:_HELD_ITEMS]
            if not (isinstance(item, (torch.Tensor, *_PRIMITIVES)) or plain_value(item))]
    return type(value), tuple(key for key, _ in items), tuple(held)


_HELD_ITEMS = KEYWORD_ITEMS  # the most items of a keyword container compared (as the signature walks)
_PLAIN_ATTRIBUTES = 256  # the most attributes of a bound method's object compared


def same_objects(value: Any, snapshot: tuple) -> bool:
    """Whether a keyword container is of the type, has the keys and holds the objects of `snapshot`
    (_held_objects)."""
    kind, keys, held = snapshot
    if type(value) is not kind or len(value) != len(keys):
        return False
    if kind is dict and tuple(value) != keys:
        return False
    return all(same_object(value[key], expected) for key, expected in held)


def same_object_key(tensors: list[torch.Tensor]) -> list[int]:
    """For each tensor, the index of the first one that is the same object."""
    return [next(j for j in range(i + 1) if tensors[j] is t) for i, t in enumerate(tensors)]


def _same_object_checks(exprs: list[str], tensors: list[torch.Tensor]) -> list[str]:
    """Which tensor inputs are one object is part of the signature (`f(x, x)` records other handles
    than `f(x, y)`): compare every pair, a handful of `is` tests for the usual few inputs."""
    if len(exprs) > 6:
        return [_fail(f"SAME([{', '.join(exprs)}]) != {same_object_key(tensors)}", "other inputs are the same tensor now")]
    pairs = [f"{a} is {'not ' if tensors[i] is tensors[j] else ''}{b}"
             for i, a in enumerate(exprs) for j, b in enumerate(exprs) if i < j]
    return [_fail(" or ".join(pairs), "other inputs are the same tensor now")] if pairs else []


def _leaves_of_returned_graphs(objects: dict[int, Any], tensors: list) -> set[int]:
    """The ids of the leaf tensors the autograd graphs of the returned tensors hold (their
    AccumulateGrad nodes' variables): C++ keeps them alive, not a Python container."""
    stack = [obj.grad_fn for h, obj in objects.items()
             if tensors[h].flags & Flag.RETURNED and isinstance(obj, torch.Tensor) and obj.grad_fn is not None]
    seen, visited, leaves = set(), [], set()
    while stack and len(seen) < 100_000:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        visited.append(node)  # alive until the walk ends: no other node gets its id
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _guarded_by_meta(exprs: list[str], checks: list[str], src: _Source) -> list[str]:
    """`checks` (the precise metadata checks of the tensors `exprs`) in one C++ call while the
    tensors have what the guard learned, one by one otherwise (runtime/meta_guard.py)."""
    if not exprs:
        return []
    guard = src.constant(MetaGuard(), "meta")
    tensors = ", ".join(exprs)
    return [f"if not {guard}.check({tensors}):", *(f"    {check}" for check in checks), f"    {guard}.learn({tensors})"]


def _layout_check(local: str, info: Any, src: _Source) -> str:
    """The check that an external bound to `local` has the recorded layout."""
    meta = info.meta
    return _fail(f"{local}.shape != {src.constant(meta.shape, 's')} or {local}.stride() != "
                 f"{src.constant(meta.stride, 'st')} or {local}.dtype is not {src.constant(meta.dtype, 'd')} or "
                 f"{_other_device(local, meta.device, src)} or {_other_math_bits(local, meta.math_bits, src)}",
                 f"{info.name} is not {meta} anymore")


def drawn_generators(record: Record) -> list[torch.Generator]:
    """The explicit torch.Generator objects the record's random ops draw from (`generator=g`)."""
    found: dict[int, torch.Generator] = {}
    for op in record.ops:
        for item in op.statics:
            value = getattr(item, "value", item)
            if isinstance(value, torch.Generator) and value is not torch.default_generator:
                found.setdefault(id(value), value)
    return list(found.values())


def why_missed(call: Any, source: str, args: tuple, kwargs: dict) -> str | None:
    """The message of the guard `call` fails on for these arguments, by running its guards once
    more under a line tracer; None if it did not return MISS. Only right after a MISS on the same
    arguments: a call whose guards pass runs the program."""
    code = call.__code__
    last = [0]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None
        if event == "line":
            last[0] = frame.f_lineno
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        result = call(args, kwargs)
    finally:
        sys.settrace(previous)
    if result is not MISS:
        return None
    lines = source.splitlines()
    line = lines[last[0] - 1] if 0 < last[0] <= len(lines) else ""
    return line.partition("return MISS  # ")[2].strip() or None


def _fail(condition: str, message: str) -> str:
    # The message is kept as a comment (on one line, however the value it names prints): the
    # generated call only says "not me" (MISS); why_missed reads it back for HostFreeMissWarning.
    text = " ".join(message.split())
    return f"if {condition}: return MISS  # {text if len(text) <= 200 else text[:197] + '...'}"


class KeptSlot:
    """Where a checked call at the API level puts the tensor its function kept beyond the call
    where tracejit cannot find it (`history.append(loss.detach())`): called like the weak
    reference the host-free program holds otherwise, it answers that tensor or None."""

    __slots__ = ("tensor",)

    def __init__(self):
        self.tensor: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor | None:
        return self.tensor


class EarlyValues:
    """What a checked call's program leaves when it runs at a host read (runtime/early_finish.py):
    while `on`, the program puts the values that outlive the call, and the ones read after it, in
    `values` by handle, for the function's placeholders of them."""

    __slots__ = ("on", "values", "handles")

    def __init__(self):
        self.on = False
        self.values: dict[int, torch.Tensor] | None = None
        self.handles: frozenset[int] = frozenset()  # what `values` holds: set by each binding


class HostFreeRunner:
    """Runs one trace without its function, through one generated function per binding:
    `call(args, kw)` checks the signature and the guards, binds, runs the program and returns
    the outputs, or returns MISS and lets the caller take the slow path."""

    def __init__(self, record: Record, program: HostFreeProgram, function: Any, checked: bool = False,
                 gradient_state: Callable[[dict], tuple] = gradient_state):
        # A checked call at the API level runs the function: its host reads are computed when they
        # happen (runtime/api_replay.py) and the numbers they lead to reach the program as `S`.
        refuse_host_dependencies(replace(record, host_reads=[], outside_reads=[]) if checked else record)
        self.checked = checked
        self.record = record
        self.program = program
        self.function = function
        _, self.initial_scalars = scalar_layout(record)
        self.call = None
        self.admit = None  # the input signature alone: True or MISS
        self.external_slots: dict[int, int] = {}
        self.sources: dict[str, str] = {}
        self.env_template: list = []
        self.unplaced: list[str] = []  # kept tensors the epilogue cannot leave where the function would
        self.kept_slots: dict[int, KeptSlot] = {}
        self.early = EarlyValues()
        self.gradient_state = gradient_state  # the trace's, which also watches DDPs reached without a keyword
        # externals tracejit cannot find by a path (no locator), as the last binding call reached
        # them: a call may skip the function only after two calls reached the same objects
        self._unlocated: dict[int, weakref.ref] = {}

    def why_missed(self, args: tuple, kwargs: dict) -> str | None:
        """The guard the generated call fails on for these arguments (see why_missed)."""
        if self.call is None:
            return None
        return why_missed(self.call, self.sources["call"], args, kwargs)

    def bind(self, *args: Any, **kwargs: Any) -> None:
        """See _bind. The lists of the binding call's tensors it fills are emptied however it ends
        (a GuardFailure or HostDependencyError part-way): kept, a freed tensor would live on."""
        try:
            self._bind(*args, **kwargs)
        finally:
            self._in_memory = self._loose = []

    def _bind(self, objects: dict[int, torch.Tensor], args: tuple, kwargs: dict, names: ExternalNames,
              grad_state: tuple | None, scalars: list | None = None, external_slots: dict[int, int] | None = None,
              grad_owners: dict[int, int] | None = None, reached: tuple | None = None,
              input_grads: tuple[bool, ...] | None = None) -> None:
        """Specialize the call to the inputs' signature and the objects and scalar values a host-run
        call just used (`scalars`: its dynamic scalars; None: the record's own). A checked runner
        gets the externals the API-level checker holds as `E` (`external_slots`: handle -> slot):
        the function's calls matched them, so they are not reached through modules again, and
        `grad_owners` (gradient handle -> parameter handle) says whose `.grad` each was read as;
        `reached`: (parameters no keyword module holds, their gradient state) of the trace;
        `input_grads`: which tensor inputs held a `.grad` when its recorded call began (signature.input_grads)."""
        self.external_slots = external_slots or {}
        scalars = list(self.initial_scalars if scalars is None else scalars)
        self._freed_grads = self._freed_gradients(objects, grad_owners or {}, names)
        for info in self.record.tensors:
            # An external the call read and then freed (a gradient the user replaced): the program
            # cannot be bound to it, the next call runs the function. Checked before anything is
            # computed from the externals. A checked call's gradient freed by its own `zero_grad()`
            # is read where it is instead (_freed_gradients).
            if info.kind is Kind.EXTERNAL and objects.get(info.handle) is None and info.handle not in self._freed_grads:
                raise GuardFailure(f"external t{info.handle} ({info.name}) is no longer alive")
        self._compute_hoisted(objects)
        src = _Source(self.function)
        src.namespace.update(MISS=MISS, TENSOR=torch.Tensor, SCALARS=scalars,
                             IS_GRAD=torch.is_grad_enabled, SET_GRAD=torch._C._set_grad_enabled,
                             CONTEXT=call_context_key, PARAM_IDS=param_ids,
                             GRAD_STATE=self.gradient_state, SAME=same_object_key,
                             SHARED=shared_memory, DISTINCT_MEMORY=distinct_memory)
        admission = self._signature_checks(args, kwargs, grad_state, src, input_grads)
        if reached and reached[0]:  # a layer of a closure's model frozen, or its .grad cleared: another trace
            src.namespace["REACHED_STATE"] = reached_gradient_state
            admission.append(_fail(f"REACHED_STATE({src.constant(reached[0], 'rp')}) != {reached[1]}",
                                   "a parameter the function reaches was frozen or unfrozen, or its .grad "
                                   "cleared or set"))
        # the caller's context decides what the skipped function would dispatch (autocast: bf16 ops)
        admission.append(_fail(f"CONTEXT() != {src.constant(call_context_key(), 'ctx')}",
                               "grad mode, autocast, default dtype, determinism or attention backends changed"))
        training = [_fail(_training_flags_differ(expr, value, src),
                          f"{expr} or one of its submodules switched between train and eval")
                    for expr, value in keyword_modules(kwargs)]
        # `admit`: the input signature alone (signature.py's facts), for a checked call at the API
        # level, which comes to `call` after its signature selected this trace and does not check
        # it there again.
        # a bool keyword selects a trace of its own (signature.py)
        admit = admission + [_fail(f"kw[{name!r}] is not {value}", f"{name} is not {value} now")
                             for name, value in sorted(kwargs.items()) if isinstance(value, bool)]
        # another function by a keyword selects a trace of its own (signature.py); without the
        # host every keyword object is compared by identity already (the guards below)
        functions = keyword_callables(kwargs)
        if functions:
            src.namespace["FUNCTIONS"] = keyword_callables
            admit.append(_fail(f"FUNCTIONS(kw) != {src.constant(functions, 'fn')}", "a keyword function is another one"))
        if training:
            admit += ["try:", *(f"    {line}" for line in training),
                      "except (AttributeError, KeyError, IndexError, TypeError):",
                      "    return MISS  # a freed submodule is None; a keyword container of other keys or length"]
        lines = [f"a{i} = args[{i}]" for i in range(len(args))] if self.checked else admission
        # inside a try: a module or optimizer that lost an attribute is a MISS. A checked call runs
        # the function, whose module calls are checked (or stood in for) one by one
        keyword_module_refs = [weakref.ref(v) for _, v in keyword_modules(kwargs)]
        new_hooks: list[str] = []  # checks that only a hook registered since binding can fail
        # the modules of globals and closure cells too: the function may read their settings
        # without calling their forward (`MT.head(MT.body(x)) / MT.temperature`)
        root_module_refs = [weakref.ref(value) for _, _, value in module_roots(self.function)]
        guards = [] if self.checked else module_guards(
            guarded_modules([*keyword_module_refs, *root_module_refs, *self.record.modules_called]), src.constant,
            _fail, new_hooks)
        if not self.checked:  # a module an object of yours holds (`trainer.model`), rebound since
            guards += [_fail(f"{expr} is not {src.constant(ref, 'km')}()", f"{expr} is another module")
                       for (expr, _), ref in zip(keyword_modules(kwargs), keyword_module_refs)]
        # The guards above check the modules and optimizers the binding call was given; another
        # object by the same keyword (`loss_fn=nn.L1Loss()` for an MSELoss, a Sequential rebuilt
        # around the same layers: no parameter tells them apart) runs the function instead.
        # So are the other objects a keyword gives (a loss function, a `functools.partial`, a
        # trainer holding an optimizer), and those in a keyword list, tuple or dict (`opts=[opt]`,
        # `losses={"a": nn.L1Loss()}`); tensors there are found by their paths, as externals.
        for name, value in sorted(kwargs.items()) if not self.checked else ():
            if isinstance(value, (torch.Tensor, torch.Generator, *_PRIMITIVES)) or plain_value(value):
                continue
            snapshot = _held_objects(value)
            if snapshot is None:
                expected = _expected(value)
                if expected[0] == "is":  # inline: one `is` (modules, optimizers, most objects)
                    condition = f"kw[{name!r}] is not {src.constant(expected[1], 'kr')}()"
                else:
                    src.namespace["SAME_OBJECT"] = same_object
                    condition = f"not SAME_OBJECT(kw[{name!r}], {src.constant(expected, 'ke')})"
                guards.append(_fail(condition, f"{name} is another object"))
            elif snapshot[2]:
                src.namespace["SAME_OBJECTS"] = same_objects
                guards.append(_fail(f"not SAME_OBJECTS(kw[{name!r}], {src.constant(snapshot, 'ho')})",
                                    f"{name} holds other objects"))
        # Without the host, a keyword number could have decided control flow the program froze.
        # A checked call runs the function, which matches every torch call against the record, and
        # the numbers that reach ops come to the program as `S`: no value guard there.
        for name, value in sorted(kwargs.items()) if not self.checked else ():
            if isinstance(value, _PRIMITIVES):  # of the same type, a float of the same bits
                guards.append(_fail(differs_expression(f"kw[{name!r}]", value, src.constant),
                                    f"{name!r} is not {value!r} anymore"))
            elif isinstance(value, torch.Generator):  # the program draws from the recorded one
                guards.append(_fail(f"kw[{name!r}] is not {src.constant(value, 'gen')}", f"{name!r} is another generator"))
            elif plain_value(value):  # an enum, a dtype, a tuple or dict of such: compared by value
                src.namespace["SAME_VALUE"] = same_value
                found = names.plain_kwargs.get(name, value)  # as the binding call found it
                guards.append(_fail(f"not SAME_VALUE(kw[{name!r}], {src.constant(plain_copy(found), 'p')})",
                                    f"{name!r} is not {found!r} anymore"))
        if not self.checked:
            guards += self._plain_root_guards(src)
        self._located_grads: list[str] = []
        self._in_memory: list[tuple[str, torch.Tensor]] = []  # (local, object): externals whose memory is guarded
        self._bound_storages: frozenset = frozenset()  # their storages, where the program writes memory
        self._loose: list[tuple[str, torch.Tensor]] = []  # of them, those checked where they lie (_memory_guard)
        self._cleared_grads: list[str] = []  # parameters whose `.grad` the call leaves None
        self._meta: list[tuple[str, str]] = []  # (local, its layout check)
        self._bound_by_locator = {names.locator_of(t): t for t in objects.values() if t is not None}
        self._handle_of = {id(t): handle for handle, t in objects.items() if t is not None}
        # A gradient the call found and then freed (`zero_grad()` after the step) while something
        # else keeps it alive (`held = p.grad`): setting `.grad` is Python, no op the program has,
        # so the epilogue repeats it. Binding follows a call that ran the function: a parameter's
        # `.grad` now is where such a call leaves it.
        for grad, param in (grad_owners or {}).items():
            if (objects.get(grad) is not None and objects.get(param) is not None and objects[param].grad is None
                    and param in self.external_slots and self._call_clears(param, grad)):
                self._cleared_grads.append(f"E[{self.external_slots[param]}]")  # the program reuses h<param>
        self._unconfirmed: list[int] = []  # unlocated externals this binding reached for the first time
        self._kwargs = kwargs
        # the inputs' gradients: found through their inputs (see _input_gradients)
        # (a non-leaf's `.grad` is read only if it retains one: torch warns on reading it otherwise)
        self._found_through_inputs = {id(t.grad) for t in (*args, *kwargs.values())
                                      if isinstance(t, torch.Tensor) and (t.is_leaf or t.retains_grad)
                                      and t.grad is not None}
        # of them, those of leaf inputs requiring grad, by the input's expression: a gradient the
        # call accumulates into is read where it is, as a parameter's (_external_guard)
        inputs = [*((f"a{i}", a) for i, a in enumerate(args)),
                  *((f"kw[{name!r}]", v) for name, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor))]
        self._input_grad_exprs = {id(t.grad): expr for expr, t in inputs
                                  if t.is_leaf and t.requires_grad and t.grad is not None}
        self._grads_read_through_inputs: set[int] = set()  # their handles, once bound so
        for info in self.record.tensors:
            if info.handle in self._freed_grads:
                guards += self._freed_gradient_guard(info, src)
            elif info.kind is Kind.EXTERNAL:
                guards += self._external_guard(info, objects.get(info.handle), src, names)
        # binding's own lookups: kept, they would keep the call's model and optimizer alive
        self._kwargs = self._bound_by_locator = None
        self._input_grad_exprs = {}
        if self._unconfirmed:  # the next call runs the function, which tells whether it reaches them again
            raise GuardFailure(f"t{self._unconfirmed[0]} was reached for the first time")
        guards += self._meta_checks(src)
        guards += self._memory_guard(src)
        guards += self._gradient_hook_guards(objects, src, new_hooks)
        if len(self._located_grads) > 1:
            # The program writes them as distinct memory. Each is checked to be no view, at its
            # recorded offset: two over one memory (`q.grad = p.grad.detach()`) start at one address.
            located = ", ".join(self._located_grads)
            guards.append(_fail(f"not DISTINCT_MEMORY(({located},))", "two parameters' .grad share memory now"))
        for handle, storage in self.record.constant_storage.items():
            # captured constants are folded into the program: one written or given other memory
            # since (`param.data = other`) makes the call a checked one, which names it
            captured = self.record.constants[handle]
            constant = src.constant(captured, "const")
            # an inference tensor has no version counter: only its memory is checked
            version = "" if captured.is_inference() else (
                f"{constant}._version != {self.record.constant_versions[handle]} or ")
            guards.append(_fail(f"{version}{constant}.untyped_storage().data_ptr() != {storage}",
                                f"captured constant t{handle} changed"))
            # ...and so does one the function no longer reaches (`lin.weight = nn.Parameter(new)`)
            locator = names.locator_of(self.record.constants[handle])
            if locator is not None:
                expr = src.locator(locator)
                guards += src.pending
                src.pending.clear()
                guards.append(_fail(f"{expr} is not {constant}", f"{locator.describe()} is another tensor now"))
        guards += [f"h{handle} = a{index}" for index, handle in enumerate(self.record.arg_handles)]
        guards += [f"h{handle} = kw[{name!r}]" for name, handle in self.record.kwarg_handles.items()]
        guards += self._inputs_apart_guard(args, kwargs, src)
        guards += self._input_gradients(objects, src)
        optimizers = reached_optimizers(self.function, kwargs)
        known = {id(optimizer) for _, optimizer in optimizers}
        # stepped through a helper the function calls: reached through the recorded object, held weakly
        optimizers += [(f"{src.constant(ref, 'or')}()", ref()) for ref in self.record.optimizers_stepped
                       if ref() is not None and id(ref()) not in known]
        for ref in self.record.optimizers_stepped if not self.checked else ():
            # one found by a path (`trainer.opt`, `opts[0]`) is still there: a new optimizer put
            # there (a new training stage) has its own settings
            locator = names.optimizer_locators.get(id(ref())) if ref() is not None else None
            if locator is not None and locator.steps and id(ref()) not in known:
                expr = src.locator(locator)
                guards += [*src.pending, _fail(f"{expr} is not {src.constant(ref, 'or')}()",
                                               f"{locator.describe()} is another optimizer")]
                src.pending.clear()
        guards += self._generator_guards(names, kwargs, src) if not self.checked else []
        bindings = find_bindings(self.record, objects, optimizers, scalars)
        stepped = stepped_optimizers(self.record, objects, optimizers)
        read = keys_read_through(self.function, "param_groups") if not self.checked else None
        if read:
            # the function reads settings itself (`lr * wd` of its own decay, a loss scaled by the
            # learning rate, a coefficient kept in a group): a bound setting would reach step()
            # alone, and an optimizer that did not step may still feed them to the function's ops.
            # Those it may read (the keys its code holds) are compared.
            bindings = [b for b in bindings if b.key not in read]
        settings = setting_guards(optimizers, bindings, src, _fail, stepped, read or frozenset())
        settings += scaler_guards(self.function, kwargs, self.record.scalers_updated, src.constant, _fail)
        if not self.checked:  # a checked call runs step(), and its hooks with it
            guards += optimizer_hook_guards(optimizers, src.constant, _fail, new_hooks)
        if new_hooks:
            # torch numbers every hook handle from one counter: while it stands where it stood when
            # these hook dicts were empty, none can have been filled (a hook registered elsewhere
            # moves it too: the checks run once and learn the new count)
            seen = src.constant([RemovableHandle.next_id], "hid")
            guards += [f"if HOOK_HANDLES.next_id != {seen}[0]:", *(f"    {line}" for line in new_hooks),
                       f"    {seen}[0] = HOOK_HANDLES.next_id"]
            src.namespace["HOOK_HANDLES"] = RemovableHandle
        if settings:  # a checked call at the API level (S given) has compared every number already
            guards += ["if S is None:", *(f"    {line}" for line in settings)]
        self.bound_scalars = scalars  # a checked call at the API level starts from these (`S`)
        for binding in bindings:
            guards.append(f"if S is None: s[{binding.slot}] = {binding.expression()}")
        # The program only reads the scalars: without settings to bind, the recorded list serves.
        # A checked call at the API level passes the numbers the function just used (S).
        own = "list(SCALARS)" if bindings else "SCALARS"
        self._names = names
        self._bound = objects
        self._escape_guards: list[str] = []  # filled by the epilogue: checks before the program runs
        self.unplaced: list[str] = []  # and the tensors it kept where tracejit cannot find them
        self.kept_slots: dict[int, KeptSlot] = {}  # of those, the ones a checked call's function holds
        program = self._program_lines(objects, kwargs, src)
        self._names = self._bound = self._handle_of = None  # binding's own: they hold the call's tensors
        guards += self._escape_guards
        lines += [f"s = {own} if S is None else S", "try:", *(f"    {line}" for line in guards),
                  "except (KeyError, AttributeError, IndexError, TypeError):",
                  "    return MISS  # a module, optimizer or global no longer has what it had"]
        lines += program
        self.failure_point.first_line += len(lines) - len(program) + 2  # `def call` is line 1, lines[k] line k + 2
        self.sources["call"], self.call = src.function("call", "args, kw, S=None, E=None", lines)
        self.sources["admit"], self.admit = src.function("admit", "args, kw", [*admit, "return True"])

    def _input_gradients(self, objects: dict[int, torch.Tensor], src: _Source) -> list[str]:
        """An input that is a leaf requiring grad and gets its `.grad` from the call's backward (an
        adversarial step, input optimization): the epilogue gives this call's input the program's
        gradient (`_input_grads`), and the call needs the input without one, as recorded. One that
        accumulates into the `.grad` it had reads it where it is, as a parameter's (_external_guard:
        `delta.grad = None` every few calls gives it a new one); one bound as a view of other memory
        needs that same gradient tensor (the program writes into the one it was bound to): another
        makes the call run the function. Whether the input holds a `.grad` at all is its signature's."""
        self._input_grads: dict[int, str] = {}  # id(the gradient object now) -> the input's expression
        handle_of = {id(t): h for h, t in objects.items()}
        inputs = [(f"a{i}", f"positional argument {i}", h) for i, h in enumerate(self.record.arg_handles)]
        inputs += [(f"kw[{name!r}]", f"keyword argument {name!r}", h) for name, h in self.record.kwarg_handles.items()]
        lines = []
        for expr, what, handle in inputs:
            tensor = objects.get(handle)
            if tensor is None or not (tensor.is_leaf and tensor.requires_grad) or tensor.grad is None:
                continue
            grad = handle_of.get(id(tensor.grad))
            if grad is not None and self.record.tensors[grad].kind is Kind.INTERNAL:
                self._input_grads[id(tensor.grad)] = expr
                lines.append(_fail(f"{expr}.grad is not None", f"the {what} has a .grad already"))
            elif grad not in self._grads_read_through_inputs:  # accumulated into, in place, into the one bound
                ref = src.constant(weakref.ref(tensor.grad), "r")
                lines.append(_fail(f"{expr}.grad is not {ref}()", f"the {what} has another .grad"))
        return lines

    def _program_lines(self, objects: dict[int, torch.Tensor], kwargs: dict, src: _Source) -> list[str]:
        """The program's straight-line body inlined after the guards (they bound its inputs to the
        locals h<handle> it reads), with gradients off, then the epilogue."""
        run = self.program.run
        clashes = {name for name in run.__globals__ if name in src.namespace and name != "__builtins__"}
        if clashes:
            raise AssertionError(f"tracejit: generated names used twice in one call: {sorted(clashes)}")
        src.namespace.update((k, v) for k, v in run.__globals__.items() if k != "__builtins__")
        bound = {*self.record.arg_handles, *self.record.kwarg_handles.values()}
        bound |= {info.handle for info in self.record.tensors if info.kind is Kind.EXTERNAL}
        # hoisted views of externals and constants come from the binding's template; a literal the
        # call writes or lets outlive it is a new tensor on every call (eager makes one each time),
        # a copy of the recorded one: nothing a call returned or left in Python state changes later
        graph = self.program.graph
        loads = []
        for h in run.parts.loads:
            if h in bound:
                continue
            load = f"h{h} = {src.constant(self.env_template[h], 'c')}"
            if h not in graph.fresh:
                loads.append(load)
            elif _made_at(self.record, h) in graph.inference_flipped:  # made inside torch.inference_mode()
                loads += [f"with INFERENCE_MODE({not graph.inference_mode}):", f"    {load}.clone()"]
            else:
                loads.append(f"{load}.clone()")
        epilogue = self._epilogue(objects, kwargs, src)
        failure = FailureEffects(self.record, graph, run.parts, self.stores, self._clear_target, src)
        lines = [*loads, "grad = IS_GRAD()", "if grad: SET_GRAD(False)"]
        ending = ["finally:", "    if grad: SET_GRAD(True)"]
        if any_autocast_enabled():  # the call context guard holds it on for every call of this binding
            src.namespace["OUTSIDE_AUTOCAST"] = outside_autocast
            lines += ["autocast_off = OUTSIDE_AUTOCAST()", "autocast_off.__enter__()"]
            ending.append("    autocast_off.__exit__(None, None, None)")
        lines.append("try:")
        # the program's first line among these; `bind` adds where these begin in `call`
        self.failure_point = failure.point
        failure.point.first_line = len(lines)
        return [*lines, *(f"    {line}" for line in (*run.parts.body, *epilogue)), *failure.handler(), *ending]

    def _call_clears(self, param: int | None, grad: int) -> bool:
        """Whether the recorded call set `param.grad = None` after it made or last wrote `grad`.
        A `.grad` found None at binding may have been cleared by the caller between calls
        (`zero_grad()` after a traced forward and backward), while something else keeps the
        gradient alive (DDP's reducer, whose bucket views are the gradients): the program
        must leave it set then."""
        producer = self.record.tensors[grad].producer
        last_write = max((op.index for op in self.record.ops if grad in op.mutated), default=-1)
        after = max(-1 if producer is None else producer, last_write)
        return any(handle == param and position > after for position, handle in self.record.grad_clears)

    def _clear_target(self, handle: int, src: _Source) -> str | None:
        """An expression for the tensor whose `.grad` the function cleared (Record.grad_clears), good
        anywhere in the program (the program drops its locals at their last use)."""
        info = self.record.tensors[handle]
        if info.kind is Kind.ARG:
            return f"a{self.record.arg_handles.index(handle)}"
        if info.kind is Kind.KWARG:
            return f"kw[{info.name!r}]"
        if info.kind is not Kind.EXTERNAL or self._bound.get(handle) is None:
            return None  # made by the call: nothing held it before
        if handle in self.external_slots:  # the object the checked call matched
            return f"E[{self.external_slots[handle]}]"
        return f"{src.constant(weakref.ref(self._bound[handle]), 'r')}()"  # guarded: the one bound

    def _signature_checks(self, args: tuple, kwargs: dict, grad_state: tuple | None, src: _Source,
                          input_grads: tuple[bool, ...] | None = None) -> list[str]:
        """The input signature of this trace (see signature.py), checked on the call's inputs;
        `input_grads`: which of them held a `.grad` when the recorded call began (None: as now)."""
        lines = [_fail(f"len(args) != {len(args)} or kw.keys() != {src.constant(set(kwargs), 'keys')}",
                       "other arguments")]
        lines += [f"a{i} = args[{i}]" for i in range(len(args))]
        tensors = [(f"a{i}", a, h) for i, (a, h) in enumerate(zip(args, self.record.arg_handles, strict=True))]
        tensors += [(f"kw[{n!r}]", v, self.record.kwarg_handles[n]) for n, v in sorted(kwargs.items())
                    if isinstance(v, torch.Tensor)]
        precise = []
        for expr, tensor, handle in tensors:
            grad = "not " if tensor.requires_grad else ""
            inference = "not " if tensor.is_inference() else ""
            # the metadata the recorded call received: the call itself may have changed it (`x.t_()`)
            meta = self.record.tensors[handle].meta
            precise.append(_fail(
                f"type({expr}) is not {src.constant(type(tensor), 'T')} or "
                f"{expr}.shape != {src.constant(torch.Size(meta.shape), 's')} or "
                f"{expr}.stride() != {src.constant(meta.stride, 'st')} or {expr}.dtype is not "
                f"{src.constant(meta.dtype, 'd')} or {_other_device(expr, meta.device, src)} or "
                f"{grad}{expr}.requires_grad or {inference}{expr}.is_inference() or "
                f"{_other_math_bits(expr, meta.math_bits, src)}", "another tensor signature"))
        if tensors:  # before any size is read: a strided nested tensor has none (the C++ guard aborts on it)
            tensor_type = src.constant(torch.Tensor, "T")
            lines.append(_fail(" or ".join(f"isinstance({expr}, {tensor_type}) and {expr}.is_nested"
                                           for expr, _, _ in tensors), "a nested tensor, which the slow path refuses"))
        lines += _guarded_by_meta([expr for expr, _, _ in tensors], precise, src)
        # whether an input that requires grad holds a `.grad` (tensor_key), as the recorded call's
        # did when it began: the call after a binding one finds the gradient that one made
        if input_grads is None:
            input_grads = tuple(bool(tensor.requires_grad and holds_grad(tensor)) for _, tensor, _ in tensors)
        held = [f"HOLDS_GRAD({expr}) is not {had}" for (expr, tensor, _), had in zip(tensors, input_grads, strict=True)
                if tensor.requires_grad]
        if held:
            src.namespace["HOLDS_GRAD"] = holds_grad
            lines.append(_fail(" or ".join(held), "an input that requires grad holds a .grad now, or no longer does"))
        lines += _same_object_checks([expr for expr, _, _ in tensors], [t for _, t, _ in tensors])
        # A gradient hook of an input (`x.register_hook(...)`, `register_post_accumulate_grad_hook`)
        # is a Python function of that tensor object: the program holds what the bound call's hooks
        # computed, which another input's hooks (or none) would not. Only inputs requiring grad
        # (the signature fixes which) can have one run.
        hooked = [expr for expr, tensor, _ in tensors if tensor.requires_grad and any_gradient_hooks((tensor,))]
        if hooked:
            lines.append(_fail("True", f"input {hooked[0]} had a gradient hook when bound: it runs only with the function"))
        else:
            watched = [expr for expr, tensor, _ in tensors if tensor.requires_grad]
            if watched:
                src.namespace["HOOKED"] = any_gradient_hooks
                lines.append(_fail(f"HOOKED(({', '.join(watched)},))", "an input that requires grad has a gradient hook"))
        if len(tensors) > 1:  # inputs in one another's memory: see signature.shared_memory
            shared = shared_memory([t for _, t, _ in tensors])
            lines.append(_fail(f"SHARED([{', '.join(expr for expr, _, _ in tensors)}]) != {shared}",
                               "other inputs lie in one another's memory now"))
        if grad_state is not None:
            lines.append(_fail(f"GRAD_STATE(kw) != {src.constant(grad_state, 'g')}", "other .grad state"))
        return lines

    def _compute_hoisted(self, objects: dict[int, torch.Tensor]) -> None:
        """Views of externals are made once per binding and handed to every call in the template."""
        template = [None] * self.program.graph.num_handles
        for handle, tensor in self.program.graph.constants.items():  # captured and folded
            template[handle] = tensor
        if self.program.hoisted:
            env = list(template)
            for info in self.record.tensors:
                if info.kind is Kind.EXTERNAL:
                    env[info.handle] = objects.get(info.handle)  # a freed gradient has no hoisted view
            with torch.no_grad():
                self.program.init(env)
            for handle in self.program.hoisted:
                template[handle] = env[handle]
        self.env_template = template

    def _freed_gradients(self, objects: dict[int, torch.Tensor], grad_owners: dict[int, int],
                         names: ExternalNames) -> dict[int, int]:
        """gradient handle -> its parameter's handle, for the gradients a call read as `p.grad` and
        then freed itself (`zero_grad()` after a step that accumulated into them: the caller or the
        call before it made them). No object is left to bind, but every such call finds its own
        where the function does, in `p.grad` (_freed_gradient_guard), as gradients read where they
        are (_external_guard); the epilogue frees it again. A checked call's parameter is the one
        its checker matched (`grad_owners`); otherwise one found by a path whose gradient the
        record names after it. Not for a gradient whose views the program keeps (their storage
        is fixed at binding)."""
        self._freed_grad_params: dict[int, Locator] = {}  # found by their paths: the parameters' paths
        by_name = {info.name: info.handle for info in self.record.tensors
                   if info.kind is Kind.EXTERNAL and objects.get(info.handle) is not None}
        grad_owners = dict(grad_owners)
        for info in self.record.tensors:
            if info.handle in grad_owners or not info.name.endswith(".grad"):
                continue
            param = by_name.get(info.name[:-len(".grad")])
            locator = None if param is None else names.locator_of(objects[param])
            if locator is not None and locator.state_of is None and locator.group is None:
                grad_owners[info.handle] = param
                self._freed_grad_params[param] = locator
        freed = {}
        for grad, param in grad_owners.items():
            info = self.record.tensors[grad]
            if (objects.get(grad) is None and info.kind is Kind.EXTERNAL and info.base is None
                    and grad not in self.program.hoisted_roots
                    and (param in self.external_slots or param in self._freed_grad_params)
                    and objects.get(param) is not None and objects[param].grad is None
                    and self._call_clears(param, grad)):
                freed[grad] = param
        return freed

    def _freed_gradient_guard(self, info: Any, src: _Source) -> list[str]:
        """The guard of a gradient in _freed_gradients: `p.grad` of the parameter now, a tensor of
        its own (torch's AccumulateGrad makes one: no view, at the start of its storage) with the
        recorded layout; the epilogue sets `p.grad = None` as the function did."""
        owner = self._freed_grads[info.handle]
        lines = []
        if owner in self.external_slots:  # the object the checked call matched
            param = f"E[{self.external_slots[owner]}]"
        else:  # found where the function finds it, by its path (good in the epilogue too)
            path = self._freed_grad_params[owner]
            param = src.locator(Locator(path.root, (*path.steps, ("grad", None))))[:-len(".grad")]
            lines += src.pending
            src.pending.clear()
        local = f"h{info.handle}"
        self._located_grads.append(local)
        if param not in self._cleared_grads:
            self._cleared_grads.append(param)
        self._meta.append((local, _layout_check(local, info, src)))
        return [*lines, f"{local} = {param}.grad",
                _fail(f"{local} is None or {local}._base is not None or {local}.storage_offset() != 0",
                      f"{info.name} is missing, a view")]

    def _external_guard(self, info: Any, obj: torch.Tensor, src: _Source, names: ExternalNames) -> list[str]:
        """One check per external: still the object the function would reach (and alive), with the
        recorded shape, dtype and device, and the same storage when views of it are kept."""
        local, ref = f"h{info.handle}", src.constant(weakref.ref(obj), "r")
        locator = names.locator_of(obj)
        slot = self.external_slots.get(info.handle)
        is_grad = locator is not None and bool(locator.steps) and locator.steps[-1][0] == "grad"
        through = self._input_grad_exprs.get(id(obj)) if locator is None else None
        if through is not None and obj._base is None and info.handle not in self.program.hoisted_roots:
            # the gradient of an input, accumulated into: read where it is, as a parameter's below
            # (`delta.grad = None` every few calls gives the input a new one; _input_gradients)
            is_grad = True
            lines = [f"{local} = {through}.grad"]
            same = (f"{local} is None or {local}._base is not None or {local}.storage_offset() != "
                    f"{obj.storage_offset()} or {local}.stride() != {src.constant(info.meta.stride, 'st')}")
            what = f"the .grad of {through} is missing, a view"
            self._located_grads.append(local)
            self._grads_read_through_inputs.add(info.handle)
        elif slot is not None and not is_grad:  # gradients are read where they are, below
            lines = [f"{local} = E[{slot}]"]
            if locator is not None:
                src.resolved[locator] = local  # state reached through it (`opt.state[param]`) uses it
            same = "False"  # the checker matched it: the object the function used
            what = f"{info.name} (matched by the checked call)"
        elif locator is not None:
            lengths = self._list_lengths(locator, src)
            expr = src.locator(locator)
            lines = [*lengths, *src.pending, f"{local} = {expr}"]  # the lengths' lookups come first
            src.pending.clear()
            src.resolved[locator] = local
            # a freed object's reference returns None, which the located tensor is not either
            same = f"{local} is not {ref}()"
            what = f"{locator.describe()} is another tensor now"
            if is_grad and obj._base is None and info.handle not in self.program.hoisted_roots:
                # A gradient is read where it is: zero_grad() and the first backward after it give
                # the parameter a new one every few calls (gradient accumulation), which the program
                # accumulates into as the function would, given its layout and that it is no view.
                same = (f"{local} is None or {local}._base is not None or {local}.storage_offset() != "
                        f"{obj.storage_offset()} or {local}.stride() != {src.constant(info.meta.stride, 'st')}")
                what = f"{locator.describe()} is missing, a view"
                self._located_grads.append(local)
                # one the call frees (see bind), found where it is
                param = self._bound_by_locator.get(Locator(locator.root, locator.steps[:-1]))
                if (param is not None and param.grad is None and expr.endswith(".grad")
                        and self._call_clears(self._handle_of.get(id(param)), info.handle)):
                    self._cleared_grads.append(expr[:-len(".grad")])
        else:
            if (not self.checked and info.base is None and id(obj) not in self._found_through_inputs
                    and not self._first_read_in_backward(info.handle)):
                # Only its weak reference says where it is: the function may reach another tensor on
                # each call (the next batch of a data iterator, `data[i]` for a counter i), and a call
                # without it would read this one again. Two calls that ran the function must reach
                # the same object first; one that reached another refuses the trace.
                previous = self._unlocated.get(info.handle)
                self._unlocated[info.handle] = weakref.ref(obj)
                if previous is None:
                    self._unconfirmed.append(info.handle)
                elif previous() is not obj:
                    name = getattr(self.function, "__name__", "the function")
                    raise HostDependencyError(
                        f"without_host=True cannot skip {name}(): it reads t{info.handle} ({info.name}, "
                        f"{info.meta}), a tensor tracejit cannot find again from the call's arguments or the "
                        f"function's globals and closures, and two calls reached two different tensors there "
                        f"(a data iterator's batch, a list item picked at run time): a call without the "
                        f"function could not know which one it would read. Pass it as an argument, or trace "
                        f"without without_host.")
            lines = [f"{local} = {ref}()"]
            same = f"{local} is None"
            what = f"{info.name} was freed"
        if same != "False":
            lines.append(_fail(same, what))
        if not (is_grad and local in self._located_grads):  # gradients: DISTINCT_MEMORY below
            self._in_memory.append((local, obj))
        # its layout: checked for all externals at once (see _meta_checks; the guard's dispatch keys
        # hold the math bits, so a negative view fails it and meets the precise check)
        self._meta.append((local, _layout_check(local, info, src)))
        return lines

    def _list_lengths(self, locator: Locator, src: _Source) -> list[str]:
        """A tensor found at a position of a list (`history[-1]` found as `history[2]`) is where
        the function reads it only while the list keeps its length: a list the caller appends to
        makes the call run the function, which finds the tensor again."""
        lines = []
        for depth, (step, key) in enumerate(locator.steps):
            if step != "item" or type(key) is not int:
                continue
            prefix = Locator(locator.root, locator.steps[:depth])
            try:
                container = resolve(prefix, self.function, self._kwargs)
            except (KeyError, AttributeError, IndexError, TypeError):
                continue
            if isinstance(container, (list, collections.deque)):
                expr = src.locator(prefix)
                lines += [*src.pending, _fail(f"len({expr}) != {len(container)}", f"{prefix.describe()} changed length")]
                src.pending.clear()
        return lines

    def _generator_guards(self, names: Any, kwargs: dict, src: _Source) -> list[str]:
        """The program draws from the torch.Generator objects the recorded call drew from: each
        must still be where the function found it (`GEN = torch.Generator().manual_seed(e)` each
        epoch, `rngs["aug"] = ...`). One the call made itself, or found where tracejit does not
        look, cannot be guarded: such a trace does not run without the host."""
        guards = []
        for generator in drawn_generators(self.record):
            matches = [g for g in names.generators if same_generator(generator, g[0])]
            if matches and all(any(value is found[0] for value in kwargs.values()) for found in matches):
                continue  # a keyword generator: compared with the bound one already
            if not matches:
                raise HostDependencyError(
                    f"without_host=True cannot skip {self.record.function_name}(): it draws from a torch.Generator "
                    f"that it makes itself or finds where tracejit does not look for one, so a call without the "
                    f"function would draw from the recorded generator whatever the function would use. Pass the "
                    f"generator as a keyword argument or keep it in a global, or trace without without_host.")
            for found in matches:  # one, or generators seeded alike: each must stay where it is
                locator = found[1]
                expr = src.locator(locator)
                guards += [*src.pending, _fail(f"{expr} is not {src.constant(weakref.ref(found[0]), 'gr')}()",
                                               f"{locator.describe()} is another generator")]
                src.pending.clear()
        return guards

    def _plain_root_guards(self, src: _Source) -> list[str]:
        """Plain values (numbers, flags, strings, tuples of them) the function reads from its
        globals and closure cells, and those its helper functions of the same module read: the
        program has what they were built in (`x * SCALE`), so another value makes the call run the
        function. Before, a caller's `SCALE = 4.0` between calls went unseen."""
        src.namespace["SAME_VALUE"] = same_value
        guards = []
        for name, root, value in plain_roots(self.function):
            guards.append(_fail(f"not SAME_VALUE({root_expression(root)}, {src.constant(plain_copy(value), 'p')})",
                                f"{name} is not {value!r} anymore"))
        # a module held by a global or a closure cell is the same object: one rebound to another
        # over the same parameters (`MODEL = nn.Sequential(*MODEL, nn.Softmax(-1))`), or to another
        # parameterless module (`ACT = ACTS["gelu"]`), passes every parameter's guard
        for name, root, value in module_roots(self.function):
            guards.append(_fail(f"{root_expression(root)} is not {src.constant(weakref.ref(value), 'gm')}()",
                                f"{name} is another module"))
        return guards

    def _first_read_in_backward(self, handle: int) -> bool:
        """Whether autograd's engine reached the tensor first (state C++ holds across calls, such as
        DistributedDataParallel's buckets), not the function's Python code."""
        first = next((op for op in self.record.ops if handle in op.inputs), None)
        return first is not None and first.backward_of is not None

    def _gradient_hook_guards(self, objects: dict[int, torch.Tensor], src: _Source, new_hooks: list[str]) -> list[str]:
        """The gradient hooks of the parameters the recorded backward reaches are the recorded ones
        (normally none): a hook registered since (`p.register_hook(lambda g: g * 3)`,
        `register_post_accumulate_grad_hook`) would run in eager's backward, which neither a call
        without the host nor the API level's answer to `backward()` runs."""
        if not any(op.backward_of for op in self.record.ops):
            return []
        leaves = [(f"h{info.handle}", objects[info.handle]) for info in self.record.tensors
                  if info.kind is Kind.EXTERNAL and isinstance(objects.get(info.handle), torch.Tensor)
                  and objects[info.handle].requires_grad and objects[info.handle].grad_fn is None]
        without = [local for local, tensor in leaves if not gradient_hooks(tensor)]
        if without:  # only a hook registered since can give them one
            new_hooks.append(_fail(f"HOOKED(({', '.join(without)},))", "a gradient hook was registered on a parameter"))
            src.namespace.update(HOOKED=any_gradient_hooks)
        lines = []
        for local, tensor in leaves:
            if gradient_hooks(tensor):  # recorded with hooks: the program has what they computed then
                lines.append(_fail(f"HOOK_KEYS({local}) != {src.constant(gradient_hooks(tensor), 'hk')}",
                                   "the gradient hooks of a parameter changed"))
        if lines:
            src.namespace.update(HOOKED=any_gradient_hooks, HOOK_KEYS=gradient_hooks)
        return lines

    def _writes_memory(self) -> bool:
        """Whether the program writes into memory the caller owns (an input, an external or a view
        of one): only then can two of them over one memory compute otherwise than eager (a fused
        kernel reads the old value of what another tensor's write changed)."""
        tensors = self.record.tensors
        return any(info.flags & Flag.MUTATED and (info.kind is not Kind.INTERNAL or (
            info.base is not None and tensors[info.base].kind is not Kind.INTERNAL)) for info in tensors)

    def _memory_guard(self, src: _Source) -> list[str]:
        """The externals keep the memory they had when bound (`.data = other`, `set_()` keep the
        object): the program computes them as the memory the binding call checked apart (see
        Replayer._overlap_error), and views of them made once per binding stay views of it.
        Plain tensors the program only reads (a batch a checked call may bind anew, see
        api_replay._rebindable) are checked where they lie instead, with the inputs."""
        watched, self._loose = self._in_memory, []
        if self._writes_memory():
            written = {h for op in self.record.ops for h in (*op.outputs, *op.mutated) if h is not None}
            self._loose = [(local, obj) for local, obj in watched if self._is_loose(int(local[1:]), obj, written)]
            watched = [item for item in watched if item not in self._loose]
            self._bound_storages = frozenset(storage_address(obj) for _, obj in watched) - {0}
        else:  # memory read only: only views of externals made once per binding depend on it
            watched = [(local, obj) for local, obj in watched if int(local[1:]) in self.program.hoisted_roots]
        if not watched:
            return []
        src.namespace["DATA_PTR"] = torch.Tensor.data_ptr
        addresses = src.constant(tuple(obj.data_ptr() for _, obj in watched), "ptr")
        locals_ = ", ".join(local for local, _ in watched)
        return [_fail(f"tuple(map(DATA_PTR, ({locals_},))) != {addresses}",
                      "an external has other memory now (`.data = ...`, `set_()`)")]

    def _is_loose(self, handle: int, obj: torch.Tensor, written: set[int]) -> bool:
        return (type(obj) is torch.Tensor and not obj.requires_grad and obj._base is None and handle not in written
                and handle not in self.program.hoisted_roots and self.record.tensors[handle].base is None)

    def _inputs_apart_guard(self, args: tuple, kwargs: dict, src: _Source) -> list[str]:
        """The inputs, and the externals checked where they lie, lie in the other externals'
        memory and in one another's exactly where the binding call's did (normally nowhere): the
        program computes them as the memory they were then (a call passing a parameter, or a
        view of one, as an input). Compared by storage."""
        storages = self._bound_storages
        if not storages and not self._loose:
            return []
        tensors = [(f"h{h}", t) for h, t in zip(self.record.arg_handles, args) if isinstance(t, torch.Tensor)]
        tensors += [(f"h{h}", kwargs[n]) for n, h in self.record.kwarg_handles.items() if isinstance(kwargs[n], torch.Tensor)]
        tensors += self._loose
        if not tensors:
            return []
        src.namespace["MEMORY_APART"] = memory_apart
        loose = bool(self._loose)  # with them, also where they lie in one another and the inputs
        bound = memory_apart(tuple(t for _, t in tensors), storages, loose)
        return [_fail(f"MEMORY_APART(({', '.join(local for local, _ in tensors)},), {src.constant(storages, 'sto')}, "
                      f"{loose}) != {src.constant(bound, 'apart')}",
                      "an input lies in an external's memory now, or no longer")]

    def _meta_checks(self, src: _Source) -> list[str]:
        """The shape, dtype and device checks of the externals bound so far."""
        return _guarded_by_meta([local for local, _ in self._meta], [check for _, check in self._meta], src)

    def _epilogue(self, objects: dict[int, torch.Tensor], kwargs: dict, src: _Source) -> list[str]:
        """Leave escaped values where the function would have put them; return fresh outputs. The
        lines that leave each value are also kept per handle (`self.stores`), for a program that
        raises (FailureEffects)."""
        self.stores: list[tuple[int, list[str]]] = []  # (handle, the lines that leave its value)
        self.escaped_objects = {}  # handle -> the object Python holds (weakly): also for runtime/api_replay.py
        self.assigned_holders: dict[int, Holder] = {}  # handle -> where it is assigned anew: also for api_replay
        # A returned tensor, and the base of a returned view, belong to the caller of an earlier
        # call once returned: writing into one would change what that call returned. Where Python
        # state holds such a tensor too (`self.last = out`), the new one is assigned there instead.
        tensors = self.record.tensors
        returned_bases = {tensors[h].base for h in range(len(tensors))
                          if tensors[h].flags & Flag.RETURNED and tensors[h].base is not None}
        # and the tensors a returned view keeps alive as its `_base` (a view of `x.detach()`):
        # they outlive the call because the caller holds the view, not because of Python state
        python_bases = {id(obj._base) for h, obj in objects.items()
                        if tensors[h].flags & Flag.RETURNED and obj._base is not None}
        holders = find_holders(kwargs)
        # the gradients of parameters reached otherwise (a closure's model): the trace's externals
        for handle, tensor in objects.items():
            if tensors[handle].kind is Kind.EXTERNAL and tensor.is_leaf and tensor.grad is not None:
                holders.setdefault(id(tensor.grad), Holder("grad", weakref.ref(tensor)))
        # the gradient a literal leaf got (`w = torch.tensor(data, requires_grad=True)` ... backward):
        # this call's literal gets this call's gradient
        literal_grads = {id(obj.grad): handle for handle, obj in objects.items()
                         if handle in self.program.graph.fresh and obj.is_leaf and obj.grad is not None}
        written: set[int] = set()  # the memory of the views held where tracejit cannot find them
        graph_leaves = None  # ids of the leaves the autograd graphs of returned tensors hold
        # what a checked call's program leaves when it runs at a read: the values read and seen
        # (the program computes them: no object needed) and the ones that outlive the call
        early = set(self.program.graph.read_exports) if self.checked else set()
        read_only = {h for h in early if not tensors[h].flags & Flag.ESCAPED}  # kept to the end for reads alone
        for handle in sorted(self.program.graph.escaped):
            obj = objects.get(handle)
            if obj is None or handle in read_only:
                continue
            if self.checked and tensors[storage_root(self.record, handle)].kind is Kind.INTERNAL:
                early.add(handle)
            body: list[str] = []
            self.stores.append((handle, body))
            if id(obj) in self._input_grads:  # this call's input gets its own gradient
                body.append(f"{self._input_grads[id(obj)]}.grad = h{handle}")
                continue
            if id(obj) in literal_grads and literal_grads[id(obj)] in self.program.graph.escaped:
                body.append(f"h{literal_grads[id(obj)]}.grad = h{handle}")
                continue
            holder = holders.get(id(obj))
            if holder is not None and holder.kind == "state" and not self.checked:
                self._escape_guards += self._created_state_guard(holder, src)
            if holder is None:
                place = self._names.place_of(obj)
                if place is not None:
                    # a place reached otherwise (`cache["last"] = y`, a global module's attribute):
                    # its container is looked up before the program runs, where a lookup may fail
                    container = f"pc{len(self._escape_guards)}"
                    self._escape_guards.append(f"{container} = {container_expression(place)}")
                    body += Place(place, self.function).store(f"h{handle}", container)
                    self.assigned_holders[handle] = Place(place, self.function)
                    continue
            # A module attribute or buffer the function assigned (`self.last = loss.detach()`), and
            # a gradient it made (backward after zero_grad()), is a new tensor on every eager call:
            # a reference to an earlier one kept by the user (`history.append(model.last)`,
            # `last = p.grad`) must keep its value, so it is assigned, never written.
            assigned = holder is not None and holder.kind in ("attr", "buffer", "grad")
            if (assigned or tensors[handle].flags & Flag.RETURNED or handle in returned_bases
                    or id(obj) in python_bases):
                if holder is not None:
                    body += holder.store(f"h{handle}", None, src)
                    self.assigned_holders[handle] = holder
                continue
            ref = src.constant(weakref.ref(obj), "r")
            self.escaped_objects[handle] = src.namespace[ref]
            if holder is not None:
                body += holder.store(f"h{handle}", ref, src)
            elif self.checked and tensors[storage_root(self.record, handle)].kind is Kind.INTERNAL:
                # A checked call at the API level: the function ran and holds what it kept (a list it
                # appends to) as a placeholder, which api_replay puts in this slot; the placeholder
                # takes the program's tensor's memory (fresh on every call: it outlives the call),
                # so a kept `loss.detach()` shares the returned loss's as in eager. A call that did
                # not keep it leaves the slot empty
                slot = self.kept_slots[handle] = KeptSlot()
                ref = src.constant(slot, "k")
                self.escaped_objects[handle] = slot
                body += [f"o = {ref}()", "if o is not None:", f"    o.set_(h{handle})"]
            else:
                # Held where tracejit cannot find it. A view of memory the call made is written into
                # the view held now (DistributedDataParallel's gradient buckets: its reducer holds
                # them and reads them next call). A tensor of its own may be held by a list the
                # function appends to (`history.append(acc)`), which a write would not repeat, and a
                # view of the call's input or output would write into an earlier call's: such calls
                # run the function, which does what eager does.
                root = handle
                while tensors[root].base is not None:
                    root = tensors[root].base
                if graph_leaves is None:
                    graph_leaves = _leaves_of_returned_graphs(objects, tensors)
                if root == handle and id(obj) in graph_leaves:
                    # a leaf made in the call (`xi.requires_grad_()` of a gradient penalty) that the
                    # graph of a returned tensor holds: host-free calls return that tensor without
                    # a graph, and the old leaf gets the new values all the same
                    pass
                elif root == handle or tensors[root].kind in (Kind.ARG, Kind.KWARG) or tensors[root].flags & Flag.RETURNED:
                    what = "a tensor it made" if root == handle else f"a view of the call's {tensors[root].name}"
                    self._escape_guards.append(_fail("True", f"t{handle}, {what}, is kept where tracejit cannot find it"))
                    self.unplaced.append(f"t{handle}, {what},")
                body += [f"o = {ref}()", f"if o is not None and o is not h{handle}:", f"    o.copy_(h{handle})"]
                written.add(storage_address(obj))
        body = self._grad_mode_views(objects)
        self.early.handles = frozenset(early)
        if early:
            values = src.constant(self.early, "ev")
            body += [f"if {values}.on:", f"    {values}.values = {{{', '.join(f'{h}: h{h}' for h in sorted(early))}}}"]
        body += [line for _, lines in self.stores for line in lines]
        body += [f"{param}.grad = None" for param in self._cleared_grads]
        for _, ref in self.record.outside_grad_clears:  # parameters the call cleared but no op of it used
            body += [f"o = {src.constant(ref, 'r')}()", "if o is not None: o.grad = None"]
        body += self._bucket_gradients(kwargs, written, src)
        # DistributedDataParallel's forward leaves `require_forward_param_sync` as grad mode and
        # no_sync() say (`_post_forward`): whether the next forward broadcasts the buffers. The
        # signature fixes both, so the recorded call's value is every call's
        for ref in self.record.modules_called:
            module = ref()
            if module is not None and is_ddp(module) and _FORWARD_SYNC in module.__dict__:
                body += [f"d = {src.constant(ref, 'dr')}()",
                         f"if d is not None: d.{_FORWARD_SYNC} = {module.__dict__[_FORWARD_SYNC]!r}"]
        # A leaf the function made and flagged (`torch.zeros_like(x).requires_grad_()`,
        # `torch.tensor(data, requires_grad=True)`): the flag is set in Python, never dispatched, so
        # the program's tensor needs it set again (a literal left in Python state too)
        made = {handle for handle in self.program.graph.fresh if handle in self.program.graph.escaped}
        body += [f"h{handle}.requires_grad_(True)" for handle, obj in sorted(objects.items())
                 if ((tensors[handle].flags & Flag.RETURNED and tensors[handle].kind is Kind.INTERNAL) or handle in made)
                 and obj.is_leaf and obj.requires_grad]
        body.append(f"return {_output_expr(self.record.output, src, self.record.function_name)}")
        return body


    def _grad_mode_views(self, objects: dict[int, torch.Tensor]) -> list[str]:
        """Lines that make the returned and kept views of a leaf requiring grad (`model[2].bias[1:]`,
        `w.t()`) again with gradients on, as the function made them. The program runs without
        gradients, and a view made so of a tensor requiring grad cannot be read once its base is
        written in place with gradients on (the next step's update): torch raises "A view was created
        in no_grad mode ...". Made again (as a strided view of the same memory), it has eager's
        `requires_grad` and autograd history to its leaf, and follows the leaf's later updates. Only
        views the binding call made with gradients on (a `grad_fn`): one the function made under
        `torch.no_grad()` stays as eager has it."""
        tensors, lines = self.record.tensors, []
        for handle in sorted({h for h in range(len(tensors)) if tensors[h].flags & Flag.RETURNED}
                             | set(self.program.graph.escaped)):
            obj = objects.get(handle)
            base = obj._base if obj is not None else None
            if tensors[handle].kind is not Kind.INTERNAL or tensors[handle].base is None or base is None:
                continue
            try:
                made_with_grad = obj.grad_fn is not None
            except RuntimeError:  # made without gradients, its base written since: torch refuses it
                continue
            if made_with_grad and base.is_leaf and base.requires_grad:
                local = f"h{handle}"
                lines += ["SET_GRAD(True)", "try:", f"    {local} = {local}._view_func({local}._base)",
                          "finally:", "    SET_GRAD(False)"]
        return lines

    def _created_state_guard(self, holder: Holder, src: _Source) -> list[str]:
        """An optimizer state entry the bound call created, finding none (a momentum buffer made
        from the first gradient, Adam's `step` and moments): the program makes it anew, as the
        function does only while the entry is missing. With the entry there (the next call after a
        fresh optimizer's first one, which replayed the record that created the state without
        differing), the function would read and update it, an other trace: the call runs the
        function, which records that one. An entry the bound call found and replaced (a
        hand-written optimizer's `state["buf"] = state["buf"] * m + g`) is assigned on every call,
        as the function does: no guard."""
        param_ref, key = holder.key
        if self._names.had_state_entry(holder.owner(), param_ref(), key):
            return []
        owner, param = src.constant(holder.owner, "r"), src.constant(param_ref, "r")
        return [_fail(f"{owner}().state.get({param}(), EMPTY).get({key!r}) is not None",
                      f"the optimizer state the program creates ({key!r}) exists now")]

    def _bucket_gradients(self, kwargs: dict, written: set[int], src: _Source) -> list[str]:
        """DistributedDataParallel with `gradient_as_bucket_view=True`: a parameter's `.grad` is a
        view of a bucket that the reducer holds, and that its backward sets as `.grad` again after
        `zero_grad()`. The program writes the bucket (the views held where tracejit cannot find
        them); the `.grad` of each such parameter is put back as the function's call left it."""
        lines = []
        for param in parameters_of(kwargs):
            grad = param.grad
            if grad is not None and grad._base is not None and storage_address(grad) in written:
                param_ref, grad_ref = src.constant(weakref.ref(param), "bp"), src.constant(weakref.ref(grad), "bg")
                lines += [f"p = {param_ref}()", f"if p is not None and p.grad is None: p.grad = {grad_ref}()"]
        return lines


class FailurePoint:
    """Where the program of a call raised, told by the line of the generated `call` the exception
    left (nothing is counted while the program runs): the record position of the first op of the
    node that raised, and that node's index in the graph."""

    def __init__(self, graph: Graph, origins: tuple[int, ...]):
        self.first_line = 0  # the line of `call` with the program's first line (HostFreeRunner.bind)
        self.origins = origins
        self.graph = graph

    def __call__(self, error: BaseException) -> tuple[int, int] | None:
        traceback = error.__traceback__  # its first entry is the frame of `call`, which caught it
        line = traceback.tb_lineno - self.first_line if traceback is not None else -1
        if not 0 <= line < len(self.origins):
            return None  # after the program (the epilogue): nothing of it is owed
        node = self.origins[line]
        return min(self.graph.nodes[node].positions, default=-1), node


class FailureEffects:
    """What a call whose program raises leaves in Python state: what an eager call that raised at
    that op leaves. The epilogue leaves the escaped values after the whole program, and Python's
    `.grad = None` (`opt.zero_grad()` before the forward) is no op of it at all; when an op raises
    (an index out of range, a bad label), the `.grad` clears made before it (Record.grad_clears)
    and the values of the nodes that ran before it (a gradient backward made, a module attribute)
    are left in eager's order. DistributedDataParallel's sync flag is left alone: every call sets
    it to the same value."""

    def __init__(self, record: Record, graph: Graph, parts: RunParts, stores: list[tuple[int, list[str]]],
                 clear_target: Callable[[int, _Source], str | None], src: _Source):
        self.point = FailurePoint(graph, parts.origins)
        made_by: dict[int, int] = {}  # handle -> the first node whose line binds its local
        for node in dict.fromkeys(parts.origins):
            for vid in graph.nodes[node].outputs:
                if vid is not None:
                    made_by.setdefault(graph.values[vid].handle, node)
        effects = []  # ((eager position, values before clears), lines)
        for position, handle in record.grad_clears:
            target = clear_target(handle, src)
            if target is not None:
                effects.append(((position, 1), [f"if failed_op >= {position}: CLEAR_GRAD({target})"]))
        for position, ref in record.outside_grad_clears:  # no op used them: found by reference
            effects.append(((position, 1), [f"if failed_op >= {position}: CLEAR_GRAD({src.constant(ref, 'r')}())"]))
        for handle, lines in stores:
            if not lines:
                continue
            producer = record.tensors[handle].producer
            position = (producer if producer is not None else _made_at(record, handle)) + 1
            # a value bound before the program (a literal's copy) is there whatever ran
            effects.append(((position, 0), [f"if failed_node > {made_by.get(handle, -1)}:",
                                            *(f"    {line}" for line in lines)]))
        self.lines = [line for _, lines in sorted(effects, key=lambda effect: effect[0]) for line in lines]
        if self.lines:
            src.namespace.update(FAILED_AT=self.point, CLEAR_GRAD=_clear_grad)

    def handler(self) -> list[str]:
        """The `except` clause of the program's `try` (free while nothing raises)."""
        if not self.lines:
            return []
        return ["except BaseException as error:", "    at = FAILED_AT(error)", "    if at is not None:",
                "        failed_op, failed_node = at", *(f"        {line}" for line in self.lines), "    raise"]


def _clear_grad(tensor: torch.Tensor | None) -> None:
    if tensor is not None:
        tensor.grad = None


def _made_at(record: Record, handle: int) -> int:
    """The position of the first op that takes `handle` (a literal: its aten.lift_fresh)."""
    return next((op.index for op in record.ops if handle in op.inputs), -1)


def _output_expr(spec: OutputSpec, src: _Source, function_name: str) -> str:
    """The expression of the returned value: literals of plain containers, keys without a literal
    form (a dtype, an Enum member) as constants, and a subclass (a namedtuple, an OrderedDict) made
    of its elements by its class, as the function returned it."""
    if spec.kind == "tensor":
        return f"h{spec.handle}"
    if spec.kind == "none":
        return "None"
    if spec.kind == "dict":
        expr = "{" + ", ".join(f"{_key_expr(k, src)}: {_output_expr(c, src, function_name)}"
                               for k, c in zip(spec.keys, spec.children)) + "}"
    else:
        inner = ", ".join(_output_expr(c, src, function_name) for c in spec.children)
        expr = f"[{inner}]" if spec.kind == "list" else f"({inner},)" if inner else "()"
    if spec.container is None:
        return expr
    if spec.rebuild is None:
        raise HostDependencyError(
            f"without_host=True cannot skip {function_name}(): it returns a {spec.container.__qualname__}, "
            f"which a call without the function cannot make again (its class has a constructor of its own, "
            f"or the object has attributes of its own). Return a tuple, list, dict, namedtuple or "
            f"OrderedDict, or trace without without_host.")
    return f"{src.constant(spec.container, 'oc')}({'*' if spec.rebuild == 'fields' else ''}{expr})"


def _key_expr(key: Any, src: _Source) -> str:
    """A dict key as source: a literal when its repr is one, else a constant of the namespace."""
    return repr(key) if type(key) in (str, int, bool, type(None)) else src.constant(key, "ok")


def memory_apart(tensors: tuple[torch.Tensor, ...], storages: frozenset, among: bool) -> tuple:
    """Where `tensors` lie in `storages` ((i, byte offset into the storage) for each tensors[i] in
    one), and with `among` which lie in the storage of an earlier one, at what byte offset (the
    same object too: an input that is an external)."""
    inside, first, shared = [], {}, []
    for i, tensor in enumerate(tensors):
        storage = storage_address(tensor)
        if storage in storages:
            inside.append((i, tensor.data_ptr() - storage))
        if among and storage:
            j, address = first.setdefault(storage, (i, tensor.data_ptr()))
            if j != i:
                shared.append((i, j, tensor.data_ptr() - address))
    return tuple(inside), tuple(shared)


def distinct_memory(tensors: tuple[torch.Tensor, ...]) -> bool:
    """No two of these tensors start at one address (empty ones have none: address 0)."""
    addresses = [address for address in map(torch.Tensor.data_ptr, tensors) if address]
    return len(set(addresses)) == len(addresses)
