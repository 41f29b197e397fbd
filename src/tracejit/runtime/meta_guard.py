"""One C++ call for the shape, dtype and device checks of the tensors a host-free call binds.

A host-free call checks each external tensor it binds (parameters, gradients, optimizer state)
for its recorded shape, strides, dtype and device. Written in Python that is about 0.15 us a tensor: 4 us
for the 24 parameters and state tensors of an Adam step on a three-layer MLP, on a step of 130 us.
torch checks tensors in C++ for its own compiler (dynamo's `TensorGuards`): Python type, dtype,
device, `requires_grad`, sizes, strides, and the dispatch keys, which also hold the thread's dispatch
state (inference mode, autocast, a dispatch mode).

A `MetaGuard` is learned from tensors that the precise Python checks have just passed, in the
dispatch state of that call. While it passes they would too, since it checks more (the same
sizes, strides, dtype and device, and more besides), so the call skips them. When it fails (a changed
tensor, or a call in another dispatch state) the precise checks run and decide, and a call that
passes them teaches the guard its tensors. The guard only ever saves time: the answer is always
the precise checks'.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # a torch build without dynamo: the precise checks run on every call
    TensorGuards = None


def _never(*tensors: Any) -> bool:
    return False


class MetaGuard:
    __slots__ = ("check",)

    def __init__(self) -> None:
        self.check = _never  # (*tensors) -> True when each has the learned facts

    def learn(self, *tensors: torch.Tensor) -> None:
        if TensorGuards is None:
            return
        try:
            guard = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                 dynamic_dims_strides=[list(t.stride()) for t in tensors])
        except Exception:  # noqa: BLE001 - a layout it does not take (sparse, nested): checked in Python
            self.check = _never
            return
        self.check = guard.check
