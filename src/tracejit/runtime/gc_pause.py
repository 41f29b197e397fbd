"""Compiling with Python's cyclic garbage collector paused.

Compiling allocates many small objects (graphs, passes, generated source), and the collector's
full passes over every live object (torch's own modules included) cost 15-25% of a first call.
They find little there: what compiling makes and drops is mostly freed by reference counting.
Only tracejit's own work is paused (building programs, binding them), never the user's function,
whose cyclic garbage is collected as in eager; the collector runs again right after.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    if not gc.isenabled():  # the caller's choice (or an outer pause): left as it is
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
