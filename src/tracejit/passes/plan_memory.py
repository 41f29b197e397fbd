"""plan_memory: persistent buffers for intermediates, reused when lifetimes do not overlap.

Before (host-free graph):                 After:
    t5 = aten.addmm.default(t4, t0, t3)       t5 = aten.addmm.default(t4, t0, t3)  # arena[0:4194304]
    t6 = aten.relu.default(t5)                t6 = aten.relu.default(t5)           # arena[4194304:8388608]
    t7 = aten.mm.default(t6, t8)              t7 = aten.mm.default(t6, t8)         # arena[0:4194304]

A planned value is written into its slice of one arena (allocated once, kept across calls)
through the op's `out=` variant instead of a fresh allocation. Planned: dense intermediates of
at least `min_bytes` (and on the CPU at most DEFAULT_MAX_BYTES), produced by an op with an `out=` overload, not views, not returned or
kept in Python state, not touched by a collective, not reshaped in place, not a loss with a
`reduction`. The lifetime of a value ends at the last use of any view of its storage.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from ..ir.graph import INPUT_OPS, Graph, Op
from ..record.calls import RETURNS_INPUT_FOR_SOME_NUMBERS, UNDECLARED_ALIASES, is_view_op
from .analysis import collective_roots, observable_roots

ALIGNMENT = 64
# A fresh CPU tensor costs a malloc and a TensorImpl (~1 us even for 40 bytes), which writing into a
# kept buffer through `out=` saves; CUDA's caching allocator hands out small blocks as fast.
DEFAULT_MIN_BYTES = {"cpu": 0}
OTHER_DEVICES_MIN_BYTES = 1 << 20
# ...and a large one gains nothing (its compute dwarfs a malloc) but holds its arena slice for the
# whole call and between calls, while the ops without an `out=` form (convolution and batch-norm
# backward) allocate on top of the arena: a CNN step at batch 256 peaked at 1.5x eager's memory.
# Left to the allocator, its memory is freed and reused at its last use, as in eager.
DEFAULT_MAX_BYTES = {"cpu": 1 << 20}


def _largest(device_type: str) -> float:
    return DEFAULT_MAX_BYTES.get(device_type, float("inf"))


def plan_memory(graph: Graph, min_bytes: int | None = None, fused: bool = False) -> Graph:
    """`min_bytes`: plan only values at least this large (default: per device, see DEFAULT_MIN_BYTES);
    `fused` (jit_fuse_dimshuffle): the new results of fused kernels too, which their launchers
    write into the buffers they are handed (`Node.buffers`), and the inputs of `_unsafe_view` (a
    reshape of a fresh copy; the record follows its aliasing, so their lifetimes cover its uses)."""
    if graph.host_visible:
        return graph
    lifetimes = storage_lifetimes(graph)
    outliving = observable_roots(graph)  # storage the caller or Python state can still see
    outliving |= _aliased_without_saying(graph, keep_unsafe_view=fused)
    outliving |= collective_roots(graph)
    outliving |= _reshaped_in_place(graph)
    candidates = []
    for index, node in enumerate(graph.nodes):
        if fused and node.op is Op.FUSED:
            for vid in node.outputs:
                value = graph.values[vid] if vid is not None else None
                nbytes = _dense_bytes(value.meta) if value is not None else None
                if (nbytes is not None and nbytes <= _largest(value.meta.device.type)
                        and value.version == 0 and value.root == value.handle
                        and value.root not in outliving and vid not in node.writes
                        and value.meta.device.type == "cpu"):
                    candidates.append((nbytes, index, lifetimes[value.handle], value.handle))
            continue
        if node.op is not Op.CALL or node.out_kind != "tensor" or out_overload(node.target) is None:
            continue
        value = graph.values[node.outputs[0]]
        if any(graph.values[v].handle == value.handle for v in node.inputs):
            continue  # it returned its input itself (`dropout(x, p, train=False)`): see made_by
        nbytes = _dense_bytes(value.meta)
        smallest = min_bytes if min_bytes is not None else DEFAULT_MIN_BYTES.get(value.meta.device.type,
                                                                              OTHER_DEVICES_MIN_BYTES)
        if (nbytes is None or nbytes < smallest or nbytes > _largest(value.meta.device.type)
                or value.root in outliving or _resizes_out(node.target)
                or is_view_op(node.target) or value.root != value.handle):
            continue
        candidates.append((nbytes, index, lifetimes[value.handle], value.handle))
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets: dict[int, tuple[int, int]] = {}
    made_by: dict[int, int] = {}  # planned handle -> the index of the node writing it into its buffer
    for nbytes, index, (first, last), handle in sorted(candidates, key=lambda c: (-c[0], c[1])):
        offset = 0
        for other_offset, other_end, other_first, other_last in sorted(placed):
            overlaps_in_time = not (last < other_first or other_last < first)
            if overlaps_in_time and offset < other_end and other_offset < offset + nbytes:
                offset = _align(other_end)
        placed.append((offset, offset + nbytes, first, last))
        offsets[handle] = (offset, nbytes)
        made_by[handle] = index
    nodes = []
    for index, node in enumerate(graph.nodes):
        if node.op is Op.FUSED:
            buffers = tuple(offsets.get(graph.values[v].handle)
                            if v is not None and made_by.get(graph.values[v].handle) == index else None
                            for v in node.outputs)
            if any(b is not None for b in buffers):
                node = replace(node, buffers=buffers)
        elif node.op is Op.CALL and node.outputs and node.outputs[0] is not None:
            handle = graph.values[node.outputs[0]].handle
            if made_by.get(handle) == index:
                offset, nbytes = offsets[handle]
                node = replace(node, buffer=(offset, nbytes))
        nodes.append(node)
    arena = max((end for _, end, _, _ in placed), default=0)
    return graph.with_nodes(nodes, "plan_memory", arena_bytes=_align(arena))


# UNDECLARED_ALIASES (record/calls.py): the lifetime of their input's memory is not the input
# value's (GRU and LSTM cells split their gates so and keep the pieces for backward), so its buffer
# is left to the allocator. So is the input of a dropout that made a tensor of its own when recorded
# (RETURNS_INPUT_FOR_SOME_NUMBERS): with p == 0 on a later call it returns its input itself.
#
# made_by: an op that returned its input itself when recorded (`dropout(x, p, train=False)`,
# `type_as` or `flatten` that change nothing, under torch.inference_mode(); `lift_fresh`) made a
# second value of the input's handle at version 0 (ir/build.py), whose storage lifetime is the
# input's. Only the op that created the handle writes it into its buffer: the one returning it has
# no `out=` variant, and ran with `out=None` (TypeError: 'NoneType' object is not callable).


def _resizes_out(op) -> bool:
    """Losses with a `reduction` argument: their `out=` variants write the unreduced loss into `out`
    first, resizing a planned scalar to the input's shape (torch warns on every call, and calls
    that resize deprecated), so their results are left to the allocator."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(argument.name == "reduction" for argument in schema.arguments)


def _aliased_without_saying(graph: Graph, keep_unsafe_view: bool = False) -> set[int]:
    roots = set()
    for node in graph.nodes:
        if node.op is Op.CALL and getattr(node.target, "_schema", None) is not None:
            name = node.target._schema.name.split("::")[-1]
            if name in UNDECLARED_ALIASES and not (keep_unsafe_view and name == "_unsafe_view"):
                roots.update(graph.values[v].root for v in node.inputs)
            elif name in RETURNS_INPUT_FOR_SOME_NUMBERS:
                roots.update(graph.values[v].root for v in node.inputs)
    return roots


def _reshaped_in_place(graph: Graph) -> set[int]:
    """Storage of tensors an op reshapes in place (`transpose_`, a GRU's batch_first output): the
    kept `out=` tensor would start the next call with the last call's shape."""
    first, roots = {}, set()
    for value in graph.values:
        if first.setdefault(value.handle, value.meta) != value.meta:
            roots.add(value.root)
    return roots


def _align(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _dense_bytes(meta) -> int | None:
    numel = 1
    for size in meta.shape:
        numel *= size
    if numel == 0 or meta.stride != _contiguous_strides(meta.shape):
        return None
    return numel * torch.empty((), dtype=meta.dtype).element_size()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def storage_lifetimes(graph: Graph) -> dict[int, tuple[int, int]]:
    """root handle -> (index of the node creating it, index of the last node touching its storage)."""
    lifetimes: dict[int, list[int]] = {}
    for index, node in enumerate(graph.nodes):
        if node.op in INPUT_OPS:
            continue
        for vid in (*node.inputs, *(v for v in node.outputs if v is not None), *node.writes):
            root = graph.values[vid].root
            span = lifetimes.setdefault(root, [index, index])
            span[1] = index
    return {root: (span[0], span[1]) for root, span in lifetimes.items()}


@functools.cache
def out_overload(op) -> torch._ops.OpOverload | None:
    """The `out=` overload of a functional aten op: the one taking the same arguments (names, types,
    keyword-only or not) plus a single `out` tensor. Matching names alone is not enough:
    `clamp.Tensor(self, Tensor? min, Tensor? max)` has the names of `clamp.out(self, Scalar? min,
    Scalar? max, *, out)`, whose `out` variant is `clamp.Tensor_out` (issue 15)."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1], None)
    if packet is None:
        return None
    wanted = _signature(op._schema.arguments)
    for name in packet.overloads():
        overload = getattr(packet, name)
        arguments = overload._schema.arguments
        if (arguments and arguments[-1].name == "out" and arguments[-1].is_out
                and _signature(arguments[:-1]) == wanted):
            return overload
    return None


def _signature(arguments) -> list[tuple[str, str, bool]]:
    return [(a.name, str(a.type), a.kwarg_only) for a in arguments]
