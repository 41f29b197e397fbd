"""Typed reads of parsed JSON: each read names where in the document a wrong value is.

A loader that indexes untrusted JSON directly fails with KeyError or TypeError on the first odd
file; these helpers fail with a `LoadError` saying which field was expected to hold what.
"""

from __future__ import annotations

from typing import Any

from ..errors import LoadError
from .limits import MAX_NAME_LENGTH, MAX_NDIM, MAX_NUMEL


def describe(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def mapping(value: Any, where: str, keys: set[str], optional: set[str] = frozenset()) -> dict:
    """A JSON object with exactly `keys`, plus any of `optional`."""
    if not isinstance(value, dict):
        raise LoadError(f"{where}: expected an object, got {describe(value)}")
    missing = keys - value.keys()
    unknown = value.keys() - keys - optional
    if missing:
        raise LoadError(f"{where}: missing field {min(missing)!r}")
    if unknown:
        raise LoadError(f"{where}: unknown field {min(unknown)!r}")
    return value


def array(value: Any, where: str, max_length: int) -> list:
    if not isinstance(value, list):
        raise LoadError(f"{where}: expected a list, got {describe(value)}")
    if len(value) > max_length:
        raise LoadError(f"{where}: {len(value)} entries, more than the limit of {max_length}")
    return value


def integer(value: Any, where: str, low: int = 0, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f">= {low}"
        raise LoadError(f"{where}: expected an int {bound}, got {describe(value)}")
    return value


def name(value: Any, where: str) -> str:
    """A printable string of bounded length (names end up on terminals and in profiles)."""
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_LENGTH or not value.isprintable():
        raise LoadError(f"{where}: expected a printable name of 1 to {MAX_NAME_LENGTH} characters, "
                        f"got {describe(value)}")
    return value


def optional_name(value: Any, where: str) -> str | None:
    return None if value is None else name(value, where)


def shape(value: Any, where: str) -> tuple[int, ...]:
    dims = tuple(integer(d, f"{where}[{i}]", 0, MAX_NUMEL) for i, d in enumerate(array(value, where, MAX_NDIM)))
    if numel(dims) > MAX_NUMEL:
        raise LoadError(f"{where}: shape {list(dims)} has {numel(dims)} elements, more than the limit of {MAX_NUMEL}")
    return dims


def strides(value: Any, where: str, dims: tuple[int, ...]) -> tuple[int, ...]:
    steps = tuple(integer(s, f"{where}[{i}]", 0, MAX_NUMEL) for i, s in enumerate(array(value, where, MAX_NDIM)))
    if len(steps) != len(dims):
        raise LoadError(f"{where}: {len(steps)} strides for a shape of {len(dims)} dimensions")
    if extent(dims, steps) > MAX_NUMEL:
        raise LoadError(f"{where}: strides {list(steps)} span more than {MAX_NUMEL} elements")
    return steps


def numel(dims: tuple[int, ...]) -> int:
    count = 1
    for d in dims:
        count *= d
    return count


def extent(dims: tuple[int, ...], steps: tuple[int, ...]) -> int:
    """Elements of storage a tensor of this shape and these strides spans (0 when it is empty)."""
    if any(d == 0 for d in dims):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(dims, steps))


def may_overlap(dims: tuple[int, ...], steps: tuple[int, ...]) -> bool:
    """Whether two elements of a tensor of this shape and these strides may share memory (an
    expanded tensor: stride 0 along a dim of size > 1). False is certain; True may be too careful
    for an unusual interleaved layout."""
    reach = 0  # elements spanned by the dims of smaller stride
    for size, step in sorted(((d, abs(s)) for d, s in zip(dims, steps) if d > 1), key=lambda p: p[1]):
        if step <= reach:
            return True
        reach += (size - 1) * step
    return False


def byte_span(dims: tuple[int, ...], steps: tuple[int, ...], itemsize: int) -> tuple[int, int] | None:
    """(first, end) byte of the memory a tensor's elements occupy, relative to its first element
    (negative strides reach below it); None for a tensor without elements."""
    if any(d == 0 for d in dims):
        return None
    low = high = 0
    for size, step in zip(dims, steps):
        if step < 0:
            low += (size - 1) * step
        else:
            high += (size - 1) * step
    return low * itemsize, (high + 1) * itemsize
