"""Calls of torch's functions that set the random number generator's state.

A compiled program draws a call's random numbers in record order, from wherever the generator
stands when the program runs. A function that sets the generator's state between its
random ops (`torch.utils.checkpoint` restores it to recompute dropout in backward;
`torch.manual_seed`, `get_rng_state`/`set_rng_state`, `torch.random.fork_rng`) makes draws the
program cannot reproduce once the function no longer runs around them: `without_host`, symbolic
recording and the API level refuse such traces. (A read alone changes no draw: the state it
returns is the one before the call's draws, not after.) The aten level runs every op in order with the
function, and stays exact.

The functions patched here name the call in the message; what they miss (the generator's own
methods, a name imported before tracing, a random op in an `exclude_from_trace()` block) is found
by the dispatch mode comparing the generator's state before each random op (modes.GeneratorWatch).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .source import user_location

# the functions that move the generator; a read alone (`get_rng_state`) changes no draw
WATCHED = ("set_rng_state", "manual_seed", "seed")


@contextlib.contextmanager
def rng_state_calls(found: list[tuple[str, int]], position: Callable[[], int]) -> Iterator[list]:
    """Within the block, each call of a watched function appends (`torch.<name>() at <location>`,
    the number of ops the call had dispatched by then)."""
    active = [True]
    patched = []
    for name in WATCHED:
        # each module's own binding: importing torch._dynamo rebinds torch.manual_seed to a wrapper
        for module in (torch, torch.random):
            original = getattr(module, name, None)
            if original is not None:
                watched = _watched(name, original, found, position, active)
                setattr(module, name, watched)
                patched.append((module, name, original, watched))
    try:
        yield found
    finally:
        active[0] = False  # a binding made over ours meanwhile (torch._dynamo's) keeps it: inert now
        for module, name, original, watched in patched:
            if getattr(module, name, None) is watched:
                setattr(module, name, original)


def _watched(name: str, original: Any, found: list, position: Callable[[], int], active: list[bool]) -> Any:
    @functools.wraps(original)
    def watched(*args: Any, **kwargs: Any) -> Any:
        if active[0]:
            found.append((f"torch.{name}() at {user_location()}", position()))
        return original(*args, **kwargs)

    return watched


def _first_draw(ops: list) -> int | None:
    return next((i for i, op in enumerate(ops) if torch.Tag.nondeterministic_seeded in getattr(op.op, "tags", ())), None)


def draws_random_numbers(ops: list) -> bool:
    return _first_draw(ops) is not None


def rng_dependency(record: Any, after_first_draw: bool = False) -> str | None:
    """Why a program run apart from the function would draw other random numbers, or None.
    `after_first_draw`: only settings after the first random op count (the function still runs
    before the program draws: a seed set before the first random op is then set in time)."""
    first = _first_draw(record.ops)
    if first is None:
        return None
    calls = [what for what, at in record.rng_calls if not after_first_draw or at > first]
    if not calls:
        return None
    return f"the function sets the random number generator's state ({calls[0]}) around its random ops"
