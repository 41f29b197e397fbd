"""The torch.nn modules and torch.optim optimizers a recorded call used, however it reached them.

A call without the host checks that they are as they were (runtime/module_guards.py, and the
optimizer guards of runtime/optimizer_settings.py); a DistributedDataParallel among the modules
that is not a keyword argument selects traces by its state (signature.gradient_state). Global
hooks note them while a call records: a module whose forward runs, an optimizer whose `step()`
runs, reached through a keyword argument, a closure, a global or a helper function alike.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
import torch.optim.optimizer as optimizer_module


class Seen:
    """What one recording call used, each object once, in first-use order."""

    def __init__(self, optimizers: bool):
        self.modules: list[torch.nn.Module] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.watch_optimizers = optimizers
        self._ids: set[int] = set()

    def _note(self, found: list, obj: object) -> None:
        if id(obj) not in self._ids:
            self._ids.add(id(obj))
            found.append(obj)

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        handles = [torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, args: self._note(self.modules, module))]
        if self.watch_optimizers:  # only without the host: the API level's snapshot of an optimizer takes global hooks as the user's
            handles.append(optimizer_module.register_optimizer_step_pre_hook(
                lambda optimizer, args, kwargs: self._note(self.optimizers, optimizer)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def store(self, record) -> None:
        """Keep them, weakly, with the record they were used by."""
        record.modules_called = tuple(map(weakref.ref, self.modules))
        record.optimizers_stepped = tuple(map(weakref.ref, self.optimizers))
