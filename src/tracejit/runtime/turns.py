"""Calls of one traced function take turns across threads (they share the program's buffers).

A thread inside a traced call may call another traced function from an exclude_from_trace()
block. Two threads doing that the other way round (f's block calls g while g's block calls f)
would each hold the lock the other waits for: a wait that closes such a cycle raises instead.
The uncontended call costs one non-blocking acquire; who holds what is only looked up on a wait.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_traced: weakref.WeakSet = weakref.WeakSet()  # every traced function (its `_running_on`: the thread in its call)
_waiting_for: dict[int, Any] = {}  # thread -> the traced function whose turn it waits for
_POLL_SECONDS = 0.01


def register(traced: Any) -> None:
    _traced.add(traced)


def take_turn(traced: Any, thread: int) -> None:
    """Acquire `traced`'s lock for a call on `thread`, which another thread holds (the caller
    tried `acquire(blocking=False)` first); the call releases it."""
    lock = traced._lock
    if lock.acquire(blocking=False):
        return
    held = _held_by(thread)
    if not held:  # holding no traced call's lock, this thread closes no cycle
        lock.acquire()
    else:
        _wait_unless_deadlocked(traced, lock, thread, held)


def _held_by(thread: int) -> list:
    while True:
        try:
            return [t for t in list(_traced) if t._running_on == thread]
        except RuntimeError:  # a traced function made on another thread meanwhile
            continue


def _wait_unless_deadlocked(traced: Any, lock: threading.Lock, thread: int, held: list) -> None:
    _waiting_for[thread] = traced
    try:
        while not lock.acquire(timeout=_POLL_SECONDS):
            holder = _holder_waiting_for(traced, thread)
            if holder is not None:
                raise RuntimeError(
                    f"tracejit: {traced.__name__}() was called from {held[-1].__name__}()'s "
                    f"exclude_from_trace() block while another thread runs {traced.__name__}() and waits, "
                    f"in turn, for {holder}() that this thread runs: the calls would wait for each other "
                    f"forever. Calls of one traced function take turns across threads; call the undecorated "
                    f"function inside the block, or keep such nested calls on one thread.")
    finally:
        del _waiting_for[thread]


def _holder_waiting_for(traced: Any, thread: int) -> str | None:
    """The name of the function this thread runs that the chain of holders of `traced` waits
    for (holder -> the function it waits for -> its holder ...), if the chain comes back here."""
    wanted = traced
    for _ in range(len(_waiting_for) + 1):
        holder = wanted._running_on
        if holder is None:
            return None
        next_wanted = _waiting_for.get(holder)
        if next_wanted is None:
            return None
        if next_wanted._running_on == thread:
            return next_wanted.__name__
        wanted = next_wanted
    return None
