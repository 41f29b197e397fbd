"""Calls of one traced function take turns across threads (they share the program's buffers).

A thread inside a traced call may call another traced function from an exclude_from_trace()
block. Two threads doing that the other way round (f's block calls g while g's block calls f)
would each hold the lock the other waits for: a wait that closes such a cycle raises instead.
"""

from __future__ import annotations

import threading
from typing import Any

_local = threading.local()  # .held: the traced functions whose calls this thread runs, outermost first
_waiting_for: dict[int, Any] = {}  # thread -> the traced function whose turn it waits for
_POLL_SECONDS = 0.01


def take_turn(traced: Any, thread: int) -> None:
    """Acquire `traced`'s lock for a call on `thread`; `end_turn` gives it back."""
    held = getattr(_local, "held", None)
    if held is None:
        held = _local.held = []
    lock = traced._lock
    if not lock.acquire(blocking=False):
        if not held:  # holding no traced call's lock, this thread closes no cycle
            lock.acquire()
        else:
            _wait_unless_deadlocked(traced, lock, thread, held)
    held.append(traced)


def end_turn(traced: Any) -> None:
    _local.held.pop()
    traced._lock.release()


def _wait_unless_deadlocked(traced: Any, lock: threading.Lock, thread: int, held: list) -> None:
    _waiting_for[thread] = traced
    try:
        while not lock.acquire(timeout=_POLL_SECONDS):
            cycle = _cycle_through(traced, thread)
            if cycle:
                raise RuntimeError(
                    f"tracejit: {traced.__name__}() was called from {held[-1].__name__}()'s "
                    f"exclude_from_trace() block while another thread's call of {traced.__name__}() waits, in "
                    f"turn, for {' -> '.join(cycle)} on this thread: the calls would wait for each other "
                    f"forever. Calls of one traced function take turns across threads; call the undecorated "
                    f"function inside the block, or keep such nested calls on one thread.")
    finally:
        del _waiting_for[thread]


def _cycle_through(traced: Any, thread: int) -> list[str] | None:
    """The names along holder -> awaited function links from `traced` back to `thread`, if any."""
    names, wanted = [], traced
    for _ in range(len(_waiting_for) + 1):
        holder = wanted._running_on
        if holder is None:
            return None
        if holder == thread:
            return [*names, wanted.__name__]
        names.append(wanted.__name__)
        wanted = _waiting_for.get(holder)
        if wanted is None:
            return None
    return None
