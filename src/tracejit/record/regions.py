"""Profiler ranges (`record_function`) open around the ops of a call.

The optimizer wraps `step()` in a range named "Optimizer.step#Adam.step"; knowing which ops ran
inside it lets without_host bind the learning rate where the record used it. The range ops
themselves are profiler bookkeeping and never part of the record.
"""

from __future__ import annotations

from typing import Any


class RegionTracker:
    def __init__(self) -> None:
        self.open: list[str] = []  # innermost last

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        result = func(*args, **kwargs)
        if args and isinstance(args[0], str):
            self.open.append(args[0])
        elif self.open and func._schema.name.endswith("_record_function_exit"):
            # The exit op gets the range's handle in another Python wrapper than enter returned, so
            # it cannot be matched by identity; ranges opened by `with` blocks close innermost first.
            self.open.pop()
        return result

    def current(self) -> tuple[str, ...]:
        return tuple(self.open)


def in_optimizer_step(regions: tuple[str, ...]) -> bool:
    return any(name.startswith("Optimizer.step#") for name in regions)
