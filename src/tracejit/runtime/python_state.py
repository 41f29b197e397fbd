"""Python state a call changes that a program run without the function cannot change.

A learning-rate scheduler stepped inside the traced function writes `param_groups` (and its own
`last_epoch`) on every call. A host-free call reads those settings but never runs the scheduler,
so the schedule would freeze at the recorded step, silently. Such a trace is refused instead. So
is one that changes a plain value of its globals or closure cells (`global SCALE; SCALE *= 0.5`):
the program has the value built in, and the guards of runtime/hostfree.py see only the caller's
changes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from ..errors import HostDependencyError
from ..record.names import plain_roots, roots_of, same_value

_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def python_state(function: Callable, kwargs: dict) -> dict[str, object]:
    """What the call could change: the settings of every param group of the optimizers the
    function reaches (keyword arguments, its globals and closure cells) and the step count of the
    schedulers it reaches, by a readable name."""
    state = {}
    for name, _, value in sorted(roots_of(function, kwargs), key=lambda root: root[0]):
        if isinstance(value, torch.optim.Optimizer):
            for index, group in enumerate(value.param_groups):
                for key, setting in group.items():
                    if key != "params" and not isinstance(setting, torch.Tensor):
                        state[f"{key} of param group {index} of {name}"] = setting
        elif isinstance(value, _SCHEDULERS):
            state.update(scheduler_steps(value, name))
    for name, _, value in plain_roots(function):
        state[name] = copy.deepcopy(value)  # a list changed in place is another value
    return state


def scheduler_steps(scheduler: object, name: str, depth: int = 3) -> dict[str, object]:
    """A scheduler's step count (`last_epoch`; none for one without it: `ChainedScheduler` never
    calls LRScheduler.__init__, nor may a scheduler of the user's own) and those of the schedulers
    it steps (`_schedulers` of ChainedScheduler and SequentialLR), by a readable name."""
    steps = {}
    if hasattr(scheduler, "last_epoch"):
        steps[f"last_epoch of {name}"] = scheduler.last_epoch
    children = getattr(scheduler, "_schedulers", None) if depth else None
    if isinstance(children, (list, tuple)):
        for index, child in enumerate(children):
            if isinstance(child, _SCHEDULERS):
                steps.update(scheduler_steps(child, f"{name}._schedulers[{index}]", depth - 1))
    return steps


def refuse_python_state_changes(function: Callable, function_name: str, before: dict, kwargs: dict,
                                seen: list[str] = ()) -> HostDependencyError | None:
    """The error for a call that changed what `python_state` watches, or what the recording's
    watch saw change however the function reached it (`seen`, record/reached.py); or None."""
    after = python_state(function, kwargs)
    # compared as the guards compare: 1 -> 1.0 and 0.0 -> -0.0 are changes too
    changed = [f"{key}: {before[key]!r} -> {after[key]!r}" for key in before
               if key in after and not same_value(after[key], before[key])]
    changed = changed or list(seen)  # the names the function reaches them by, where it does
    if not changed:
        return None
    listed = "\n".join(f"    {line}" for line in changed[:5])
    return HostDependencyError(
        f"without_host=True cannot skip {function_name}(): the traced call changes Python state that the "
        f"program cannot change without the function (a learning-rate scheduler stepped inside it, a counter "
        f"or factor in a global, a hook registered and left registered?):\n"
        f"{listed}\n"
        f"Call scheduler.step() after the traced call instead: the settings it writes into param_groups are "
        f"read on every call without the host. Change plain values outside the traced call, or keep them in "
        f"tensors. Or trace without without_host."
    )
