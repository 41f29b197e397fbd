"""Shape and dtype of each CALL node's results, as the op itself says: run on fake tensors.

A fake tensor (torch's FakeTensorMode) has a shape, strides, a dtype and a device but no data, so
running an aten op on fake inputs of the graph's input values gives the shapes and dtypes its
results must have (type promotion of elementwise ops, the sizes of views and reductions) at the
cost of a dispatch: no memory, no kernel, no random numbers drawn. verify() compares them with
the values the node produces. Loading a file checks the same way (serialize/validate.py).

Not checked: ops without a shape function or whose shapes depend on data (`nonzero`, `item`);
results that are the node's own input (an in-place op returning what it wrote); and empty
results where the op's shape function gives a full one or the reverse (batch norm's saved
statistics in eval mode, the mkldnn RNN workspace: scratch results only the kernel sizes).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..record.autocast_keys import outside_autocast
from ..record.calls import rebuild_call
from .graph import Graph, Node

# (target, statics, scalars, input metas, default dtype) -> ((shape, dtype) or None per result), or None when the
# op cannot run on fake tensors; shared by every graph, as most nodes recur from pass to pass
_EXPECTED: dict[tuple, tuple | None] = {}
_MAX_CACHED = 8192
_CHECKED_KINDS = ("tensor", "tuple", "list")
_MODE: list[FakeTensorMode] = []  # made on first use: importing tracejit creates no fake mode
# Normalizations whose CPU kernels keep the statistics (mean, rstd: results 1 and 2) in float32 for
# a reduced-precision input with float32 weights (LayerNorm, BatchNorm under bf16 autocast), where the meta
# kernels say the input's dtype: the kernel is right
MIXED_PRECISION_STATISTICS = frozenset({
    torch.ops.aten.native_layer_norm.default, torch.ops.aten.native_group_norm.default,
    torch.ops.aten.native_batch_norm.default, torch.ops.aten._native_batch_norm_legit.default,
    torch.ops.aten._native_batch_norm_legit.no_stats, torch.ops.aten._native_batch_norm_legit_no_training.default})
REDUCED_PRECISION = (torch.bfloat16, torch.float16)


def meta_mismatches(graph: Graph, node: Node) -> list[str]:
    """What is wrong with the shapes and dtypes of the values `node` produces; [] when they agree
    or cannot be checked."""
    if not _checkable(node):
        return []
    expected = _expected(node, [graph.values[v].meta for v in node.inputs])
    if expected is None:
        return []
    if len(expected) != len(node.outputs):
        return [f"produces {len(node.outputs)} results, but {node.name} returns {len(expected)}"]
    read_handles = {graph.values[v].handle for v in node.inputs}
    problems = []
    for index, (vid, want) in enumerate(zip(node.outputs, expected)):
        if vid is None or want is None or graph.values[vid].handle in read_handles:
            continue
        meta = graph.values[vid].meta
        if (0 in meta.shape) != (0 in want[0]):
            continue  # a scratch result only the kernel sizes
        if tuple(meta.shape) == want[0] and mispredicted_dtype(node.target, index, meta.dtype, want[1]):
            continue
        if (tuple(meta.shape), meta.dtype) != want:
            problems.append(f"result {index} is {_text(meta.dtype, meta.shape)}, but {node.name} of its inputs "
                            f"gives {_text(want[1], want[0])}")
    return problems


def mispredicted_dtype(target: object, index: int, dtype: torch.dtype, predicted: torch.dtype) -> bool:
    """True where the kernel's result `index` has `dtype` and the meta kernel says `predicted`, a
    known disagreement in which the kernel is right (MIXED_PRECISION_STATISTICS)."""
    return (target in MIXED_PRECISION_STATISTICS and index > 0 and dtype == torch.float32
            and predicted in REDUCED_PRECISION)


def _text(dtype: torch.dtype, shape: tuple) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def _checkable(node: Node) -> bool:
    return node.out_kind in _CHECKED_KINDS and isinstance(node.target, torch._ops.OpOverload)


def _expected(node: Node, inputs: list) -> tuple | None:
    try:
        key = (node.target, node.statics, tuple((type(s), s) for s in node.scalars),
               tuple((m.shape, m.stride, m.dtype, m.device) for m in inputs),
               torch.get_default_dtype())  # factory ops without a dtype (`torch.ones(4)`) follow it
        hash(key)
    except TypeError:  # an unhashable static (a list): compute without caching
        return _run_faked(node, inputs)
    if key not in _EXPECTED:
        if len(_EXPECTED) >= _MAX_CACHED:
            _EXPECTED.clear()
        _EXPECTED[key] = _run_faked(node, inputs)
    return _EXPECTED[key]


def _run_faked(node: Node, inputs: list) -> tuple | None:
    if not _MODE:
        _MODE.append(FakeTensorMode(allow_fallback_kernels=False))
    try:
        with _MODE[0], torch.no_grad(), outside_autocast():  # the recorded ops, as autocast left them
            tensors = [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device) for m in inputs]
            args, kwargs = rebuild_call(node.statics, tensors, list(node.scalars))
            result = node.target(*args, **kwargs)
    except Exception:  # no shape function, data-dependent, or arguments only a real call takes
        return None
    results = [result] if isinstance(result, torch.Tensor) else result
    if not isinstance(results, (tuple, list)):
        return None
    return tuple((tuple(r.shape), r.dtype) if isinstance(r, torch.Tensor) else None for r in results)
