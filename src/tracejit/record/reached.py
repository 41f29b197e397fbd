"""The torch.nn modules and torch.optim optimizers a recorded call used, however it reached them.

A call without the host checks that they are as they were (runtime/module_guards.py, and the
optimizer guards of runtime/optimizer_settings.py); a DistributedDataParallel among the modules
that is not a keyword argument selects traces by its state (signature.gradient_state). Global
hooks note them while a call records: a module whose forward runs, an optimizer whose `step()`
runs, reached through a keyword argument, a closure, a global or a helper function alike.

Without the host, the same watch notes what such a call changes that a call without the function
would not: a learning-rate scheduler stepped, and settings of an optimizer's param groups written
after its `step()` (a call without the function would freeze either); a `.data = ...` on any
tensor, a parameter, an input or an intermediate alike (`torch.Tensor.data` is replaced by a
property that tells the watch while such a call runs); and the GradScalers whose `update()` it
ran, whose settings a call without the function must guard. Schedulers and scalers
have no global hooks: their classes' `step` and `update` are wrapped once, for good, and tell the
watch of the call the running thread makes, if any.

It also notes which autograd nodes the call's backward passes consumed (freed, without
`retain_graph`), by a mark in each node's `metadata` rather than by holding it (a held node would
keep alive the leaves its edges reach): a returned tensor whose `grad_fn` is not among them (the generator's output of a
GAN step, a view of a parameter) still has a graph the caller can backpropagate through, which
only a call that runs autograd can hand out. torch's `autograd._engine_run_backward`, through
which `Tensor.backward`, `autograd.backward` and `autograd.grad` all run, is wrapped for that.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from collections.abc import Iterator

import torch
import torch.optim.optimizer as optimizer_module
from torch.utils.hooks import RemovableHandle

from .ddp_calls import ddp_python_state, is_ddp
from .modes import TensorHooks
from .own_hooks import own, remove_own
from .source import user_location

_CONSUMED = "tracejit.consumed"  # the key of Seen's mark in an autograd node's metadata
_RETAINED = "tracejit.retained"  # ...and of its mark on the nodes a backward pass ran and kept (retain_graph)
_MARKS = itertools.count()

_SCHEDULER_BASES = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
# (attribute holding hooks by handle id, what they are), of modules, tensors and optimizers alike
_HOOK_DICTS = (("_forward_pre_hooks", "forward pre"), ("_forward_hooks", "forward"),
               ("_backward_pre_hooks", "backward pre"), ("_backward_hooks", "backward"),
               ("_post_accumulate_grad_hooks", "post-accumulate-grad"),
               ("_optimizer_step_pre_hooks", "step pre"), ("_optimizer_step_post_hooks", "step post"))


class Seen:
    """What one recording call used, each object once, in first-use order."""

    def __init__(self, optimizers: bool):
        # held weakly: a module made and dropped in the call (`nn.BCEWithLogitsLoss(pos_weight=w)`)
        # must not keep its tensors alive, where the record would take them for tensors the call keeps
        self._modules: list[weakref.ref] = []
        self._optimizers: list[weakref.ref] = []
        self._scalers: list[weakref.ref] = []  # without the host: GradScalers whose update() ran
        self.watch_optimizers = optimizers
        self._ids: dict[int, weakref.ref] = {}
        self.changes: list[str] = []  # without the host: what the call changed that only the function changes
        self.data_assignments: list[str] = []  # without the host: each `.data = ...`, where it ran
        self._settings_at_step: dict[int, tuple[torch.optim.Optimizer, dict]] = {}
        self._thread = threading.get_ident()
        self._scheduler_noted = False  # the first step is enough (SequentialLR steps its children: it is named)
        # what marks the autograd nodes a backward pass of the call freed (in their `metadata`,
        # which lives with the C++ node): holding the nodes would keep alive the leaves their edges
        # reach (`xi.requires_grad_()` of a gradient penalty), which the record takes for kept
        self._consumed_mark = next(_MARKS)

    @property
    def modules(self) -> list[torch.nn.Module]:
        return _alive(self._modules)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return _alive(self._optimizers)

    @property
    def scalers(self) -> list[torch.amp.GradScaler]:
        return _alive(self._scalers)

    def _note(self, found: list, obj: object) -> None:
        if threading.get_ident() != self._thread:  # the hooks are process-wide
            return
        noted = self._ids.get(id(obj))
        if noted is None or noted() is not obj:
            self._ids[id(obj)] = ref = weakref.ref(obj)
            found.append(ref)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        handles = [own(torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: self._note(self._modules, module)))]
        outer = getattr(_watched, "seen", None)
        outer_backward = getattr(_watched, "backward", None)
        _install_backward_note()
        _watched.backward = self
        if self.watch_optimizers:  # only without the host: the API level's snapshot of an optimizer takes global hooks as the user's
            handles.append(own(optimizer_module.register_optimizer_step_pre_hook(self._stepping)))
            _install_method_notes()
            _watched.seen = self
        first_hook = RemovableHandle.next_id  # the handles of hooks the call registers count from here
        try:
            with _DATA_HOOK.installed() if self.watch_optimizers else contextlib.nullcontext():
                yield
        finally:
            for handle in handles:
                remove_own(handle)
            _watched.seen = outer
            _watched.backward = outer_backward
        for optimizer, settings in self._settings_at_step.values():
            now = _settings(optimizer)
            self.changes += [f"{key} of param group {index} of {type(optimizer).__name__}: {before!r} -> "
                             f"{now[index, key]!r}, written after its step()"
                             for (index, key), before in settings.items()
                             if (index, key) in now and _differs(now[index, key], before)]
        self._settings_at_step.clear()  # the optimizers themselves: the Seen of a call may be kept
        if self.watch_optimizers and RemovableHandle.next_id != first_hook:
            self.changes += self._kept_hooks(first_hook)

    def _kept_hooks(self, first: int) -> list[str]:
        """The hooks the call registered (handle ids from `first` on) on the modules whose forward
        ran, their parameters and the optimizers it stepped and their parameters, and left there:
        eager adds one more on every call (`model[0].weight.register_hook(...)` inside the step), a
        call without the function none. A hook removed before the call returns is no change."""
        found: list[str] = []
        visited: set[int] = set()

        def note(obj: object, what: str) -> None:
            if id(obj) in visited:
                return
            visited.add(id(obj))
            for attribute, kind in _HOOK_DICTS:
                hooks = getattr(obj, attribute, None)
                if hooks and any(isinstance(key, int) and key >= first for key in hooks):
                    found.append(f"a {kind} hook registered on {what} inside the call and not removed (eager adds "
                                 f"one on every call; remove it before the call returns, or register it once "
                                 f"outside)")

        for module in self.modules:
            owner = type(module).__name__
            for name, sub in module.named_modules():
                note(sub, f"{type(sub).__name__} {name}" if name else owner)
            for name, param in module.named_parameters():
                note(param, f"parameter {name} of {owner}")
        for optimizer in self.optimizers:
            owner = type(optimizer).__name__
            note(optimizer, owner)
            for index, group in enumerate(optimizer.param_groups):
                for position, param in enumerate(group["params"]):
                    note(param, f"parameter {position} of param group {index} of {owner}")
        return found

    def _stepping(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() != self._thread:
            return
        self._note(self._optimizers, optimizer)
        if id(optimizer) not in self._settings_at_step:
            self._settings_at_step[id(optimizer)] = (optimizer, _settings(optimizer))

    def scheduler_stepped(self, scheduler: object) -> None:
        if not self._scheduler_noted:
            self._scheduler_noted = True
            self.changes.append(f"{type(scheduler).__name__}.step() at {user_location()}")

    def data_assigned(self) -> None:
        where = user_location()
        self.data_assignments.append(f"`.data` assigned at {where}: {where.code}")

    def scaler_updated(self, scaler: torch.amp.GradScaler) -> None:
        self._note(self._scalers, scaler)

    def backward_runs(self, roots: tuple, retain_graph: object, create_graph: object, inputs: object) -> None:
        """Note the nodes of the graph behind `roots` that this backward pass frees: down to the
        `inputs` it differentiates with respect to, if given (`autograd.grad(loss, h)` leaves the
        graph below `h` untouched). A pass with retain_graph=True (create_graph=True implies it)
        frees nothing: without the host, its nodes are marked apart, to tell the caller why a
        returned tensor still has a graph (retained_graph, for trace.py's GradientWarning)."""
        retained = bool(retain_graph or create_graph)
        if threading.get_ident() != self._thread or (retained and not self.watch_optimizers):
            return
        stops = {id(node) for node in map(_node_of, inputs or ()) if node is not None}
        nodes = _post_order([_node_of(root) for root in roots], stops)
        if stops:  # only the nodes from which an input is reached run (and free what they saved)
            runs: dict[int, bool] = {}
            for node in nodes:
                runs[id(node)] = any(id(child) in stops or runs.get(id(child), False)
                                     for child, _ in node.next_functions if child is not None)
            nodes = [node for node in nodes if runs[id(node)]]
        mark, key = self._consumed_mark, _RETAINED if retained else _CONSUMED
        for node in nodes:
            # a Python wrapper of a node and its id live only while held: the C++ node keeps the mark
            node.metadata[key] = mark

    def forget_consumed(self) -> None:
        """Take no node as freed by this call's backward passes (an attempt whose tensors are dropped)."""
        self._consumed_mark = next(_MARKS)

    def live_graph(self, tensor: torch.Tensor) -> bool:
        """True if `tensor` has autograd history no backward pass of the call freed."""
        node = tensor.grad_fn
        return node is not None and node.metadata.get(_CONSUMED) != self._consumed_mark

    def retained_graph(self, tensor: torch.Tensor) -> bool:
        """True if a backward pass of the call ran through `tensor`'s autograd history and kept it
        (`backward(retain_graph=True)`), and none freed it since."""
        node = tensor.grad_fn
        return (node is not None and node.metadata.get(_RETAINED) == self._consumed_mark
                and node.metadata.get(_CONSUMED) != self._consumed_mark)

    def store(self, record) -> None:
        """Keep them, weakly, with the record they were used by."""
        record.modules_called = tuple(self._modules)
        record.ddp_states = tuple((ref, ddp_python_state(module)) for ref in self._modules
                                  if (module := ref()) is not None and is_ddp(module))
        record.optimizers_stepped = tuple(self._optimizers)
        record.scalers_updated = tuple(self._scalers)


def _alive(refs: list[weakref.ref]) -> list:
    return [obj for obj in (ref() for ref in refs) if obj is not None]


# Schedulers and GradScalers have no global hooks: their `step` and `update` methods are wrapped,
# once per class and for good, to tell the Seen of the call the thread runs (if any).
_watched = threading.local()
_install_lock = threading.Lock()


def _install_method_notes() -> None:
    with _install_lock:  # new user subclasses since the last call are wrapped too
        for cls in _scheduler_classes():
            _wrap(cls, "step", Seen.scheduler_stepped)
        for cls in _subclasses((torch.amp.GradScaler,)):
            if "update" in cls.__dict__:
                _wrap(cls, "update", Seen.scaler_updated)


_TENSOR_DATA = torch._C.TensorBase.data  # the C property


def _assign_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """`tensor.data = value` while a call without the host watches: the program cannot repeat it
    (it gives the tensor object other memory, or other sizes and strides, by Python), so the watch
    is told, unless the assignment changes nothing."""
    seen = getattr(_watched, "seen", None)
    if seen is not None and not _changes_nothing(tensor, value):
        seen.data_assigned()
    _TENSOR_DATA.__set__(tensor, value)


# sizes read through TensorBase: a recording hooks torch.Tensor's shape reads, and these are not the function's
_BASE = torch._C.TensorBase


def _changes_nothing(tensor: torch.Tensor, value: object) -> bool:
    """`p.data = p` (torch's `Module._apply` after a `.to()` that moved nothing), `x.data = x.data`:
    the same memory, seen the same way."""
    if value is tensor:
        return True
    try:
        return (isinstance(value, torch.Tensor) and value.dtype == tensor.dtype and value.device == tensor.device
                and value.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
                and _BASE.storage_offset(value) == _BASE.storage_offset(tensor)
                and _BASE.size(value) == _BASE.size(tensor) and _BASE.stride(value) == _BASE.stride(tensor))
    except (RuntimeError, NotImplementedError):  # fake or meta tensors: no memory to compare
        return False


_DATA_HOOK = TensorHooks({"data": property(_TENSOR_DATA.__get__, _assign_data, doc=_TENSOR_DATA.__doc__)})


def _post_order(roots: list, stops: set[int]) -> list:
    """The autograd nodes below `roots`, children first, not entering the `stops`."""
    order, visited = [], set()
    stack = [(node, False) for node in roots if node is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
        elif id(node) not in visited and id(node) not in stops:
            visited.add(id(node))
            stack.append((node, True))
            stack += [(child, False) for child, _ in node.next_functions if child is not None]
    return order


def _node_of(value: object) -> object:
    """The autograd node of a tensor (its grad_fn) or of a GradientEdge."""
    return getattr(value, "grad_fn", None) or getattr(value, "node", None)


def _install_backward_note() -> None:
    """Wrap torch.autograd's `_engine_run_backward` once, for good: it tells the watch of the
    running thread's call which graph a backward pass is about to free."""
    original = torch.autograd.__dict__.get("_engine_run_backward")
    if original is None or getattr(original, "__tracejit_notes__", False):
        return
    with _install_lock:
        original = torch.autograd.__dict__["_engine_run_backward"]
        if getattr(original, "__tracejit_notes__", False):
            return

        @functools.wraps(original)
        def engine_run_backward(t_outputs, *args, **kwargs):
            seen = getattr(_watched, "backward", None)
            if seen is not None:  # (outputs, grad_outputs, retain_graph, create_graph, ...)
                seen.backward_runs(tuple(t_outputs), kwargs.get("retain_graph", args[1] if len(args) > 1 else None),
                                   kwargs.get("create_graph", args[2] if len(args) > 2 else None),
                                   kwargs.get("inputs", args[3] if len(args) > 3 else None))
            return original(t_outputs, *args, **kwargs)

        engine_run_backward.__tracejit_notes__ = True
        torch.autograd._engine_run_backward = engine_run_backward


def _wrap(cls: type, name: str, note) -> None:
    original = cls.__dict__[name]
    if getattr(original, "__tracejit_notes__", False):
        return

    @functools.wraps(original)
    def wrapper(obj, *args, **kwargs):
        seen = getattr(_watched, "seen", None)
        if seen is not None:
            note(seen, obj)
        return original(obj, *args, **kwargs)

    wrapper.__tracejit_notes__ = True
    setattr(cls, name, wrapper)


def _subclasses(bases: tuple) -> list[type]:
    found: list[type] = []
    pending = list(bases)
    while pending:
        cls = pending.pop()
        if cls not in found:
            found.append(cls)
            pending += cls.__subclasses__()
    return found


def _scheduler_classes() -> list[type]:
    """Every scheduler class that defines its own `step`, torch's and the user's subclasses."""
    return [cls for cls in _subclasses(_SCHEDULER_BASES) if "step" in cls.__dict__]


def _settings(optimizer: torch.optim.Optimizer) -> dict:
    """The settings of each param group that a host-free call reads or guards (no tensors)."""
    return {(index, key): value for index, group in enumerate(optimizer.param_groups)
            for key, value in group.items() if key != "params" and not isinstance(value, torch.Tensor)}


def _differs(now: object, before: object) -> bool:
    try:
        return bool(now != before)
    except Exception:  # noqa: BLE001 - a value without a truth of !=: an array the user put there
        return now is not before
