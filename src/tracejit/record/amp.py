"""Mixed precision: where `torch.amp.GradScaler` reads the host.

Unless the optimizer takes the scaler on the device (`Adam(fused=True)` gets `grad_scale` and
`found_inf`), `GradScaler.step()` reads `found_inf.item()` and skips `optimizer.step()` on an
overflow: the one data-dependent branch of a mixed-precision step. Checked replay lets that branch
go the other way (runtime/replay.py), and without_host names it in its refusal.

A scaler also keeps, per optimizer, which of its calls a step has made (`unscale_`, `step`,
cleared by `update`). A checked call that diverges at the API level runs the function again: the
scalers it reaches get back the stages they had before the first run (ScalerStages), or the second
run's `scaler.step()` would raise torch's "step() has already been called since the last update()".
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from .names import held_values, roots_of

_GRAD_SCALER = os.path.join("amp", "grad_scaler.py")
INF_CHECK = " (GradScaler's inf check)"  # appended to the `what` of such a host read


_CHECKING = frozenset({"_maybe_opt_step", "step"})  # GradScaler's methods that read found_inf


def in_grad_scaler() -> bool:
    """Whether the running host read is GradScaler's inf check (not, say, `scaler.get_scale()`)."""
    frame = sys._getframe(1)
    for _ in range(40):  # the read's frames: torch's Tensor.item, tracejit's handlers, the scaler
        if frame is None:
            return False
        code = frame.f_code
        if code.co_filename.endswith(_GRAD_SCALER) and code.co_name in _CHECKING:
            return True
        frame = frame.f_back
    return False


def is_inf_check(what: str) -> bool:
    """Whether a recorded host read (its `what`) is GradScaler's inf check."""
    return what.endswith(INF_CHECK)


class ScalerStages:
    """The GradScalers a traced function reaches (keyword arguments, globals, closure cells, and
    one level into those: a trainer's `self.scaler`, a dict of training objects), whose
    per-optimizer stages a call can save and restore."""

    def __init__(self, function: Any, kwargs: dict):
        self.keywords = tuple(name for name, value in kwargs.items() if isinstance(value, torch.amp.GradScaler))
        roots = [value for _, _, value in roots_of(function, {})]
        found = {id(s): s for s in roots if isinstance(s, torch.amp.GradScaler)}
        for holder in (*roots, *kwargs.values()):
            for value in held_values(holder):
                if isinstance(value, torch.amp.GradScaler):
                    found.setdefault(id(value), value)
        keyword_ids = {id(kwargs[name]) for name in self.keywords}
        self.others = tuple(weakref.ref(s) for key, s in found.items() if key not in keyword_ids)

    def __bool__(self) -> bool:
        return bool(self.keywords or self.others)

    def save(self, kwargs: dict) -> list:
        scalers = [kwargs.get(name) for name in self.keywords] + [ref() for ref in self.others]
        # a disabled scaler (`GradScaler(enabled=False)`) keeps no stages: its methods do nothing
        return [(scaler, {key: (state["stage"], dict(state["found_inf_per_device"]))
                          for key, state in scaler._per_optimizer_states.items()})
                for scaler in scalers if isinstance(scaler, torch.amp.GradScaler) and scaler._enabled]

    @staticmethod
    def restore(saved: list) -> None:
        for scaler, states in saved:
            scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state, {
                key: {"stage": stage, "found_inf_per_device": dict(found)} for key, (stage, found) in states.items()})

