"""`@tracejit.trace` on a method: one traced function per instance, as `torch.compile` does.

`obj.forward` looks the decorated function up through the trace's `__get__`, which hands out the
traced function of that instance, created on first use with the same options. Each call passes
the instance as the keyword argument `self`: not an input but where the function reaches its
parameters, buffers and state, so they are externals named `self.fc1.weight`, and the instance
is watched as any keyword module or object is. Its training flags select traces (`model.eval()`
between calls of a decorated `forward`), and without the host its settings are guarded. (Bound
in a closure cell instead, its `eval()` raised TraceMismatchError and a changed `self.scale` was
frozen by host-free calls.)

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

import torch

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
    if isinstance(instance, type):  # a classmethod's class: its __dict__ is read-only, attributes are not
        if KEY not in state:
            setattr(instance, KEY, _TracedMethods())
        state = {KEY: state[KEY]}
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
        bound = methods[id(traced)] = BoundMethod(type(traced)(_bind(traced._function, instance), **options),
                                                  instance)
    return bound


SELF = "self"  # the keyword the instance is passed as


class BoundMethod:
    """The traced method of one instance: calls the trace with the instance as keyword `self`, and
    is the trace otherwise (`obj.forward.stats`, `.listing()`, `.dump(...)`). It lives in the
    instance's __dict__ and holds the instance (`step = Trainer().train_step` keeps it alive, as a
    bound method does); the cycle goes with the instance."""

    def __init__(self, traced: Any, instance: Any):
        self.traced = traced
        self.instance = instance
        functools.update_wrapper(self, traced, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if SELF in kwargs:
            raise TypeError(f"tracejit: {self.traced.__name__}() got a keyword argument 'self'; the traced method "
                            f"passes its instance under that name")
        return self.traced(*args, **kwargs, **{SELF: self.instance})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["traced"], name)


class UnboundMethod:
    """A traced method looked up on its class (`Base.forward`). Called with an instance first
    (`Base.forward(self, x)` in a subclass's forward), it is that instance's traced method, as
    `obj.forward` is; called with a tensor first, it is the trace (a traced function kept as a
    class attribute), as a plain function looked up on a class is the function."""

    def __init__(self, traced: Any):
        self.traced = traced
        functools.update_wrapper(self, traced, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args and not isinstance(args[0], torch.Tensor):
            return bound_trace(self.traced, args[0])(*args[1:], **kwargs)
        return self.traced(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["traced"], name)


def _bind(function: Callable, instance: Any) -> Callable:
    """`function` taking its first argument as the keyword `self`, named like the method."""

    def method(*args: Any, **kwargs: Any) -> Any:
        return function(kwargs.pop(SELF), *args, **kwargs)

    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(method, name, getattr(function, name, None))
    method.__tracejit_method__ = function  # whose globals the call reads (names.code_owner)
    try:  # positional names for messages: the method's without `self`
        method.__signature__ = inspect.signature(functools.partial(function, instance))
    except (TypeError, ValueError):
        pass
    return method
