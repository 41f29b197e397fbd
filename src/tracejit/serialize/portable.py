"""The portable graph: what a dump file holds, between the compiler's `Graph` and the bytes.

A `PortableGraph` is a host-free graph reduced to what runs without the Python function: the
inputs (named, with the signature they were traced with), aten ops over numbered values, the
constants (weights) as tensors, the outputs, and the embedded test cases. `from_graph` makes
one from an optimized `Graph` (dump), `to_graph` turns one back into a `Graph` that the local
pipeline compiles (load).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ir.graph import INPUT_OPS, Graph, Node, Op, Value
from ..ir.printer import value_name
from ..record.record import Record, TensorMeta
from ..record.source import SourceLocation


@dataclass(frozen=True)
class PortableInput:
    name: str
    meta: TensorMeta  # the signature the graph was traced with
    value: int | None  # the value it binds; None when no op reads it
    # where its elements start in their storage, as traced; 0 unless the graph takes absolute
    # storage offsets (uses_storage_offsets), the only graphs in which it matters
    storage_offset: int = 0


@dataclass(frozen=True)
class PortableOutput:
    name: str | None
    value: int


@dataclass(frozen=True)
class PortableConstant:
    value: int
    tensor: torch.Tensor
    name: str | None  # the parameter's name (keep_param_name), else None


@dataclass(frozen=True)
class PortableOp:
    target: torch._ops.OpOverload
    inputs: tuple[int, ...]
    outputs: tuple[int | None, ...]
    writes: tuple[int, ...]
    statics: tuple
    scalars: tuple
    out_kind: str
    source: SourceLocation | None = None  # the user line that ran it (keep_opr_name), else None

    @property
    def name(self) -> str:
        return str(self.target)


@dataclass
class TestCase:
    inputs: dict[str, torch.Tensor]
    outputs: list[torch.Tensor] | None  # reference outputs; None when dumped with no_assert=True
    maxerr: float


@dataclass
class PortableGraph:
    name: str
    values: list[Value]
    inputs: list[PortableInput]
    outputs: list[PortableOutput]
    constants: list[PortableConstant]
    ops: list[PortableOp]
    value_names: dict[int, str] = field(default_factory=dict)  # value id -> name (keep_var_name=2)
    testcases: list[TestCase] = field(default_factory=list)
    user_info: Any = None
    metadata: dict | None = None
    # torch's default dtype when the graph was traced: factory ops stored without a dtype
    # (`torch.full`, `torch.arange(4.)`) and Python-number promotion follow it; see default_dtype()
    default_dtype: torch.dtype = torch.float32

    @property
    def num_handles(self) -> int:
        return 1 + max((max(v.handle, v.root) for v in self.values), default=-1)

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for op in self.ops:
            counts[op.name] = counts.get(op.name, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    def parameter_numel(self) -> int:
        return sum(c.tensor.numel() for c in self.constants)


# the default dtypes torch.set_default_dtype accepts (and a file may record)
DEFAULT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Run under torch's default dtype `dtype` (a graph's recorded one): set only when it differs
    from the caller's, restored after. torch's default dtype is process-wide, so threads calling
    graphs of different default dtypes at the same time see each other's."""
    previous = torch.get_default_dtype()
    if previous == dtype:
        yield
        return
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class _Renumber:
    """Compact value ids and handles, in order of first appearance."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.ids: dict[int, int] = {}
        self.handles: dict[int, int] = {}
        self.values: list[Value] = []
        self.names: dict[int, str] = {}

    def __call__(self, vid: int | None) -> int | None:
        if vid is None:
            return None
        if vid not in self.ids:
            old = self.graph.values[vid]
            new = Value(len(self.values), self._handle(old.handle), old.version, old.meta, self._handle(old.root))
            self.ids[vid] = new.id
            self.values.append(new)
            self.names[new.id] = value_name(old)
        return self.ids[vid]

    def _handle(self, handle: int) -> int:
        return self.handles.setdefault(handle, len(self.handles))


def from_graph(graph: Graph, record: Record, handles: list[int], input_names: list[str],
               output_names: list[str | None], keep_opr_name: bool, keep_param_name: bool, keep_var_name: int,
               externals: dict[int, torch.Tensor]) -> PortableGraph:
    """The portable form of an optimized host-free graph of `record` whose inputs are `handles`.
    `externals` are the tensors of external handles the function returned unread (they become
    constants). Raises ValueError naming what a dump cannot hold."""
    renumber = _Renumber(graph)
    input_value = {graph.values[n.outputs[0]].handle: n.outputs[0] for n in graph.nodes if n.op in (Op.ARG, Op.KWARG)}
    input_ids = [renumber(input_value.get(h)) for h in handles]
    constants, ops = [], []
    for node in graph.nodes:
        if node.op is Op.EXTERNAL:
            handle = graph.values[node.outputs[0]].handle
            tensor = externals.get(handle)
            if tensor is None or tuple(tensor.stride()) != graph.values[node.outputs[0]].meta.stride:
                raise ValueError(f"dump(): the graph returns the external tensor {node.input_name!r}, which is no "
                                 f"longer alive (or changed its layout) since the call; call the function "
                                 f"again, then dump")
            constants.append(PortableConstant(renumber(node.outputs[0]), tensor, node.input_name
                                              if keep_param_name else None))
            continue
        if node.op is Op.CONST:
            tensor = graph.constants[graph.values[node.outputs[0]].handle]
            name = _constant_name(record, graph.values[node.outputs[0]].handle, node.input_name)
            constants.append(PortableConstant(renumber(node.outputs[0]), tensor.detach(),
                                              name if keep_param_name else None))
        elif node.op is Op.CALL:
            ops.append(PortableOp(node.target, tuple(renumber(v) for v in node.inputs),
                                  tuple(renumber(v) for v in node.outputs), tuple(renumber(v) for v in node.writes),
                                  node.statics, tuple(node.scalars), node.out_kind,
                                  _short_source(node.source) if keep_opr_name else None))
        elif node.op not in INPUT_OPS:
            raise ValueError(f"dump(): cannot store the {node.op.value} node {node.name}")
    absolute = uses_storage_offsets(ops)
    inputs = [PortableInput(name, record.tensors[h].meta, vid, record.tensors[h].storage_offset if absolute else 0)
              for name, h, vid in zip(input_names, handles, input_ids)]
    outputs = [PortableOutput(name, renumber(v)) for name, v in zip(output_names, graph.outputs)]
    names = renumber.names if keep_var_name >= 2 else {}
    return PortableGraph(graph.function_name, renumber.values, inputs, outputs, constants, ops, names)


def uses_storage_offsets(ops: list[PortableOp]) -> bool:
    """Whether an op takes a storage offset (`as_strided(x, size, stride, storage_offset)`): an
    absolute position in its input's storage, which follows the offset the input was traced with."""
    return any(any(a.name == "storage_offset" for a in op.target._schema.arguments) for op in ops)


def _constant_name(record: Record, handle: int, name: str, depth: int = 0) -> str:
    """A folded constant is named after what it was computed from: `t(model.fc.weight)`."""
    if handle >= len(record.tensors) or depth > 8:  # a constant a pass made (it names it) / a long chain
        return name
    info = record.tensors[handle]
    if info.producer is None:
        return info.name
    op = record.ops[info.producer]
    arguments = ", ".join(_constant_name(record, h, "?", depth + 1) for h in op.inputs)
    return f"{op.op._schema.name.split('::')[-1]}({arguments})"


def _short_source(source: SourceLocation | None) -> SourceLocation | None:
    """The line without the directory: a dump does not carry the author's file system layout."""
    if source is None or not source.filename:
        return None
    return SourceLocation(source.filename.replace("\\", "/").rsplit("/", 1)[-1], source.line, source.function)


def to_graph(portable: PortableGraph) -> Graph:
    """The `Graph` the local pipeline compiles: inputs and constants first, then the ops in order."""
    values = portable.values
    nodes = [Node(Op.ARG, None, (), (i.value,), input_name=i.name) for i in portable.inputs
             if i.value is not None]
    nodes += [Node(Op.CONST, None, (), (c.value,), input_name=c.name or f"constant {index}")
              for index, c in enumerate(portable.constants)]
    scalar_base = 0
    for position, op in enumerate(portable.ops):
        nodes.append(Node(Op.CALL, op.target, op.inputs, op.outputs, writes=op.writes, positions=(position,),
                          source=op.source, statics=op.statics, scalars=op.scalars, out_kind=op.out_kind,
                          scalar_base=scalar_base, input_metas=tuple(values[v].meta for v in op.inputs)))
        scalar_base += len(op.scalars)
    return Graph(
        function_name=portable.name,
        values=tuple(values),
        nodes=tuple(nodes),
        outputs=tuple(o.value for o in portable.outputs),
        escaped=frozenset(),
        host_visible=False,
        num_handles=portable.num_handles,
        capture_as_const=True,
        provenance="load",
        constants={values[c.value].handle: c.tensor for c in portable.constants},
        # a constant the program writes (a literal updated in place) starts every call from a copy
        fresh=_written_constants(portable),
    )


def _written_constants(portable: PortableGraph) -> frozenset[int]:
    """Handles of the constants whose storage an op writes (directly, or through a view)."""
    values = portable.values
    written = {values[v].root for op in portable.ops for v in op.writes}
    return frozenset(values[c.value].handle for c in portable.constants
                     if values[c.value].handle in written or values[c.value].root in written)
