"""LR schedulers a traced function steps, saved and restored around a checked call that runs twice.

A checked call at the API level that diverges runs the function again at the aten level: Python
side effects before the divergence happen twice in that call (docs/guide.md). For a scheduler
stepped inside the step that is not a counter off by one but the whole training schedule running
ahead (OneCycleLR three epochs ahead after three such calls, hunt R). So, as for GradScaler's
stages (record/amp.py), the schedulers the function reaches, and the param-group settings they
write, are saved when an API-level call begins and put back before the aten-level run.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .names import held_values, roots_of

_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


class SchedulerStates:
    """The LR schedulers a traced function reaches (keyword arguments, globals, closure cells, one
    level into those, and the schedulers a SequentialLR or ChainedScheduler holds)."""

    def __init__(self, function: Any, kwargs: dict):
        roots = [value for _, _, value in roots_of(function, kwargs)]
        found: dict[int, Any] = {}
        pending = [v for holder in roots for v in (holder, *held_values(holder)) if isinstance(v, _SCHEDULERS)]
        while pending:
            scheduler = pending.pop()
            if id(scheduler) not in found:
                found[id(scheduler)] = scheduler
                pending += [s for s in getattr(scheduler, "_schedulers", ()) if isinstance(s, _SCHEDULERS)]
        self.schedulers = tuple(weakref.ref(s) for s in found.values())

    def __bool__(self) -> bool:
        return bool(self.schedulers)

    def save(self) -> list:
        saved = []
        for ref in self.schedulers:
            scheduler = ref()
            if scheduler is not None:
                optimizer = getattr(scheduler, "optimizer", None)
                groups = getattr(optimizer, "param_groups", ())
                saved.append((scheduler, dict(scheduler.__dict__),
                              [(group, {k: v for k, v in group.items() if k != "params"}) for group in groups]))
        return saved

    @staticmethod
    def restore(saved: list) -> None:
        for scheduler, attributes, groups in saved:
            scheduler.__dict__.clear()
            scheduler.__dict__.update(attributes)
            for group, settings in groups:
                group.update(settings)
