"""The torch-level calls an optimizer's `step()` or `zero_grad()` made, and which optimizer.

torch.optim wraps both methods in a profiler range ("Optimizer.step#Adam.step",
"Optimizer.zero_grad#Adam.zero_grad"): the range's enter and exit calls, which the API tracer
sees like any torch call, delimit the calls the method made, and the method's frame holds the
optimizer. Checked replay at the API level answers such a method call as a whole when the
optimizer is torch's own and its state is what it was (runtime/stand_ins.py): its Python is most
of what a checked call costs beyond the program.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim import optimizer as optimizer_module

from .own_hooks import any_foreign

STEP, ZERO_GRAD = "step", "zero_grad"
# the code of the wrapper torch.optim puts around every optimizer class's step(), and of zero_grad()
_STEP_WRAPPER = Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__
_ZERO_GRAD = inspect.unwrap(Optimizer.zero_grad).__code__
_FRAMES = 12  # how far up from the range's enter call the method's frame may be


@dataclass
class OptimizerSnapshot:
    """An optimizer's Python state when one of its methods began: what decides what it dispatches.
    Shallow copies (the tensors themselves), shaped like the optimizer for
    runtime/optimizer_settings.py."""

    optimizer_class: type
    param_groups: list[dict]
    state: dict  # parameter -> its state
    defaults: dict
    with_grad: list[list[bool]]  # per group, which parameters have a gradient (step() skips the others)

    @classmethod
    def of(cls, optimizer: Optimizer) -> OptimizerSnapshot:
        with torch._C.DisableTorchFunction():  # not calls of the traced function
            groups = [dict(group, params=list(group["params"])) for group in optimizer.param_groups]
            state = {p: dict(optimizer.state[p]) for group in groups for p in group["params"] if p in optimizer.state}
            with_grad = [[p.grad is not None for p in group["params"]] for group in groups]
        return cls(type(optimizer), groups, state, dict(optimizer.defaults), with_grad)


@dataclass
class OptimizerCall:
    kind: str  # STEP or ZERO_GRAD
    optimizer: weakref.ref
    start: int  # the index of the range's enter call among the trace's calls
    arguments: tuple  # zero_grad: (set_to_none,); step: ()
    end: int = -1  # one past the range's exit call
    refused: str | None = None  # why it cannot be answered as a whole
    snapshot: Any = None  # OptimizerSnapshot when it began, until the stand-in is built


def is_stock(optimizer: Optimizer) -> bool:
    """torch's own optimizer class, not a subclass that may change what step() does."""
    cls = type(optimizer)
    step = inspect.unwrap(cls.step)
    return (cls.__module__.startswith("torch.optim.") and getattr(step, "__module__", "").startswith("torch.optim.")
            and cls.zero_grad is Optimizer.zero_grad)


def step_hooks(optimizer: Optimizer) -> bool:
    """Hooks around step() run user code there."""
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or any_foreign((optimizer_module._global_optimizer_pre_hooks, optimizer_module._global_optimizer_post_hooks)))


class OptimizerCalls:
    """Follows the profiler ranges of a call while the API tracer notes it."""

    def __init__(self) -> None:
        self.open: list[OptimizerCall | None] = []  # innermost last; None for other ranges
        self.found: list[OptimizerCall] = []

    def enter(self, name: object, index: int) -> None:
        kind = None
        if isinstance(name, str):
            kind = STEP if name.startswith("Optimizer.step#") else ZERO_GRAD if name.startswith("Optimizer.zero_grad#") else None
        self.open.append(_method_call(kind, index) if kind is not None else None)

    def exit(self, index: int) -> None:
        if self.open:  # ranges opened by `with` blocks close innermost first
            call = self.open.pop()
            if call is not None:
                call.end = index + 1
                self.found.append(call)


def _frame_running(code: Any, frame: Any, depth: int) -> Any:
    """The innermost of `depth` frames from `frame` outwards that runs `code`, or None."""
    for _ in range(depth):
        if frame is None or frame.f_code is code:
            return frame
        frame = frame.f_back
    return None


def _method_call(kind: str, index: int) -> OptimizerCall | None:
    frame = _frame_running(_STEP_WRAPPER if kind == STEP else _ZERO_GRAD, sys._getframe(2), _FRAMES)
    if frame is None:
        return None
    values = frame.f_locals
    if kind == STEP:
        args, kwargs = values.get("args", ()), values.get("kwargs", {})
        optimizer, arguments = args[0] if args else None, ()
        refused = "step() got arguments (a closure, a scaler's)" if len(args) != 1 or kwargs else None
    else:
        optimizer, arguments, refused = values.get("self"), (values.get("set_to_none"),), None
    if not isinstance(optimizer, Optimizer):
        return None
    if not is_stock(optimizer):
        refused = f"{type(optimizer).__qualname__} is not one of torch.optim's own optimizers"
    elif kind == STEP and step_hooks(optimizer):
        refused = "the optimizer has step hooks"
    snapshot = OptimizerSnapshot.of(optimizer) if refused is None else None
    return OptimizerCall(kind, weakref.ref(optimizer), index, arguments, refused=refused, snapshot=snapshot)


def setting_read_by_step(tensor: torch.Tensor, depth: int = 48) -> bool:
    """Whether a host read of `tensor` is torch.optim's own step() reading a tensor setting of its
    param groups (fused Adam takes tensor betas as numbers): the program binds such a setting where
    it is, on every call (runtime/optimizer_settings.py). The step's frame is looked for above the
    read, as `_method_call` looks for it above a profiler range."""
    frame = _frame_running(_STEP_WRAPPER, sys._getframe(1), depth)
    if frame is None:
        return False
    args = frame.f_locals.get("args", ())
    optimizer = args[0] if args else None
    if not isinstance(optimizer, Optimizer) or not is_stock(optimizer):
        return False  # a user's step() may read it for anything
    return any(value is tensor or (type(value) is tuple and any(item is tensor for item in value))
               for group in optimizer.param_groups for key, value in group.items() if key != "params")


def branching_step(depth: int = 48) -> Optimizer | None:
    """The optimizer whose step() runs above the caller, when nothing but torch.optim's code runs
    in it (a stock optimizer, no closure, no step hooks): a different op there is torch's own
    branch on the optimizer's state or settings (RAdam's rectification switching on at step 6,
    read from its step count), not the user's program changing."""
    frame = _frame_running(_STEP_WRAPPER, sys._getframe(1), depth)
    if frame is None:
        return None
    args, kwargs = frame.f_locals.get("args", ()), frame.f_locals.get("kwargs", {})
    optimizer = args[0] if len(args) == 1 and not kwargs else None
    if not isinstance(optimizer, Optimizer) or not is_stock(optimizer) or step_hooks(optimizer):
        return None
    return optimizer


# () -> bool: a profiler that records ranges is on (a method's own ranges must appear in its trace)
profiler_enabled = torch._C._autograd._profiler_enabled
