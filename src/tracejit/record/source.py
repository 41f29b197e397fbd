"""User source locations: the innermost frame outside torch, tracejit and the standard library."""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings
from dataclasses import dataclass

import torch

_SKIPPED_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep
    for path in (torch.__file__, os.path.dirname(os.path.abspath(__file__)))
) + (sysconfig.get_paths()["stdlib"] + os.sep,)
_skip_cache: dict[str, bool] = {}


@dataclass(frozen=True)
class SourceLocation:
    filename: str
    line: int
    function: str

    def __str__(self) -> str:
        if not self.filename:
            return "<unknown>"
        return f"{os.path.basename(self.filename)}:{self.line} in {self.function}"

    @property
    def code(self) -> str:
        import linecache

        return linecache.getline(self.filename, self.line).strip()


UNKNOWN = SourceLocation("", 0, "")


def _skipped(filename: str) -> bool:
    hit = _skip_cache.get(filename)
    if hit is None:
        # "<tracejit ...>": code tracejit generates (replay steps, programs, kernel launchers)
        hit = filename.startswith(("<frozen", "<tracejit")) or os.path.abspath(filename).startswith(_SKIPPED_DIRS)
        _skip_cache[filename] = hit
    return hit


def user_location(depth: int = 1) -> SourceLocation:
    """Location of the innermost user frame on the current stack."""
    frame = sys._getframe(depth)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _skipped(filename):
            return SourceLocation(filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return UNKNOWN


def traceback_location(tb) -> SourceLocation:
    """Location of the innermost user frame of an exception's traceback."""
    where = UNKNOWN
    while tb is not None:
        code = tb.tb_frame.f_code
        if not _skipped(code.co_filename):
            where = SourceLocation(code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return where


def warn_at_user_line(message: str, category: type[Warning]) -> None:
    """Warn as if from the innermost user frame: a fixed stacklevel would point at tracejit's own
    line, since how deep inside tracejit and torch a warning is raised depends on the caller."""
    where = user_location(2)
    warnings.warn_explicit(message, category, where.filename or "<unknown>", where.line,
                           module=os.path.splitext(os.path.basename(where.filename))[0] or "<unknown>")
