"""Record -> Graph: SSA versions from in-place writes, aliasing from view bases."""

from __future__ import annotations

from dataclasses import replace

from ..record.amp import is_inf_check
from ..record.calls import KwargStatic, data_dependent_size, default_dtype_results
from ..record.collectives import is_collective
from ..record.record import Flag, Kind, Record, TensorMeta
from .graph import INPUT_OP_OF_KIND, Graph, Node, Op, Value


class _Versions:
    """Tracks the current version value of every handle while walking the record."""

    def __init__(self, record: Record):
        self.record = record
        self.values: list[Value] = []
        self.current: dict[int, int] = {}  # handle -> value id of its current version
        self.root_version: dict[int, int] = {}
        self.aliases: dict[int, list[int]] = {}  # root handle -> handles sharing its storage
        # handle -> its metadata since an op changed it in place (`transpose_`, `resize_`)
        self.changed_meta: dict[int, TensorMeta] = {}

    def root(self, handle: int) -> int:
        base = self.record.tensors[handle].base
        return handle if base is None else base

    def create(self, handle: int) -> int:
        """First value of a handle: an input, or a fresh output (a view shares its base's version)."""
        root = self.root(handle)
        version = self.root_version.setdefault(root, 0)
        self.aliases.setdefault(root, []).append(handle)
        return self._new_value(handle, version)

    def _new_value(self, handle: int, version: int) -> int:
        meta = self.changed_meta.get(handle, self.record.tensors[handle].meta)
        value = Value(len(self.values), handle, version, meta, self.root(handle))
        self.values.append(value)
        self.current[handle] = value.id
        return value.id

    def change_meta(self, handle: int, meta: TensorMeta) -> None:
        """An in-place op returned `handle` with new metadata: its current and later versions have it."""
        self.changed_meta[handle] = meta
        value = self.values[self.current[handle]]
        self.values[value.id] = replace(value, meta=meta)

    def read(self, handle: int) -> int:
        return self.current[handle]

    def write(self, handles: tuple[int, ...]) -> tuple[int, ...]:
        """New versions of every handle sharing storage with the written ones."""
        roots = {self.root(h) for h in handles}
        new_values = []
        for root in sorted(roots):
            self.root_version[root] += 1
            for alias in self.aliases[root]:
                new_values.append(self._new_value(alias, self.root_version[root]))
        return tuple(new_values)


def build_graph(record: Record, *, host_visible: bool, capture_as_const: bool = False,
                read_exports: frozenset[int] = frozenset()) -> Graph:
    versions = _Versions(record)
    nodes: list[Node] = []
    read_handles = {h for op in record.ops for h in op.inputs}
    for info in record.tensors:
        if info.kind is not Kind.INTERNAL and info.handle in read_handles:
            value = versions.create(info.handle)
            nodes.append(Node(INPUT_OP_OF_KIND[info.kind], None, (), (value,), input_name=info.name))
    scalar_base = 0
    # a factory without `dtype=` made the default dtype of the moment it ran (one the function may
    # set itself): the program, run later, makes that dtype
    pinned = default_dtype_results(record)
    for op in record.ops:
        inputs = tuple(versions.read(h) for h in op.inputs)
        writes = versions.write(op.mutated) if op.mutated else ()
        outputs = tuple(
            None if h is None else (versions.read(h) if h in op.mutated else versions.create(h))
            for h in op.outputs
        )
        for h, meta in zip(op.outputs, op.out_metas):
            if h in op.mutated and meta is not None and meta != versions.values[versions.read(h)].meta:
                versions.change_meta(h, meta)
        nodes.append(Node(Op.CALL, op.op, inputs, outputs, writes=writes, positions=(op.index,), source=op.source,
                          statics=_with_dtype(op.statics, pinned[op.index]) if op.index in pinned else op.statics,
                          scalars=op.scalars, out_kind=op.out_kind, scalar_base=scalar_base,
                          input_metas=tuple(versions.values[v].meta for v in inputs),
                          backward_of=op.backward_of, grad_enabled=op.grad_enabled))
        scalar_base += len(op.scalars)
    for handle in record.output.handles():
        if handle not in versions.current:  # returned without being used by any op
            info = record.tensors[handle]
            nodes.append(Node(INPUT_OP_OF_KIND[info.kind], None, (), (versions.create(handle),),
                              input_name=info.name))
    # A checked call hands the host every value, and a returned tensor's autograd graph that the
    # call leaves alive holds what it saved: fused kernels must store those values too (a
    # BatchNorm row kernel cannot compute its saved mean again: it updates the running statistics)
    kept = Flag.ESCAPED | Flag.SAVED if host_visible else Flag.ESCAPED
    # a literal kept in Python state (`self.buf = torch.tensor(...)`) is left there anew by every call
    escaped = frozenset(i.handle for i in record.tensors if (i.kind is Kind.INTERNAL or i.literal) and i.flags & kept)
    return Graph(
        function_name=record.function_name,
        values=tuple(versions.values),
        nodes=tuple(nodes),
        outputs=tuple(versions.read(h) for h in record.output.handles()),
        escaped=escaped | read_exports,
        read_exports=read_exports,
        host_visible=host_visible,
        num_handles=len(record.tensors),
        capture_as_const=capture_as_const,
        constants=dict(record.constants),
        fresh=frozenset(record.fresh_literals()),
        inference_mode=record.inference_mode,
        inference_flipped=frozenset(op.index for op in record.ops if op.inference != record.inference_mode),
        # torch's C++ reads of a tensor (record/modes.py HIDDEN_READS) need its value as a host read does
        host_reads=frozenset(r.handle for r in (*record.host_reads, *record.hidden_reads) if r.handle is not None),
        reads=tuple(sorted({(r.position, r.handle) for r in (*record.host_reads, *record.hidden_reads)
                            if r.handle is not None})),
        # host code of an excluded block runs before op `position`; other processes meet at a collective;
        # a data-dependent output size may move a checked call to another program (runtime/variants.py);
        # the function enters or leaves torch.inference_mode() (a fused kernel runs in one mode)
        barriers=tuple(sorted({b.position for b in record.excluded_blocks}
                              | {op.index for before, op in zip(record.ops, record.ops[1:]) if op.inference != before.inference}
                              | {op.index for op in record.ops if is_collective(op.op)}
                              | {op.index for op in record.ops if data_dependent_size(op, record)}
                              | {r.position for r in record.host_reads if is_inf_check(r.what)})),
    )



def _with_dtype(statics: tuple, dtype) -> tuple:
    """The call's structure with `dtype=` given."""
    kept = tuple(item for item in statics if not (isinstance(item, KwargStatic) and item.name == "dtype"))
    return (*kept, KwargStatic("dtype", dtype))
