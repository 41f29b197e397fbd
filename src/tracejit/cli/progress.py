"""A one-line progress bar on stderr, so timed output on stdout stays clean."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`[#######.......]  35/100 calls`, redrawn in place at most ten times a second."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 30):
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._drawn_at = 0.0
        self._drawn = -1

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if done == self._drawn or (done < self.total and now - self._drawn_at < 0.1):
            return
        self._drawn_at, self._drawn = now, done
        filled = self.width * done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r[{bar}] {done:>{len(str(self.total))}}/{self.total} {self.label}")
        self.stream.flush()

    def close(self) -> None:
        self.update(self.total)
        self.stream.write("\n")
        self.stream.flush()
