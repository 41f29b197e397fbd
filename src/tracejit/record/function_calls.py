"""The torch-level calls torch.nn.utils' gradient clipping and `nn.Module.zero_grad` made, and
their arguments.

`clip_grad_norm_(model.parameters(), 1.0)` is a few ops, but its Python reads every parameter's
`.grad`, groups the gradients and converts the scale, each a call the checker matches one by one:
about 200 us of a checked call with 18 parameters, as much as the rest of a small training step.
What it dispatches is decided by its arguments (the parameters by identity and order, the max
norm, the norm type, the flags) and by the gradients, which the record answers anyway. So checked
replay at the API level answers the whole call when the arguments are the recorded ones
(runtime/function_stand_ins.py), as it answers an optimizer's step().

torch wraps these functions in `_no_grad`, a closure over the function: every binding of the
public one (`torch.nn.utils.clip_grad_norm_`, `from torch.nn.utils import clip_grad_norm_`) calls
what the closure's cell holds. While the API tracer notes a call, the cell holds a function that
notes where the call's torch-level calls begin and end; while a checked call runs, the stand-in.

`model.zero_grad()` (torch.nn.Module's) reads every parameter's `.grad` and sets it to None: two
calls per parameter, decided by the parameters and the gradients alike. Its class attribute is
swapped the same way (a subclass's own `zero_grad` is not: it runs, matched call by call).
"""

from __future__ import annotations

import inspect
import types
from _thread import get_ident
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.utils import clip_grad


@dataclass(frozen=True)
class Answerable:
    """A torch function a checked call may answer whole."""

    name: str
    holder: Any  # what holds the function: the cell of torch's `_no_grad` wrapper, nn.Module
    attribute: str  # ...as this attribute (`cell_contents`, `zero_grad`)
    function: Callable  # torch's function, which the holder holds otherwise
    arguments: Callable  # (*args, **kwargs) -> the arguments by position, defaults filled in
    helpers: tuple  # (namespace, name, function): the module functions it calls, as torch has them
    # (first argument) -> (the parameters as a list, what to pass on in its place); TypeError when
    # the function is not called on parameters it lists this way (it then runs for real)
    listing: Callable
    without_grad: bool  # torch's wrapper turns grad mode off around it

    def helpers_changed(self) -> bool:
        return any(namespace.get(name) is not function for namespace, name, function in self.helpers)

    def held(self) -> Any:
        return getattr(self.holder, self.attribute)

    def hold(self, value: Any) -> None:
        setattr(self.holder, self.attribute, value)


def _arguments_function(function: Callable) -> Callable | None:
    """A function taking what `function` takes and returning its arguments in order; None when its
    signature is not plain (positional-or-keyword parameters only)."""
    parameters = list(inspect.signature(function).parameters.values())
    if not parameters or any(p.kind is not p.POSITIONAL_OR_KEYWORD or not p.name.isidentifier() for p in parameters):
        return None
    defaults = {f"d{i}": p.default for i, p in enumerate(parameters) if p.default is not p.empty}
    heads = [p.name if p.default is p.empty else f"{p.name}=d{i}" for i, p in enumerate(parameters)]
    source = f"def arguments({', '.join(heads)}):\n    return ({''.join(p.name + ', ' for p in parameters)})\n"
    namespace = dict(defaults)
    exec(compile(source, f"<tracejit arguments of {function.__qualname__}>", "exec"), namespace)
    return namespace["arguments"]


def _helpers(function: Callable, depth: int = 3) -> tuple | None:
    """The functions `function` calls through its module's globals, and theirs, as torch has them;
    None when one of them is not torch's (wrapped by a library before tracejit was imported: its
    Python would run inside the span, which a stand-in skips)."""
    found: dict[tuple[int, str], tuple] = {}
    foreign = []

    def visit(fn: Any, level: int) -> None:
        fn = inspect.unwrap(fn)
        code, namespace = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if code is None or namespace is None or level > depth:
            return
        for name in code.co_names:
            value = namespace.get(name)
            if (value is None or isinstance(value, (type, types.ModuleType)) or not callable(value)
                    or (id(namespace), name) in found):
                continue
            found[(id(namespace), name)] = (namespace, name, value)
            if not (getattr(value, "__module__", None) or "").startswith(("torch.", "typing")):
                foreign.append(name)
            visit(value, level + 1)

    visit(function, 0)
    return None if foreign else tuple(found.values())


def _answerable(holder: Any, attribute: str, listing: Callable, without_grad: bool) -> Answerable | None:
    function = getattr(holder, attribute)
    arguments = _arguments_function(function) if isinstance(function, types.FunctionType) else None
    helpers = _helpers(function)
    if arguments is None or helpers is None:
        return None
    return Answerable(function.__name__, holder, attribute, function, arguments, helpers, listing, without_grad)


def listed_parameters(parameters: Any) -> tuple[list, Any]:
    """(the parameters as a list, what to pass on in their place), as torch's function lists them:
    a tensor is one parameter; any other iterable is consumed here (its Python, a `filter`'s
    predicate reading `p.requires_grad`, runs before the function's span, when the trace was noted
    as in every call), so torch's function gets a fresh generator over the same items for a
    generator (it warns about an empty one) and the list for anything else."""
    if isinstance(parameters, torch.Tensor):
        return [parameters], parameters
    listed = list(parameters)
    return listed, ((p for p in listed) if isinstance(parameters, types.GeneratorType) else listed)


def _clipping(wrapper: Any) -> Answerable | None:
    code = getattr(wrapper, "__code__", None)
    closure = getattr(wrapper, "__closure__", None)
    if code is None or code.co_freevars != ("func",) or not closure:
        return None  # torch wraps it otherwise: not answered
    return _answerable(closure[0], "cell_contents", listed_parameters, without_grad=True)


def module_parameters(module: Any) -> tuple[list, Any]:
    """`nn.Module.zero_grad`'s parameters, as it lists them (`self.parameters()`); TypeError for a
    module nn.DataParallel made (whose zero_grad warns and clears nothing of the original's)."""
    if not isinstance(module, nn.Module) or getattr(module, "_is_replica", False):
        raise TypeError("not a module zero_grad() clears")
    return list(module.parameters()), module


ANSWERABLE = tuple(a for a in (*map(_clipping, (clip_grad.clip_grad_norm_, clip_grad.clip_grad_value_)),
                               _answerable(nn.Module, "zero_grad", module_parameters, without_grad=False))
                   if a is not None)


@dataclass
class FunctionCall:
    answerable: Answerable
    start: int  # the index of its first torch-level call among the trace's calls
    end: int  # one past its last
    args: Any = None  # templates (record/api.py) of its arguments, the parameters as a list
    result: Any = None
    refused: str | None = None


class FunctionCalls:
    """Notes the calls of ANSWERABLE functions while the API tracer notes a call."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.found: list[FunctionCall] = []
        self.installed: list[tuple[Answerable, Callable]] = []
        self.thread = get_ident()

    def install(self) -> None:
        self.thread = get_ident()
        for answerable in ANSWERABLE:
            if answerable.held() is answerable.function:  # not someone else's
                noting = self._noting(answerable)
                answerable.hold(noting)
                self.installed.append((answerable, noting))

    def remove(self) -> None:
        for answerable, noting in self.installed:
            if answerable.held() is noting:
                answerable.hold(answerable.function)
        self.installed = []

    def _noting(self, answerable: Answerable) -> Callable:
        function, trace = answerable.function, self.tracer.trace

        def noting(*args: Any, **kwargs: Any) -> Any:
            if get_ident() != self.thread or trace.refused is not None:
                return function(*args, **kwargs)
            try:
                arguments = answerable.arguments(*args, **kwargs)
                listed, passed = answerable.listing(arguments[0])
            except TypeError:  # torch's function raises it, or takes it otherwise
                return function(*args, **kwargs)
            start = len(trace.calls)
            result = function(passed, *arguments[1:])
            call = FunctionCall(answerable, start, len(trace.calls))
            if not listed:
                call.refused = "it has no parameters"
            elif answerable.name == "zero_grad" and arguments[1] is not True:
                # set_to_none=False zeroes the gradients in place and turns their requires_grad off
                call.refused = "set_to_none is not True"
            else:
                try:
                    call.args = self.tracer._template((listed, *arguments[1:]))
                    call.result = self.tracer._template(result)
                except Exception:  # noqa: BLE001 - a value the templates cannot hold: the call runs for real
                    call.refused = "its arguments or result cannot be followed"
            self.found.append(call)
            return result

        return noting
