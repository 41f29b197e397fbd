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
        self._names: dict[int, str] = {}  # id of the range handle -> range name

    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        result = func(*args, **kwargs)
        if args and isinstance(args[0], str):
            self.open.append(args[0])
            self._names[id(result)] = args[0]
        elif args and id(args[0]) in self._names:
            name = self._names.pop(id(args[0]))
            if name in self.open:
                del self.open[len(self.open) - 1 - self.open[::-1].index(name)]
        return result

    def current(self) -> tuple[str, ...]:
        return tuple(self.open)


def in_optimizer_step(regions: tuple[str, ...]) -> bool:
    return any(name.startswith("Optimizer.step#") for name in regions)
