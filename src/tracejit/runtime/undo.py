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
learning-rate scheduler and gradient scaler reached from the function's keyword arguments,
globals and closure cells (directly or in a list, tuple or dict there), and the `.grad` and
`requires_grad` of their parameters. `restore()` puts it back in place (the same dict and list
objects). Besides, one level of what the function reaches by name (`_named_containers`: a
keyword or global list of predictions, `store["preds"]`, a user object's attributes) is copied
shallowly and put back only where the attempt changed it (an object's attributes only where they
now hold a tensor or a symbol the attempt made). What it does not reach (a tensor kept in a user's list) it cannot restore:
`SymbolicRecorder.left_behind` finds such a tensor, and the attempt is then not dropped.
"""

from __future__ import annotations

import functools
import operator
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

_STATEFUL_TYPES = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
                   torch.optim.lr_scheduler.ReduceLROnPlateau, torch.amp.GradScaler)


def _copy(container: Any) -> Any:
    return dict(container) if isinstance(container, dict) else list(container)


def _changed(container: Any, contents: Any) -> bool:
    if len(container) != len(contents):
        return True
    if isinstance(container, dict):
        return any(value is not contents.get(key, _MISSING) for key, value in container.items())
    return not all(map(operator.is_, container, contents))


def _put_back(container: Any, contents: Any) -> None:
    if isinstance(container, dict):
        container.clear()
        container.update(contents)
    else:
        container[:] = contents


def _made_by_attempt(value: Any) -> bool:
    """What only the attempt's Python can have put there: a tensor (it computed none) or a symbol."""
    return isinstance(value, torch.Tensor) or _holds_symbolic(value)


_MISSING = object()
_NAMED_ITEMS = 256  # a keyword dict larger than this is not looked into (a dataset, a cache)


def _named_containers(roots: list) -> Iterator[tuple[Any, bool]]:
    """The lists and dicts the function reaches by name besides what _walk covers, with whether
    each is an object's `__dict__`: a keyword, global or closure list or dict itself (`preds`),
    the lists and dicts a dict of those holds (`store["preds"]`), and the attributes of objects of
    a user's class there (`meter.last = out.detach()`, `store["meter"]`). One level deep, so a
    global dataset costs one shallow copy, never a walk of its items."""
    for _, _, value in roots:
        if isinstance(value, (list, dict)):
            yield value, False
            if isinstance(value, dict) and len(value) <= _NAMED_ITEMS:
                for item in value.values():
                    if isinstance(item, (list, dict)):
                        yield item, False
                    elif _plain_object(item):
                        yield item.__dict__, True
        elif _plain_object(value):
            yield value.__dict__, True


def _plain_object(value: Any) -> bool:
    """An instance of a user's class with attributes of its own: not a module, class, function,
    tensor or torch object (their state is torch's, or not the call's to change)."""
    return (isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, _NOT_PLAIN)
            and not type(value).__module__.startswith(("torch", "tracejit", "numpy", "builtins")))


_NOT_PLAIN = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              functools.partial, torch.Tensor, torch.nn.Module, *_STATEFUL_TYPES)

_STATEFUL = _STATEFUL_TYPES
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
        for _, value in self._roots:  # a global list the call appends to (a log of sizes)
            if isinstance(value, (dict, list)) and all(value is not c for c, _ in self._containers):
                self._containers.append((value, dict(value) if isinstance(value, dict) else list(value)))
        # what else the function reaches by name, one level deep (see _named_containers): put
        # back only where the attempt changed it
        known = {id(c) for c, _ in self._containers}
        self._named: list[tuple[Any, Any, bool]] = []  # (list or dict, its contents then, an object's __dict__)
        for container, attributes in _named_containers(roots_of(function, kwargs)):
            if id(container) not in known:
                known.add(id(container))
                self._named.append((container, _copy(container), attributes))

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

    def symbolic_left(self, returned: frozenset[int] = frozenset()) -> str | None:
        """A symbolic size or a stand-in tensor the attempt left in the state this snapshot covers
        (`self.n = x.shape[0]`, `seen += x.shape[0]`, `group["lr"] = 0.01 * x.shape[0]`): the
        Python state of an eager call holds numbers there. Described, or None. A stand-in the
        call also returns (ids in `returned`) is no such thing: the caller replaces it with the
        returned value (`replace_returned`)."""
        def found(value: Any) -> bool:
            return _holds_symbolic(value) and id(value) not in returned
        owner = code_owner(self._function)
        for kind, key in (root for root, _ in self._roots):
            value = owner.__globals__.get(key) if kind == "global" else _cell(owner, key)
            if found(value):
                return f"global {key} = {value}" if kind == "global" else f"a closure variable = {value}"
        changed = [container for container, _, _ in self._changed_named()]
        for container in [*self._walk(set()), *changed]:
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
        for container, _ in self._containers:  # the root lists and dicts too (a global list of predictions)
            for value in container.values() if isinstance(container, dict) else container:
                hold(value)
        for container, contents, attributes in self._changed_named():
            for key, value in container.items() if isinstance(container, dict) else enumerate(container):
                if not attributes or value is not contents.get(key):
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
        for container, contents, attributes in self._changed_named():
            if not attributes:  # a list or dict of the user's: as it was (a keyword list of predictions)
                _put_back(container, contents)
                continue
            # an object's attributes: only those now holding what the attempt made (another
            # thread's writes to the same object, a counter it advances, stay)
            for key in [k for k, v in container.items() if v is not contents.get(k) and _made_by_attempt(v)]:
                if key in contents:
                    container[key] = contents[key]
                else:
                    del container[key]
        for tensor, grad, requires_grad in self._grads.values():
            if tensor.grad is not grad:
                tensor.grad = grad
            if tensor.requires_grad != requires_grad:
                tensor.requires_grad_(requires_grad)

    def _changed_named(self) -> Iterator[tuple[Any, Any, bool]]:
        """The named containers whose items are no longer the ones they held (by identity)."""
        for container, contents, attributes in self._named:
            if _changed(container, contents):
                yield container, contents, attributes

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

    def _leaves(self) -> Iterator[torch.Tensor]:
        for obj in self._objects():
            if isinstance(obj, torch.nn.Module):
                yield from (p for p in obj._parameters.values() if p is not None)
            elif isinstance(obj, torch.optim.Optimizer):
                yield from (p for group in obj.param_groups for p in group["params"])
        for _, _, value in roots_of(self._function, self._kwargs):
            if isinstance(value, torch.Tensor) and value.is_leaf:
                yield value
