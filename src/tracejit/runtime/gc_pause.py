"""The slow path of a traced call with Python's cyclic garbage collector paused.

Recording and compiling allocate many small objects (records, graphs, generated source), and
the collector's full passes over every live object (torch's own modules included) cost 15-25% of
a first call. They find little there: what a call makes and drops is mostly freed by reference
counting. The collector runs again once the call is over, on what built up meanwhile.
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
