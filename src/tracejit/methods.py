"""`@tracejit.trace` on a method: one traced function per instance, as `torch.compile` does.

`obj.forward` looks the decorated function up through the trace's `__get__`, which hands out the
traced function of that instance, created on first use with the same options. It traces the
method with the instance bound in a closure cell named `self`: the instance is not an input
but where the function reaches its parameters, buffers and state, so they are externals named
`self.fc1.weight`, and `without_host` finds them again through the cell.

Each instance has its own traces, statistics and cache bound (`max_traces`): two models of one
class do not share recorded parameters. They are kept in the instance (see bound_trace), not in
the class, so they go with it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import fields
from typing import Any

KEY = "__tracejit_traces__"  # where an instance keeps its traced methods, in its __dict__


class _TracedMethods(dict):
    """An instance's traced methods, by the decorated trace object's id. A copy of the instance
    (`copy.deepcopy(model)`, pickling) starts without traces: records hold the original's tensors."""

    def __deepcopy__(self, memo: dict) -> _TracedMethods:
        return _TracedMethods()

    def __copy__(self) -> _TracedMethods:
        return _TracedMethods()

    def __reduce__(self) -> tuple:
        return (_TracedMethods, ())


def bound_trace(traced: Any, instance: Any) -> Any:
    """The traced function of `traced` (a decorated method) for `instance`, created on first use.

    It lives in the instance's __dict__, so it goes when the instance goes."""
    state = getattr(instance, "__dict__", None)
    if state is None:
        raise TypeError(f"tracejit.trace on {traced.__qualname__}: {type(instance).__name__} objects have no "
                        f"__dict__ (__slots__), where each instance keeps its traced methods; add '__dict__' to "
                        f"__slots__, or trace a function that takes the object as a keyword argument")
    methods = state.get(KEY)
    if methods is None:
        methods = state[KEY] = _TracedMethods()
    bound = methods.get(id(traced))
    if bound is None:
        options = {f.name: getattr(traced.options, f.name) for f in fields(traced.options)}
        bound = methods[id(traced)] = type(traced)(_bind(traced._function, instance), **options)
    return bound


def _bind(function: Callable, self: Any) -> Callable:
    """`function` with its first argument bound to `self`, named like the method."""

    def method(*args: Any, **kwargs: Any) -> Any:
        return function(self, *args, **kwargs)

    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(method, name, getattr(function, name, None))
    try:  # positional names for messages: the method's without `self`
        method.__signature__ = inspect.signature(functools.partial(function, self))
    except (TypeError, ValueError):
        pass
    return method
