"""Put back the Python state a dropped symbolic-shape attempt changed.

In the automatic `symbolic_shape` mode (None) a call at new sizes is first recorded on stand-ins
of its inputs. When torch cannot go on with them (a size it needs as a number), the attempt is
dropped and the call records the static trace of its sizes instead, running the function again.
Nothing ran on the real tensors by then, but the attempt's Python did run: `loss.backward()` set
every `.grad` that was None to an uncomputed placeholder, an optimizer step put placeholders in
its state, a module assigned an attribute. The static run would read them (accumulate into the
placeholder `.grad`, use the placeholder momentum buffer): unwritten memory.

`StateSnapshot`, taken before the attempt, holds what the state the traced function reaches
held: the contents of the dicts and lists of every module (with its submodules), optimizer,
learning-rate scheduler, gradient scaler and object of a user's class reached from the function's keyword arguments,
globals and closure cells (directly or in a list, tuple or dict there), of the lists and dicts
those globals, cells and keyword arguments are or hold, and the `.grad` and `requires_grad` of
their parameters. `restore()` puts it back in place (the same dict and list
objects). What it does not reach (a tensor kept in a user's list) it cannot restore:
`SymbolicRecorder.left_behind` finds such a tensor, and the attempt is then not dropped.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..record.names import code_owner, roots_of
from ..record.placeholders import storage_key

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def _holds_symbolic(value: Any, depth: int = 0) -> bool:
    """A symbolic size or a stand-in tensor, or a list, tuple or dict holding one (two levels)."""
    if isinstance(value, _SYMBOLIC) or is_fake(value):
        return True
    if depth < 2 and isinstance(value, (list, tuple)):
        return any(_holds_symbolic(item, depth + 1) for item in value)
    if depth < 2 and isinstance(value, dict):
        return any(_holds_symbolic(item, depth + 1) for item in value.values())
    return False


def _set_root(function: Callable, kind: str, key: Any, value: Any) -> None:
    if kind == "global":
        function.__globals__[key] = value
    else:
        function.__closure__[key].cell_contents = value


def _cell(function: Callable, index: int) -> Any:
    try:
        return function.__closure__[index].cell_contents
    except (ValueError, IndexError, TypeError):  # an empty cell
        return None

def _plain_object(value: Any) -> bool:
    """An instance of a user's class with attributes of its own: not a module, class, function,
    tensor or torch object (their state is torch's, or not the call's to change)."""
    kind = type(value)
    return (isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, _NOT_PLAIN)
            and not kind.__module__.startswith(("torch", "tracejit", "numpy", "builtins")))


_NOT_PLAIN = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              functools.partial, torch.Tensor)

_STATEFUL = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
             torch.optim.lr_scheduler.ReduceLROnPlateau, torch.amp.GradScaler)
_DEPTH = 4  # an optimizer's __dict__ -> state -> a parameter's state -> its tensors


class StateSnapshot:
    def __init__(self, function: Callable, kwargs: dict) -> None:
        self._function, self._kwargs = function, kwargs
        self._containers: list[tuple[Any, Any]] = []  # (dict or list, its contents then)
        for container in self._walk(set()):
            self._containers.append((container, dict(container) if isinstance(container, dict) else list(container)))
        self._grads = {id(t): (t, t.grad, t.requires_grad) for t in self._leaves()}
        # the function's globals and closure cells themselves (`seen += x.shape[0]` rebinds one)
        self._roots = [(root, value) for _, root, value in roots_of(function, {}) if root[0] in ("global", "cell")]

    def restore_symbolic(self) -> None:
        """Put back what holds a symbolic size or a stand-in now, and only that (after a failed
        recording that ran its ops for real, the rest is what an eager call that raised left)."""
        self._restore_where(_holds_symbolic)

    def restore_unwritten(self, storages: set) -> None:
        """Put back what holds a tensor over one of `storages` now: placeholders whose op never ran
        because the run raised before it (a `.grad` that backward set, an optimizer state entry a
        step made, after a forward op that raised). An eager call that raised there never made them."""
        if not storages:
            return

        def unwritten(value: Any, depth: int = 0) -> bool:
            if isinstance(value, torch.Tensor):
                return storage_key(value) in storages
            if depth < 2 and isinstance(value, (list, tuple)):
                return any(unwritten(item, depth + 1) for item in value)
            if depth < 2 and isinstance(value, dict):
                return any(unwritten(item, depth + 1) for item in value.values())
            return False
        self._restore_where(unwritten)
        for tensor, grad, _ in self._grads.values():
            if tensor.grad is not grad and unwritten(tensor.grad):
                tensor.grad = grad

    def _restore_where(self, holds: Callable[[Any], bool]) -> None:
        owner = code_owner(self._function)
        for (kind, key), value in self._roots:
            now = owner.__globals__.get(key) if kind == "global" else _cell(owner, key)
            if holds(now) and now is not value:
                _set_root(owner, kind, key, value)
        for container, contents in self._containers:
            if isinstance(container, dict):
                for key in [k for k, v in container.items() if holds(v)]:
                    if key in contents:
                        container[key] = contents[key]
                    else:
                        del container[key]
            elif any(map(holds, container)):
                container[:] = contents

    def symbolic_left(self) -> str | None:
        """A symbolic size or a stand-in tensor the attempt left in the state this snapshot covers
        (`self.n = x.shape[0]`, `seen += x.shape[0]`, `group["lr"] = 0.01 * x.shape[0]`): the
        Python state of an eager call holds numbers there. Described, or None."""
        found = _holds_symbolic
        owner = code_owner(self._function)
        for kind, key in (root for root, _ in self._roots):
            value = owner.__globals__.get(key) if kind == "global" else _cell(owner, key)
            if found(value):
                return f"global {key} = {value}" if kind == "global" else f"a closure variable = {value}"
        for container in self._walk(set()):
            items = container.items() if isinstance(container, dict) else enumerate(container)
            for key, value in items:
                if found(value):
                    return f"{key!r}: {value}"
        return None

    def add_leaf(self, tensor: torch.Tensor, grad: torch.Tensor | None, requires_grad: bool) -> None:
        """A tensor the attempt reached otherwise (a closure's parameter), as it was when first seen."""
        self._grads.setdefault(id(tensor), (tensor, grad, requires_grad))

    def held_now(self) -> tuple[set, set[int]]:
        """The storages and tensor objects the state this snapshot restores holds now: what restore()
        lets go of. (Storages as weak keys, objects by id: nothing is kept alive.)"""
        storages, ids = set(), set()

        def hold(value: Any) -> None:
            while isinstance(value, torch.Tensor):
                ids.add(id(value))
                key = storage_key(value)
                if key is not None:
                    storages.add(key)
                value = value._base
        for container in self._walk(set()):
            for value in container.values() if isinstance(container, dict) else container:
                hold(value)
        for tensor, _, _ in self._grads.values():
            hold(tensor.grad)
        return storages, ids

    def restore(self) -> None:
        owner = code_owner(self._function)
        for (kind, key), value in self._roots:
            _set_root(owner, kind, key, value)
        for container, contents in self._containers:
            if isinstance(container, dict):
                container.clear()
                container.update(contents)
            else:
                container[:] = contents
        for tensor, grad, requires_grad in self._grads.values():
            if tensor.grad is not grad:
                tensor.grad = grad
            if tensor.requires_grad != requires_grad:
                tensor.requires_grad_(requires_grad)

    # -- what the function reaches -----------------------------------------------------------------

    def _objects(self) -> list:
        found: dict[int, Any] = {}

        def add(value: Any, depth: int) -> None:
            if isinstance(value, torch.nn.Module):
                for module in value.modules():
                    found.setdefault(id(module), module)
            elif isinstance(value, _STATEFUL):
                found.setdefault(id(value), value)
                optimizer = getattr(value, "optimizer", None)  # a scheduler's
                if isinstance(optimizer, torch.optim.Optimizer):
                    found.setdefault(id(optimizer), optimizer)
            elif _plain_object(value):  # an object of the user's (`meter.last = out.detach()`)
                found.setdefault(id(value), value)
            elif depth == 0 and isinstance(value, (list, tuple)):
                for item in value:
                    add(item, 1)
            elif depth == 0 and isinstance(value, dict):
                for item in value.values():
                    add(item, 1)
        for _, _, value in roots_of(self._function, self._kwargs):
            add(value, 0)
        return list(found.values())

    def _walk(self, seen: set[int]) -> Iterator[Any]:
        """Every dict and list of the reached objects' state, outermost first."""
        def containers(value: Any, depth: int) -> Iterator[Any]:
            if not isinstance(value, (dict, list)) or id(value) in seen or depth > _DEPTH:
                return
            seen.add(id(value))
            yield value
            for item in list(value.values() if isinstance(value, dict) else value):
                yield from containers(item, depth + 1)
        for obj in self._objects():
            state = getattr(obj, "__dict__", None)
            if state is not None:
                yield from containers(state, 0)
        # the lists and dicts the function reaches by name: a global list the call appends to (a
        # log of sizes), a keyword dict of lists (`store["preds"].append(out.detach().argmax(1))`)
        for _, _, value in roots_of(self._function, self._kwargs):
            yield from containers(value, 1)

    def _leaves(self) -> Iterator[torch.Tensor]:
        for obj in self._objects():
            if isinstance(obj, torch.nn.Module):
                yield from (p for p in obj._parameters.values() if p is not None)
            elif isinstance(obj, torch.optim.Optimizer):
                yield from (p for group in obj.param_groups for p in group["params"])
        for _, _, value in roots_of(self._function, self._kwargs):
            if isinstance(value, torch.Tensor) and value.is_leaf:
                yield value
