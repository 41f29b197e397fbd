"""Half-precision forms of a portable graph: `enable_ioc16` and `enable_io16xc32` of dump().

ioc16 ("I/O and computation in float16", like `model.half()`): every float32 value, input,
output, weight and dtype argument becomes float16.

io16xc32 ("I/O in float16, computation in float32"): every float32 value is *stored* as float16
(inputs, outputs, weights, the tensors between ops) while each op computes in float32, reading
its inputs through a cast to float32 and writing its results through a cast to float16.
Views work on the stored float16 tensors directly. At load time casts of weights fold into
float32 constants, and the elementwise pass can fuse the casts into neighbouring kernels.

Both leave float64 and non-float values alone. `check_graph` re-checks every op afterwards,
so an op that cannot take float16 is reported at dump time.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..ir.graph import Value
from ..record.calls import is_view_op
from ..record.record import TENSOR, KwargStatic, TensorMeta
from .portable import PortableConstant, PortableGraph, PortableOp

aten = torch.ops.aten


def _half(meta: TensorMeta) -> TensorMeta:
    return replace(meta, dtype=torch.float16) if meta.dtype == torch.float32 else meta


def _half_static(value):
    if value is torch.float32:
        return torch.float16
    if isinstance(value, KwargStatic):
        return KwargStatic(value.name, _half_static(value.value))
    if isinstance(value, tuple):
        return tuple(_half_static(v) for v in value)
    return value


def _with_half_io(graph: PortableGraph, values: list[Value], ops: list[PortableOp]) -> PortableGraph:
    inputs = [replace(i, meta=_half(i.meta)) for i in graph.inputs]
    constants = [PortableConstant(c.value, c.tensor.half() if c.tensor.dtype == torch.float32 else c.tensor, c.name)
                 for c in graph.constants]
    return replace(graph, values=values, inputs=inputs, constants=constants, ops=ops)


def to_half_compute(graph: PortableGraph) -> PortableGraph:
    values = [replace(v, meta=_half(v.meta)) for v in graph.values]
    ops = [replace(op, statics=_half_static(op.statics)) for op in graph.ops]
    return _with_half_io(graph, values, ops)


class _Casts:
    """Appends cast ops and their values to the graph being rewritten."""

    def __init__(self, graph: PortableGraph):
        self.values = [replace(v, meta=_half(v.meta)) for v in graph.values]
        self.next_handle = graph.num_handles
        self.as_float: dict[int, int] = {}  # float16-stored value -> its float32 cast, made once per version

    def cast(self, source: int, dtype: torch.dtype, into: int | None = None) -> PortableOp:
        meta = self.values[source].meta
        sample = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
        result = aten._to_copy.default(sample, dtype=dtype)
        out_meta = TensorMeta(meta.shape, tuple(result.stride()), dtype, meta.device)
        if into is None:
            into = len(self.values)
            self.values.append(Value(into, self.next_handle, 0, out_meta, self.next_handle))
            self.next_handle += 1
        else:
            self.values[into] = replace(self.values[into], meta=out_meta)
        return PortableOp(aten._to_copy.default, (source,), (into,), (), (TENSOR, KwargStatic("dtype", dtype)), (),
                          "tensor")

    def temporary(self, like: int) -> int:
        """A new float32 value of the shape of `like`, for an op's result before its cast."""
        meta = replace(self.values[like].meta, dtype=torch.float32)
        vid = len(self.values)
        self.values.append(Value(vid, self.next_handle, 0, meta, self.next_handle))
        self.next_handle += 1
        return vid


def to_half_storage(graph: PortableGraph) -> PortableGraph:
    stored = {v.id for v in graph.values if v.meta.dtype == torch.float32}  # now float16 in memory
    casts = _Casts(graph)
    ops: list[PortableOp] = []
    for op in graph.ops:
        where = f"enable_io16xc32: {op.name}" + (f" at {op.source}" if op.source else "")
        if op.writes and any(v in stored for v in op.writes):
            raise ValueError(f"dump(): {where} writes in place into a float32 tensor, which would be stored as "
                             f"float16; use the out-of-place form (e.g. nn.ReLU() without inplace=True) or "
                             f"enable_ioc16")
        if (is_view_op(op.target) and all(v in stored for v in op.inputs[:1])
                and all(graph.values[o].root != graph.values[o].handle for o in op.outputs if o is not None)):
            if any(graph.values[o].meta.dtype != graph.values[op.inputs[0]].meta.dtype for o in op.outputs if o is not None):
                raise ValueError(f"dump(): {where} reinterprets float32 data as another dtype")
            ops.append(op)
            continue
        inputs = []
        for vid in op.inputs:
            if vid in stored:
                if vid not in casts.as_float:
                    ops.append(casts.cast(vid, torch.float32))
                    casts.as_float[vid] = ops[-1].outputs[0]
                vid = casts.as_float[vid]
            inputs.append(vid)
        outputs, after = [], []
        for vid in op.outputs:
            if vid is not None and vid in stored:
                temporary = casts.temporary(vid)
                after.append(casts.cast(temporary, torch.float16, into=vid))
                vid = temporary
            outputs.append(vid)
        ops.append(replace(op, inputs=tuple(inputs), outputs=tuple(outputs)))
        ops.extend(after)
    return _with_half_io(graph, casts.values, ops)

