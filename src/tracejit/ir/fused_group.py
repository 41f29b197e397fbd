"""The target of a FUSED node (passes/group.py forms the groups, backends compile them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FusedGroup:
    """What a backend compiles into one kernel: a name and the iteration space of its members."""

    name: str
    shape: tuple[int, ...]  # iteration space of the first lane
    lanes: int = 1  # list length of `_foreach_` members; 1 for plain groups
    # a row group (passes/fuse_reduce.py): the other shapes its members compute, one value per row
    # (layer norm's mean and rstd, a sum over the row), per column, or one in all (a loss)
    rows: tuple[tuple[int, ...], ...] = ()
    # "elementwise" (passes/group.py, fuse_reduce.py) or "linear": a chain of small matrix
    # products (passes/chain_linear.py), `shape` its result's
    kind: str = "elementwise"
