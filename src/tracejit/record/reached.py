"""The torch.nn modules and torch.optim optimizers a recorded call used, however it reached them.

A call without the host checks that they are as they were (runtime/module_guards.py, and the
optimizer guards of runtime/optimizer_settings.py); a DistributedDataParallel among the modules
that is not a keyword argument selects traces by its state (signature.gradient_state). Global
hooks note them while a call records: a module whose forward runs, an optimizer whose `step()`
runs, reached through a keyword argument, a closure, a global or a helper function alike.

Without the host, the same watch notes what such a call changes that a call without the function
would not: a learning-rate scheduler stepped (scheduler classes' `step` methods are wrapped for
the call's duration, torch having no global scheduler hook), and settings of an optimizer's param
groups written after its `step()`. A call without the function would freeze either.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator

import torch
import torch.optim.optimizer as optimizer_module

from .source import user_location

_SCHEDULER_BASES = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


class Seen:
    """What one recording call used, each object once, in first-use order."""

    def __init__(self, optimizers: bool):
        self.modules: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.watch_optimizers = optimizers
        self._ids: set[int] = set()
        self.changes: list[str] = []  # without the host: what the call changed that only the function changes
        self._settings_at_step: dict[int, tuple[torch.optim.Optimizer, dict]] = {}

    def _note(self, found: list, obj: object) -> None:
        if id(obj) not in self._ids:
            self._ids.add(id(obj))
            found.append(obj)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        handles = [torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: self._note(self.modules, module))]
        patched: list[tuple[type, object]] = []
        if self.watch_optimizers:  # only without the host: the API level's snapshot of an optimizer takes global hooks as the user's
            handles.append(optimizer_module.register_optimizer_step_pre_hook(self._stepping))
            patched = self._wrap_scheduler_steps()
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for cls, original in patched:
                cls.step = original
        for optimizer, settings in self._settings_at_step.values():
            now = _settings(optimizer)
            self.changes += [f"{key} of param group {index} of {type(optimizer).__name__}: {before!r} -> "
                             f"{now[index, key]!r}, written after its step()"
                             for (index, key), before in settings.items()
                             if (index, key) in now and _differs(now[index, key], before)]

    def _stepping(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self._note(self.optimizers, optimizer)
        if id(optimizer) not in self._settings_at_step:
            self._settings_at_step[id(optimizer)] = (optimizer, _settings(optimizer))

    def _wrap_scheduler_steps(self) -> list[tuple[type, object]]:
        thread = threading.get_ident()
        noted: list[str] = []  # the first step is enough (SequentialLR steps its children: it is named)

        def wrap(original):
            @functools.wraps(original)
            def step(scheduler, *args, **kwargs):
                if not noted and threading.get_ident() == thread:
                    noted.append(f"{type(scheduler).__name__}.step() at {user_location()}")
                    self.changes += noted
                return original(scheduler, *args, **kwargs)
            return step

        patched = []
        for cls in _scheduler_classes():
            original = cls.__dict__["step"]
            patched.append((cls, original))
            cls.step = wrap(original)
        return patched

    def store(self, record) -> None:
        """Keep them, weakly, with the record they were used by."""
        record.modules_called = tuple(map(weakref.ref, self.modules))
        record.optimizers_stepped = tuple(map(weakref.ref, self.optimizers))


def _scheduler_classes() -> list[type]:
    """Every scheduler class that defines its own `step`, torch's and the user's subclasses."""
    found: list[type] = []
    pending = list(_SCHEDULER_BASES)
    while pending:
        cls = pending.pop()
        if cls not in found:
            found.append(cls)
            pending += cls.__subclasses__()
    return [cls for cls in found if "step" in cls.__dict__]


def _settings(optimizer: torch.optim.Optimizer) -> dict:
    """The settings of each param group that a host-free call reads or guards (no tensors)."""
    return {(index, key): value for index, group in enumerate(optimizer.param_groups)
            for key, value in group.items() if key != "params" and not isinstance(value, torch.Tensor)}


def _differs(now: object, before: object) -> bool:
    try:
        return bool(now != before)
    except Exception:  # noqa: BLE001 - a value without a truth of !=: an array the user put there
        return now is not before
