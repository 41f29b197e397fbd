"""Where external tensors live: readable names and locators.

A *locator* is the chain of lookups that leads from a root the traced function can see (a
keyword argument, a global, a closure cell) to a tensor: `kwargs["model"]._modules["fc1"]
._parameters["weight"]`, or `kwargs["opt"].state[<param>]["exp_avg"]`. Names make messages and
listings clear; locators let `without_host` check, without running the function, that the
function would still reach the same tensors.

Besides modules and optimizers, the roots' plain containers are searched a few levels deep: the
attributes of an object of the user's own class (a trainer holding the model and optimizer, a
dataclass), list and tuple items, dict entries with string or integer keys. A tensor reached
there has a locator too (`kwargs["trainer"].model...`, `kwargs["state"]["h"]`), so a call without
the function notices when that place holds another tensor (another trainer, a new hidden state).
"""

from __future__ import annotations

import collections
import copy
import dis
import enum
import itertools
import struct
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.parameter import UninitializedTensorMixin


@dataclass(frozen=True)
class Locator:
    root: tuple[str, Any]  # ("kwarg", name) | ("global", name) | ("cell", index)
    # ("module", child) | ("param", name) | ("buffer", name), and ("grad", None) after a param;
    # through plain containers: ("attr", name) | ("item", key)
    steps: tuple[tuple[str, Any], ...]
    state_of: Locator | None = None  # optimizer state: the parameter whose state dict holds it
    state_key: str | None = None
    # a setting of the optimizer at `steps` (a tensor learning rate): (group index, key, element of
    # a tuple setting or None), `param_groups[index][key][element]`
    group: tuple[int, str, int | None] | None = None

    def describe(self) -> str:
        kind, name = self.root
        text = {"kwarg": f"kwargs[{name!r}]", "global": f"globals()[{name!r}]", "cell": f"closure[{name}]"}[kind]
        if self.state_of is not None:
            return f"{_describe_steps(text, self.steps)}.state[{self.state_of.describe()}][{self.state_key!r}]"
        if self.group is not None:
            return _describe_steps(text, self.steps) + group_suffix(self.group)
        return _describe_steps(text, self.steps)


def group_suffix(group: tuple[int, str, int | None]) -> str:
    """`.param_groups[0]['lr']`, `.param_groups[0]['betas'][1]`: where a group locator's setting is."""
    index, key, element = group
    return f".param_groups[{index}][{key!r}]" + ("" if element is None else f"[{element}]")


def _describe_steps(text: str, steps: tuple) -> str:
    for step, key in steps:
        text += {"module": f"._modules[{key!r}]", "param": f"._parameters[{key!r}]", "attr": f".{key}",
                 "item": f"[{key!r}]", "buffer": f"._buffers[{key!r}]", "grad": ".grad"}[step]
    return text


class ExternalNames:
    def __init__(self, function: Callable, kwargs: dict, settings: bool = False):
        self._function = function
        self._kwargs = kwargs
        # the keyword values compared by value, as the call found them: a call that changes one
        # (`cfg["s"] *= 1.1`) computed with the value it found, which the next call must have
        self.plain_kwargs = {name: plain_copy(value) for name, value in kwargs.items()
                             if not isinstance(value, _ATOMS) and plain_value(value)}
        # where each tensor is when the call begins: a call may put another tensor in that place
        # (`self.h = h`), and a call without the function must look where this one looked
        self._found = _collect(roots_of(function, kwargs))
        # id(optimizer) -> where the function finds it (`trainer.opt`): one put there since is another
        self.optimizer_locators = dict(self._found.optimizer_locators)
        # and each torch.Generator, where it is and its state as the call begins (see GeneratorWatch)
        self.generators = list(self._found.generators.values())
        # and what it is then, to find what the call changes by Python rather than by an op
        self._first: list[tuple[Any, int, bool, str]] = []
        for tensor, name in self._found.tensors:
            if is_lazy(tensor):  # a lazy module's, not materialized: no memory yet (see lazy_modules)
                continue
            try:
                self._first.append((weakref.ref(tensor), _storage_address(tensor), tensor.requires_grad, name))
            except TypeError:  # no weak references to it: nothing to compare
                pass
        self._found.tensors.clear()  # held weakly from here: a freed gradient must be able to go
        # the places Python could assign a new tensor to (an attribute, an entry, a buffer): where
        # the call may leave one of its own (`cache["last"] = y`) for the next call to replace
        self._places = [locator for _, locator in self._found.values() if locator is not None
                        and locator.state_of is None and locator.group is None and locator.steps and locator.steps[-1][0] in _ASSIGNED]
        # and, for without_host (`settings`), the plain values the function reaches that it could
        # change by Python: a config's temperature, a submodule's annealed float, an EMA helper's
        # counter, a hand-written optimizer's int step count
        self._settings = _settings_of(self._found) if settings else []
        self._found.holders.clear()
        # and the lists, tuples, deques and dicts found, with their items: a call that adds, removes
        # or moves items (`history.append(y)`, a new key) did what a call without the function would not
        self._contents = self._found.contents

    def python_changes(self) -> list[str]:
        """What the call changed by Python rather than by an op in the tensors found when it began:
        their memory (`p.data = p.data.clamp(...)`), `requires_grad_(False)`. Plain values: see
        `setting_changes`."""
        changes = []
        for ref, address, requires_grad, name in self._first:
            tensor = ref()
            if tensor is None:
                continue
            if address and _storage_address(tensor) != address:
                changes.append(f"{name} has new memory (`.data = ...`)")
            if tensor.requires_grad != requires_grad:
                changes.append(f"{name}.requires_grad_({tensor.requires_grad})")
        return changes

    def setting_changes(self) -> list[tuple[str, Any, Any]]:
        """The plain values watched since the call began (`settings=True`) that it changed, as
        (name, before, after); `after` is None for one deleted (`model.fc.tau: 1.0 -> 0.8`)."""
        changes = []
        for now, prefix, before in self._settings:
            current = now()
            if current is None:  # the holder is gone (a popped state entry, a freed object)
                continue
            for key, then in before.items():
                value = current.get(key)
                if not same_value(value, then):
                    changes.append((f"{prefix}{key}", then, _copied(value)))
        return changes

    def rearranged(self) -> list[str]:
        """What the call rearranged by Python among the containers and places found when it began:
        the lists, tuples, deques and dicts it added items to or removed items from
        (`history.append(y)`, `G.insert(0, x * 2)`, `cache[key] = y` under a new key), and the places
        now holding a tensor found at another one (a window shifted by `pop(0)` and `append`,
        `state["prev"] = state["cur"]`). A call without the function would do neither, and a tensor
        found at a position (`history[-1]` found as `history[2]`) is not where the function looks
        after an append."""
        changes = []
        for locator, name, items in self._contents:
            if _rearranged(items, self._now(locator, _items)):
                changes.append(f"{name} has other items")
        for locator in self._places:
            entry = self._found.entry(self._now(locator, _identity))
            if entry is not None and entry[1] is not None and entry[1] != locator:
                changes.append(f"{entry[0]} moved to {locator.describe()}")
        return changes

    def _now(self, locator: Locator, what: Callable[[Any], Any]) -> Any:
        """`what` of the value at `locator` now; None if the place is gone (a popped entry)."""
        try:
            return what(resolve(locator, self._function, self._kwargs))
        except (KeyError, AttributeError, IndexError, TypeError, ValueError):
            return None

    def name_of(self, tensor: torch.Tensor) -> str | None:
        entry = self._found.entry(tensor)
        return entry[0] if entry else None

    def locator_of(self, tensor: torch.Tensor) -> Locator | None:
        entry = self._found.entry(tensor)
        return entry[1] if entry else None

    def had_state_entry(self, optimizer: Any, param: Any, key: Any) -> bool:
        """Whether `optimizer.state[param][key]` held a value (not None) when the call began: one the
        call put there where it found none is state the call created (torch.optim's lazy state, a
        momentum buffer made from the first gradient), which the function creates only where it
        finds none."""
        return (id(optimizer), id(param), key) in self._found.state_entries

    def place_of(self, tensor: torch.Tensor) -> Locator | None:
        """Where the tensor is now, among the places that held a tensor when the call began: a call
        without the function assigns its value there anew, as the function does."""
        for locator in self._places:
            try:
                if resolve(locator, self._function, self._kwargs) is tensor:
                    return locator
            except (KeyError, AttributeError, IndexError, TypeError, ValueError):
                continue  # the place is gone (a popped entry, a replaced container)
        return None


def lazy_modules(function: Callable, kwargs: dict) -> list[torch.nn.Module]:
    """The modules the function reaches (where ExternalNames looks: keyword arguments, globals,
    closure cells and their plain containers) holding a parameter or buffer that a lazy module has
    not materialized yet (`nn.LazyLinear` before its first forward)."""
    return [holder for holder, _, kind in _collect(roots_of(function, kwargs)).holders
            if kind == "module" and has_lazy_tensors(holder)]


def has_lazy_tensors(module: torch.nn.Module) -> bool:
    """Whether the module itself (not its submodules) holds an uninitialized parameter or buffer."""
    return any(map(is_lazy, (*module._parameters.values(), *module._buffers.values())))


def is_lazy(tensor: Any) -> bool:
    """An `UninitializedParameter` or `UninitializedBuffer`: no shape, no memory, no ops yet."""
    return isinstance(tensor, UninitializedTensorMixin)


def _collect(roots: list[tuple[str, tuple[str, Any], Any]]) -> _Found:
    """The tensors the roots hold, each with its name and locator, and the objects holding them."""
    found = _Found()
    for name, root, value in roots:
        if isinstance(value, torch.nn.Module):
            _walk_module(value, name, Locator(root, ()), found)
        elif isinstance(value, torch.Tensor):
            found.add(value, name, Locator(root, ()))
    # plain containers after modules: a parameter keeps the name its module gives it
    optimizers: list[tuple[str, Locator, torch.optim.Optimizer]] = []
    visited: set[int] = set()
    for name, root, value in roots:
        if isinstance(value, torch.optim.Optimizer):
            optimizers.append((name, Locator(root, ()), value))
        elif not isinstance(value, (torch.nn.Module, torch.Tensor)):
            _walk_plain(value, name, Locator(root, ()), found, optimizers, visited, _PLAIN_DEPTH)
    # what modules hold besides tensors and submodules (`self.opt`, `self.cache = {"h": h}`), as
    # deep as a root's plain values; a module found there appends its own
    for value, name, locator in found.module_attributes:
        _walk_plain(value, name, locator, found, optimizers, visited, _PLAIN_DEPTH - 1)
    for name, locator, optimizer in optimizers:
        found.holders.append((optimizer, name, "optimizer" if locator.steps else "root optimizer"))
        found.optimizer_locators.setdefault(id(optimizer), locator)
        # its parameters that no module found (a step function given only the optimizer), and
        # their gradients: where the function's step() finds them
        for index, group in enumerate(optimizer.param_groups):
            params = group.get("params")
            if type(params) is not list:
                continue
            for position, param in enumerate(params[:_PLAIN_ITEMS]):
                if isinstance(param, torch.Tensor) and id(param) not in found:
                    where = Locator(locator.root, (*locator.steps, ("attr", "param_groups"), ("item", index),
                                                   ("item", "params"), ("item", position)))
                    param_name = f"{name}.param_groups[{index}]['params'][{position}]"
                    found.add(param, param_name, where)
                    if isinstance(param.grad, torch.Tensor):
                        found.add(param.grad, f"{param_name}.grad", Locator(where.root, (*where.steps, ("grad", None))))
        # the tensors of its settings (`lr=torch.tensor(0.01)` for a fused step, tensor betas): found
        # where the function finds them on every call, so a call without the function notices a new
        # one (a hand-written decay, load_state_dict()) or a number in its place
        for index, group in enumerate(optimizer.param_groups):
            for key, setting in group.items():
                if key == "params":
                    continue
                elements = enumerate(setting) if isinstance(setting, tuple) else [(None, setting)]
                for element, tensor in elements:
                    if isinstance(tensor, torch.Tensor):
                        where = (index, key, element)
                        found.add(tensor, f"{name}{group_suffix(where)}", Locator(locator.root, locator.steps, group=where))
        for param, state in optimizer.state.items():
            owner_name, owner_locator = found.get(id(param), ("param", None))
            found.state_entries.update((id(optimizer), id(param), key) for key, value in state.items()
                                       if value is not None)
            for key, tensor in state.items():
                if isinstance(tensor, torch.Tensor):
                    located = Locator(locator.root, locator.steps, owner_locator, key) if owner_locator else None
                    found.add(tensor, f"{name}.state[{owner_name}].{key}", located)
    return found


class _Found(dict):
    """id(tensor) -> (name, locator) of the first place each tensor was found; and the tensors; and
    the objects holding plain values on the way, as (object, name, kind): "module", "object" (of
    the user's own class), "optimizer", "root optimizer" (one the function reaches directly); and
    the items of every list, tuple, deque and dict on the way."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[tuple[torch.Tensor, str]] = []
        self.holders: list[tuple[Any, str, str]] = []
        self.contents: list[tuple[Locator, str, Any]] = []  # (locator, name, _items) of each container
        self.refs: dict[int, weakref.ref] = {}  # id -> the tensor found, weakly
        self.module_attributes: list[tuple[Any, str, Locator]] = []  # modules' plain values, walked last
        self.optimizer_locators: dict[int, Locator] = {}  # id(optimizer) -> where it was found first
        # id(generator) -> (the generator, where it was found first, its state then)
        self.generators: dict[int, tuple[torch.Generator, Locator, torch.Tensor]] = {}
        # (id(optimizer), id(parameter), key) of each optimizer state entry found (not None)
        self.state_entries: set[tuple[int, int, Any]] = set()

    def add(self, tensor: torch.Tensor, name: str, locator: Locator | None) -> None:
        if id(tensor) not in self:
            self[id(tensor)] = (name, locator)
            self.tensors.append((tensor, name))
            try:
                self.refs[id(tensor)] = weakref.ref(tensor)
            except TypeError:
                pass

    def entry(self, tensor: Any) -> tuple[str, Locator | None] | None:
        """Where `tensor` was found, if it is the object found there: once a found tensor is freed
        (zero_grad() drops the old gradients), a tensor the call makes may get its id."""
        ref = self.refs.get(id(tensor))
        if ref is not None and ref() is not tensor:
            return None
        return self.get(id(tensor))


def _storage_address(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # fake, meta or sparse tensors
        return 0


def code_owner(function: Callable) -> Callable:
    """The function whose code, globals and closure cells a traced call runs: a traced method's own
    (methods.py wraps it to take its instance as the keyword `self`; the wrapper's globals are
    tracejit's)."""
    return getattr(function, "__tracejit_method__", function)


def held_values(holder: Any) -> tuple:
    """The values a keyword, global or closure value holds one level down: a dict's or a list's
    items, an object's attributes (not a module's or a tensor's: no training object lives there)."""
    if isinstance(holder, dict):
        return tuple(holder.values())
    if isinstance(holder, (list, tuple)):
        return tuple(holder)
    if isinstance(holder, (torch.Tensor, torch.nn.Module, type)):
        return ()
    attributes = getattr(holder, "__dict__", None)
    return tuple(attributes.values()) if type(attributes) is dict else ()


def roots_of(function: Callable, kwargs: dict) -> list[tuple[str, tuple[str, Any], Any]]:
    """What the function reaches directly, as (name, root, value): its keyword arguments, the
    globals its code loads (`global_names`) and its closure cells."""
    roots = [(name, ("kwarg", name), value) for name, value in kwargs.items()]
    function = code_owner(function)
    code = getattr(function, "__code__", None)
    if code is not None:
        globals_ = getattr(function, "__globals__", {})
        roots += [(n, ("global", n), globals_[n]) for n in global_names(code) if n in globals_]
        closure = getattr(function, "__closure__", None) or ()
        for index, (name, cell) in enumerate(zip(code.co_freevars, closure)):
            try:
                roots.append((name, ("cell", index), cell.cell_contents))
            except ValueError:  # empty cell
                pass
    return roots


def plain_roots(function: Callable) -> list[tuple[str, tuple[str, Any], Any]]:
    """The plain values (see plain_value) and functions among the globals and closure cells the
    function reads, and among the globals of the plain functions of its own module it reads (a
    helper's `x * SCALE`), as (name, root, value)."""
    found: dict[tuple[str, Any], tuple[str, Any]] = {}
    function = code_owner(function)
    for name, root, value in roots_of(function, {}):
        if root[0] == "kwarg":
            continue
        if plain_value(value) or isinstance(value, _FUNCTIONS):
            found[root] = (name, value)
        if (root[0] == "global" and isinstance(value, types.FunctionType)
                and value.__globals__ is getattr(function, "__globals__", None)):
            for inner, inner_root, inner_value in roots_of(value, {}):
                if inner_root[0] == "global" and (plain_value(inner_value) or isinstance(inner_value, _FUNCTIONS)):
                    found.setdefault(inner_root, (f"{inner} (read by {name})", inner_value))
    return [(name, root, value) for root, (name, value) in found.items()]


def module_roots(function: Callable) -> list[tuple[str, tuple[str, Any], Any]]:
    """The torch.nn modules among the globals and closure cells the function reads, and among
    the globals of the plain functions of its own module it reads (a helper's `MT.temperature`),
    as (name, root, value)."""
    function = code_owner(function)
    found: dict[tuple[str, Any], tuple[str, Any]] = {}
    for name, root, value in roots_of(function, {}):
        if isinstance(value, torch.nn.Module):
            found[root] = (name, value)
        if (root[0] == "global" and isinstance(value, types.FunctionType)
                and value.__globals__ is getattr(function, "__globals__", None)):
            for inner, inner_root, inner_value in roots_of(value, {}):
                if inner_root[0] == "global" and isinstance(inner_value, torch.nn.Module):
                    found.setdefault(inner_root, (f"{inner} (read by {name})", inner_value))
    return [(name, root, value) for root, (name, value) in found.items()]


def keys_read_through(function: Callable, attribute: str) -> frozenset[str] | None:
    """None if neither the function's code, the code it defines, nor a plain function of its own
    module it loads names `attribute`; else the strings those codes hold (`opt.param_groups[0]["lr"]`
    read by the step itself holds "lr"), the keys it may read there."""
    function = code_owner(function)
    codes = [getattr(function, "__code__", None)]
    codes += [value.__code__ for _, root, value in roots_of(function, {})
              if root[0] == "global" and isinstance(value, types.FunctionType)
              and value.__globals__ is getattr(function, "__globals__", None)]
    named, strings = False, set()
    while codes:
        code = codes.pop()
        if code is None:
            continue
        named = named or attribute in code.co_names
        strings.update(const for const in code.co_consts if type(const) is str)
        codes += [const for const in code.co_consts if isinstance(const, types.CodeType)]
    return frozenset(strings) if named else None


# functions, compared by identity: another one (`ACT = torch.sigmoid` for `torch.tanh`, a helper
# defined again) computes otherwise
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType)


# the instructions that read a name from the globals (`LOAD_NAME` in a class body defined inside
# the function falls back to them; Python 3.12 has `LOAD_FROM_DICT_OR_GLOBALS` there too)
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})
_GLOBAL_NAMES: dict[int, tuple[weakref.ref, tuple[str, ...]]] = {}  # id(code) -> (code, its global_names)


def global_names(code: types.CodeType) -> tuple[str, ...]:
    """The globals `code` loads, and the code it defines loads (a comprehension, a lambda, an inner
    function: they share its globals), in order of first use. Not `co_names`, which holds the
    attribute names too: `opt.step()` in a function named `step` made the global `step`, the
    trace itself, one the function reaches. Found once per code object: every call without the
    host asks (runtime/python_state.py)."""
    entry = _GLOBAL_NAMES.get(id(code))
    if entry is not None and entry[0]() is code:
        return entry[1]
    names: dict[str, None] = {}
    pending = [code]
    while pending:
        current = pending.pop(0)
        names.update((i.argval, None) for i in dis.get_instructions(current) if i.opname in _GLOBAL_LOADS)
        pending += [const for const in current.co_consts if isinstance(const, types.CodeType)]
    key = id(code)

    def forget(ref: weakref.ref) -> None:
        if _GLOBAL_NAMES.get(key, (None,))[0] is ref:
            del _GLOBAL_NAMES[key]

    _GLOBAL_NAMES[key] = (weakref.ref(code, forget), tuple(names))
    return _GLOBAL_NAMES[key][1]


_ASSIGNED = ("attr", "item", "buffer")  # steps that end at a place Python assigns to


def resolve(locator: Locator, function: Callable, kwargs: dict) -> Any:
    """What is at `locator` now (not optimizer state; a param group's setting too). Raises what the
    lookup raises if it is gone."""
    kind, key = locator.root
    function = code_owner(function)
    value = (kwargs[key] if kind == "kwarg" else function.__globals__[key] if kind == "global"
             else function.__closure__[key].cell_contents)
    for step, name in locator.steps:
        if step == "grad":
            value = value.grad
        elif step == "item":
            value = value[name]
        else:
            value = (vars(value) if step == "attr" else getattr(value, _MODULE_DICTS[step]))[name]
    if locator.group is not None:
        index, key, element = locator.group
        value = value.param_groups[index][key]
        if element is not None:
            value = value[element]
    return value


_MODULE_DICTS = {"module": "_modules", "param": "_parameters", "buffer": "_buffers"}


def container_expression(locator: Locator) -> str:
    """The expression for what holds the place at `locator` (its last step an attribute, entry or
    buffer), in a generated call with `kw`, `GLOBALS` and `CELLS` in scope."""
    expr = root_expression(locator.root)
    for step, name in locator.steps[:-1]:
        expr = {"module": f"{expr}._modules[{name!r}]", "attr": f"{expr}.__dict__[{name!r}]",
                "item": f"{expr}[{name!r}]"}[step]
    return expr


def root_expression(root: tuple[str, Any]) -> str:
    """The expression for a root in a generated call (`kw`, `GLOBALS` and `CELLS` in scope)."""
    kind, key = root
    return {"kwarg": f"kw[{key!r}]", "global": f"GLOBALS[{key!r}]", "cell": f"CELLS[{key}].cell_contents"}[kind]


# numpy scalars too: a setting annealed with numpy (`np.exp(-r * t)`) is a number the program has built in
_ATOMS = (bool, int, float, complex, str, type(None), enum.Enum, torch.dtype, torch.device, torch.layout,
          torch.memory_format, np.generic, range)
_PLAIN_SIZE = 64  # the most items a value compared by value may hold
_PLAIN_ARRAY_BYTES = 1 << 16  # the largest numpy array compared by its bytes on every call


def plain_value(value: Any) -> bool:
    """A value compared by value alone: immutable atoms (numbers, strings, enums, dtypes, devices,
    slices, ranges, frozensets), numpy arrays (by their bytes: `torch.tensor(W)` and `W[0]` build
    their values into the program) and tuples (namedtuples too), lists and dicts of them, up to
    _PLAIN_SIZE items in all (a big vocabulary list is not compared on every call)."""
    budget = [_PLAIN_SIZE]

    def plain(v: Any, depth: int) -> bool:
        budget[0] -= 1
        if budget[0] < 0:
            return False
        if isinstance(v, _ATOMS):
            return True
        if type(v) is np.ndarray:  # a class weighting, a small table: its bytes (see same_value)
            return v.dtype != object and v.nbytes <= _PLAIN_ARRAY_BYTES
        if type(v) is slice:  # bounds that are numbers (a tensor bound is an object of its own)
            return all(isinstance(b, (int, type(None))) for b in (v.start, v.stop, v.step))
        if type(v) is frozenset:  # in iteration order, each item of its type (see same_value)
            budget[0] -= len(v)
            return budget[0] >= 0 and plain_set(v)
        if depth == 0:
            return False
        if isinstance(v, tuple) or type(v) is list:
            return all(plain(item, depth - 1) for item in v)
        if type(v) is dict:
            return all(isinstance(k, _ATOMS) and plain(item, depth - 1) for k, item in v.items())
        return False

    return plain(value, 3)


def plain_set(value: Any) -> bool:
    """A set or frozenset of up to _PLAIN_SIZE atoms. A mutable set is plain only as a keyword
    (hostfree._expected): one the function finds and adds to is Python state it changes."""
    return type(value) in (set, frozenset) and len(value) <= _PLAIN_SIZE and all(isinstance(i, _ATOMS) for i in value)


class _Ordered:
    """A set as it iterated when copied (plain_copy): a copy of a set may iterate otherwise."""

    __slots__ = ("kind", "items")

    def __init__(self, value: set | frozenset):
        self.kind, self.items = type(value), tuple(value)

    def __repr__(self) -> str:
        return repr(self.kind(self.items))


def plain_copy(value: Any) -> Any:
    """A copy of a plain value to compare later ones with (same_value): sets keep the order they
    iterate in, other values are deep copies."""
    if type(value) in (set, frozenset):
        return _Ordered(value)
    if type(value) is _Ordered:
        return value
    if type(value) is list:
        return [plain_copy(v) for v in value]
    if type(value) is tuple:
        return tuple(plain_copy(v) for v in value)
    if type(value) is dict:
        return {k: plain_copy(v) for k, v in value.items()}
    return value if isinstance(value, _ATOMS) else copy.deepcopy(value)


def same_value(now: Any, then: Any) -> bool:
    """`now == then` for plain values of the same type, floats bit for bit (see float_bits): a NaN
    equals the same NaN (`clip=float("nan")` stays the same), -0.0 is not 0.0."""
    if now is then:
        return True
    if type(then) is _Ordered:  # {1, 9} and {9, 1} iterate in other orders; {2} is not {2.0}
        return type(now) is then.kind and len(now) == len(then.items) and all(map(same_value, now, then.items))
    if type(now) is not type(then):
        return False
    if isinstance(now, np.generic):  # by its bits, as a float (np.float32(-0.0) == 0.0)
        return now.tobytes() == then.tobytes()
    if isinstance(now, np.ndarray):  # changed in place, or another one
        return now.dtype == then.dtype and now.shape == then.shape and now.tobytes() == then.tobytes()
    if isinstance(now, complex):
        return float_bits(now.real) == float_bits(then.real) and float_bits(now.imag) == float_bits(then.imag)
    if isinstance(now, (range, slice)):  # range(0, 0) == range(2, 2), yet .start differs
        return all(map(same_value, (now.start, now.stop, now.step), (then.start, then.stop, then.step)))
    if isinstance(now, (set, frozenset)):  # {1, 9} and {9, 1} iterate in other orders; {2} is not {2.0}
        return len(now) == len(then) and all(map(same_value, now, then))
    if isinstance(now, float):
        return float_bits(now) == float_bits(then)
    if isinstance(now, (tuple, list)):
        return len(now) == len(then) and all(map(same_value, now, then))
    if isinstance(now, dict):
        return now.keys() == then.keys() and all(same_value(now[k], then[k]) for k in now)
    return bool(now == then)


def float_bits(value: float) -> int:
    """The IEEE-754 bits of a float. A program has a number built in, and `==` calls two floats the
    same that compute differently: 0.0 and -0.0 (`x / -0.0` is -inf), while a NaN equals no NaN,
    not even itself. Equal bits are the same number."""
    return struct.unpack("<q", struct.pack("<d", value))[0]


def differs_expression(expr: str, value: Any, constant: Callable[[Any, str], str]) -> str:
    """A condition, for generated code, true when `expr` is not the primitive `value` (a number,
    string, bool or None): of another type (`x_int32 * 2.0` is float32 where `* 2` stays int32,
    `x_bool + 1` is int64 where `+ True` stays bool) or, for a float, of other bits (float_bits).
    `constant(value, prefix)` names a value in the generated code's namespace."""
    if value is None or type(value) is bool:
        return f"{expr} is not {value}"
    condition = f"type({expr}) is not {constant(type(value), 'ty')}"
    if isinstance(value, float) and (value == 0.0 or value != value):
        # `!=` tells any other recorded float apart bit for bit, but not a zero's sign, nor a NaN
        return f"{condition} or {constant(float_bits, 'bits')}({expr}) != {float_bits(value)}"
    return f"{condition} or {expr} != {constant(value, 'p')}"


_PLAIN_DEPTH = 3  # levels of plain containers searched below a root
_SEQUENCES = (list, tuple, collections.deque)  # searched by position (a deque: a history of the last n)
_PLAIN_ITEMS = 64  # items of one list, tuple or dict searched
_PLAIN_VISITS = 2048  # values searched in all: a dataset passed as a keyword is not walked through


# the standard library's objects whose attributes other threads and the runtime change (a
# barrier's count, a lock, a logger's handlers, a queue): not the state of a computation
_RUNTIME_MODULES = frozenset({"threading", "multiprocessing", "queue", "asyncio", "concurrent", "logging",
                              "socket", "io", "_io", "selectors", "subprocess", "weakref", "random"})


def plain_object(value: Any) -> bool:
    """An instance of the user's own class whose attributes are its state (not a function, class,
    module of code, a torch object with state of its own, a runtime object of the standard
    library such as a `threading.Barrier`, or tracejit's own: a trace, whose statistics change on
    every call, held by a trainer object the function is given)."""
    cls = type(value)
    return (cls.__module__ not in ("builtins", "types") and not cls.__module__.startswith("torch")
            and cls.__module__.split(".")[0] != "tracejit"
            and cls.__module__.split(".")[0] not in _RUNTIME_MODULES
            and isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, type))


def _walk_plain(value: Any, prefix: str, locator: Locator, found: _Found, optimizers: list, visited: set,
                depth: int) -> None:
    if id(value) in visited or len(visited) >= _PLAIN_VISITS:
        return
    visited.add(id(value))
    if isinstance(value, torch.Tensor):
        found.add(value, prefix, locator)
        return
    if isinstance(value, torch.nn.Module):
        _walk_module(value, prefix, locator, found)
        return
    if isinstance(value, torch.optim.Optimizer):
        optimizers.append((prefix, locator, value))
        return
    if isinstance(value, torch.Generator):
        if id(value) not in found.generators:
            found.generators[id(value)] = (value, locator, value.get_state())
        return
    if isinstance(value, torch.amp.GradScaler):  # its scale and growth tracker, which its ops read and write
        for name in ("_scale", "_growth_tracker"):
            tensor = vars(value).get(name)
            if isinstance(tensor, torch.Tensor):
                found.add(tensor, f"{prefix}.{name}", Locator(locator.root, (*locator.steps, ("attr", name))))
        return
    if isinstance(value, _SEQUENCES) or type(value) is dict:  # also one too deep to search
        found.contents.append((locator, prefix, _items(value)))
    if depth == 0:
        return
    if isinstance(value, _SEQUENCES):
        children = [(f"{prefix}[{i}]", ("item", i), v) for i, v in enumerate(itertools.islice(value, _PLAIN_ITEMS))]
    elif type(value) is dict:
        children = [(f"{prefix}[{k!r}]", ("item", k), v) for k, v in list(value.items())[:_PLAIN_ITEMS]
                    if type(k) in (str, int)]
    elif plain_object(value):
        found.holders.append((value, prefix, "object"))
        children = [(f"{prefix}.{k}", ("attr", k), v) for k, v in list(vars(value).items())[:_PLAIN_ITEMS]
                    if k.isidentifier()]
    else:
        return
    for name, step, child in children:
        _walk_plain(child, name, Locator(locator.root, (*locator.steps, step)), found, optimizers, visited, depth - 1)


def _items(container: Any) -> tuple[int, dict] | None:
    """A container's length and its first _PLAIN_ITEMS items by identity, {position or key: id}
    (a vocabulary is not copied on every call); None for anything else."""
    if type(container) is dict:
        pairs = itertools.islice(container.items(), _PLAIN_ITEMS)
    elif isinstance(container, _SEQUENCES):
        pairs = enumerate(itertools.islice(container, _PLAIN_ITEMS))
    else:
        return None
    return len(container), {key: _token(item) for key, item in pairs}


def _token(item: Any) -> tuple[int, weakref.ref | None]:
    """An item's identity: its id, and a weak reference where it takes one. A freed item's id
    may go to an object the call makes (`metrics["loss"] = loss.detach()` frees the old loss)."""
    try:
        return id(item), weakref.ref(item)
    except TypeError:  # a number, a string, None: its id is all there is
        return id(item), None


def _alive(token: tuple[int, weakref.ref | None]) -> bool:
    """The item is still the object with that id (not told for items without weak references)."""
    return token[1] is None or token[1]() is not None


def _rearranged(before: tuple[int, dict] | None, after: tuple[int, dict] | None) -> bool:
    """Whether a call that found a container's items as `before` and left them as `after` added,
    removed or moved items. A position or key given a new object is not such a change (a call
    without the function leaves its new tensor there too, see place_of), unless the object it held
    is still in the container: `[x0] * 2` left as `[x0, y]` was shifted as much as assigned to.
    None is no object of its own (`{"loss": None, "acc": None}` with one slot filled)."""
    if before is None or after is None or before[0] != after[0] or before[1].keys() != after[1].keys():
        return True
    nothing = id(None)
    old = {token[0] for token in before[1].values() if token[0] != nothing and _alive(token)}
    new = {token[0] for token in after[1].values() if token[0] != nothing}
    return any(after[1][key][0] != item[0] and (after[1][key][0] in old or (item[0] in new and _alive(item)))
               for key, item in before[1].items())


def _identity(value: Any) -> Any:
    return value


def _walk_module(module: torch.nn.Module, prefix: str, locator: Locator, found: _Found) -> None:
    found.holders.append((module, prefix, "module"))
    for name, param in module._parameters.items():
        if param is not None:
            located = Locator(locator.root, (*locator.steps, ("param", name)))
            found.add(param, f"{prefix}.{name}", located)
            if param.grad is not None:  # a gradient accumulated over calls is read where it is now
                found.add(param.grad, f"{prefix}.{name}.grad", Locator(locator.root, (*located.steps, ("grad", None))))
    for name, buffer in module._buffers.items():
        if buffer is not None:
            found.add(buffer, f"{prefix}.{name}", Locator(locator.root, (*locator.steps, ("buffer", name))))
    users_own = not type(module).__module__.startswith("torch.")
    for name, value in vars(module).items():
        if not name.isidentifier():
            continue
        where = Locator(locator.root, (*locator.steps, ("attr", name)))
        if isinstance(value, torch.Tensor):  # a plain tensor attribute (`self.h = h`)
            found.add(value, f"{prefix}.{name}", where)
        elif isinstance(value, (torch.optim.Optimizer, torch.amp.GradScaler, torch.Generator)) or (
                (isinstance(value, _SEQUENCES) or type(value) is dict or (users_own and plain_object(value)))
                and name not in _MODULE_INTERNALS and (users_own or name[0] != "_")):
            # an optimizer it owns (`self.opt`), a history it keeps (`self.hist.append(y)`), a
            # cache (`self.cache["h"]`), not torch's bookkeeping: searched as a root's values are
            found.module_attributes.append((value, f"{prefix}.{name}", where))
    for name, child in module._modules.items():
        if child is not None:
            _walk_module(child, f"{prefix}.{name}", Locator(locator.root, (*locator.steps, ("module", name))), found)


# a module's own bookkeeping, not settings: its parameters, buffers and submodules are compared as
# tensors and modules; an empty one would pass for a plain dict
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "_is_full_backward_hook"})
# module flags a call may change that select a trace (`training`, signature.py) or that a call
# without the function sets itself (DistributedDataParallel's, runtime/hostfree.py's epilogue)
_FOLLOWED = frozenset({"training", "require_forward_param_sync"})


def _copied(value: Any) -> Any:
    return plain_copy(value)


def _plain_values(mapping: dict, skip: frozenset = frozenset()) -> dict:
    values = {}
    for key, value in list(mapping.items())[:_PLAIN_ITEMS]:
        if isinstance(value, _ATOMS):  # most settings: taken as they are
            if key not in skip:
                values[key] = value
        elif (type(value) in (list, dict) or isinstance(value, tuple)) and key not in skip and plain_value(value):
            values[key] = plain_copy(value)
    return values


def _settings_of(found: _Found) -> list[tuple[Callable[[], dict | None], str, dict]]:
    """The plain values of the holders found as a call begins, as (now, prefix, values): `now()`
    gives the mapping holding them at that moment (None if gone). Watched: the `__dict__` of every
    module (submodules too) and of every object of the user's own class found (to the depth and
    count `_walk_plain` searches), the plain entries of optimizer state (an int step count), and
    the param group settings of optimizers reached through such objects (those the function
    reaches directly are runtime/python_state.py's)."""
    settings = []
    seen: set[int] = set()
    for holder, name, kind in found.holders:
        if id(holder) in seen:
            continue
        seen.add(id(holder))
        try:
            ref = weakref.ref(holder)
        except TypeError:
            continue
        if kind in ("module", "object"):
            attributes = vars(holder)
            if kind == "module" and type(holder).__module__.startswith("torch."):
                # torch's own modules: their settings (`p`, `eps`), not their bookkeeping
                attributes = {key: value for key, value in attributes.items() if key[0] != "_"}
            values = _plain_values(attributes, _MODULE_INTERNALS | _FOLLOWED if kind == "module" else frozenset())
            if values:
                settings.append((_attributes(ref), f"{name}.", values))
            continue
        for param, state in list(holder.state.items())[:_PLAIN_ITEMS]:
            values = _plain_values(state) if type(state) is dict else {}
            if values and isinstance(param, torch.Tensor):  # named as its tensors are: `opt.state[model.fc.weight]`
                owner = found.get(id(param), ("param",))[0]
                settings.append((_state_of(ref, weakref.ref(param)), f"{name}.state[{owner}].", values))
        if kind == "optimizer":
            for index, group in enumerate(holder.param_groups):
                values = _plain_values(group, frozenset({"params"}))
                if values:
                    settings.append((_group_of(ref, index), f"{name}.param_groups[{index}].", values))
    return settings


def _attributes(ref: weakref.ref) -> Callable[[], dict | None]:
    def now() -> dict | None:
        holder = ref()
        return None if holder is None else vars(holder)
    return now


def _state_of(ref: weakref.ref, param_ref: weakref.ref) -> Callable[[], dict | None]:
    def now() -> dict | None:
        optimizer, param = ref(), param_ref()
        return None if optimizer is None or param is None else optimizer.state.get(param)
    return now


def _group_of(ref: weakref.ref, index: int) -> Callable[[], dict | None]:
    def now() -> dict | None:
        optimizer = ref()
        groups = [] if optimizer is None else optimizer.param_groups
        return groups[index] if index < len(groups) else None
    return now
