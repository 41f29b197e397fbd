"""A program's ops were recorded after autocast had cast them: they run with autocast off.

A caller's `torch.autocast` is still on for the thread when a compiled program runs (the
host-free call, a checked call's program after the function, a host read realized inside the
function's own autocast block, a loaded graph). The dispatcher would cast the recorded ops
again: a region the function ran in float32 under `autocast(enabled=False)` would come back
bfloat16. Excluding the autocast dispatch keys makes every aten op of the program run as
recorded, as the C and Triton kernels do anyway.
"""

from __future__ import annotations

import functools
import operator

import torch

_KEYS = [getattr(torch._C.DispatchKey, name) for name in dir(torch._C.DispatchKey) if name.startswith("Autocast")]
AUTOCAST_KEYS = functools.reduce(operator.or_, (torch._C.DispatchKeySet(key) for key in _KEYS))
any_autocast_enabled = torch._C._is_any_autocast_enabled


def outside_autocast() -> torch._C._ExcludeDispatchKeyGuard:
    """A context in which no autocast dispatch key runs (0.5 us: cheap next to a program)."""
    return torch._C._ExcludeDispatchKeyGuard(AUTOCAST_KEYS)
