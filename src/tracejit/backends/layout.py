"""Iteration spaces of fused kernels: broadcasting, loop order and dimension merging.

A kernel walks one shape and addresses every tensor through its own strides in that shape (a
broadcast dimension has stride 0). Before rendering, the space is simplified the way PyTorch's
TensorIterator does: the loop order follows the memory order of the first stored tensor, size-1
dimensions disappear, and neighbouring dimensions that every tensor walks contiguously merge, so
a contiguous elementwise op becomes one flat loop the C compiler can vectorize.
"""

from __future__ import annotations

from ..record.record import TensorMeta


def lane_strides(meta: TensorMeta, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """`meta`'s strides when broadcast to `shape` (0 on broadcast dims); None if it does not broadcast."""
    if len(meta.shape) > len(shape):
        return None
    pad = len(shape) - len(meta.shape)
    strides = [0] * pad
    for size, stride, full in zip(meta.shape, meta.stride, shape[pad:]):
        if size == full:
            strides.append(stride if full != 1 else 0)
        elif size == 1:
            strides.append(0)
        else:
            return None
    return tuple(strides)


def coalesce(shape: tuple[int, ...], strides: list[tuple[int, ...]], order: int = 0
             ) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Simplify an iteration space; `strides[order]` (the first store) decides the loop order."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    leader = strides[order] if strides else ()
    # outermost first: decreasing stride of the leading tensor; ties keep the logical order
    dims.sort(key=lambda d: -abs(leader[d]) if leader else 0)
    sizes = [shape[d] for d in dims]
    walked = [[s[d] for d in dims] for s in strides]
    merged_sizes: list[int] = []
    merged: list[list[int]] = [[] for _ in strides]
    for position, size in enumerate(sizes):
        if merged_sizes and all(w[position] * size == m[-1] for w, m in zip(walked, merged)):
            # the previous (outer) dim steps exactly over this one in every tensor: one dim
            merged_sizes[-1] *= size
            for w, m in zip(walked, merged):
                m[-1] = w[position]
            continue
        merged_sizes.append(size)
        for w, m in zip(walked, merged):
            m.append(w[position])
    return tuple(merged_sizes), [tuple(m) for m in merged]
