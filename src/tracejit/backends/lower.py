"""FUSED node -> KernelSpec: the backend-neutral description of one fused kernel.

A kernel runs one element DAG (see expr.py) over one or more *lanes*. A plain group has one lane,
its iteration space the group's shape. A group of `_foreach_*` ops has one lane per list element
(one per parameter of an optimizer step), all computed by one launch: the multi-tensor kernel.
Every lane computes the same DAG; only pointers, sizes and per-lane scalars differ.

Shapes and strides are static (a trace belongs to one input signature), so the spec bakes them in;
the runtime checks the strides of the tensors it is handed and falls back to aten when they differ.
`lower_fused` raises `Unsupported` for anything a kernel cannot express; the group then runs op by op.

In-place members write into their target: when the target's storage comes from outside the group,
the final value of that storage is stored into it (a true in-place update); when the group itself
created it, the write is just the next value of a temporary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Promotion
from torch._prims_common import elementwise_dtypes

from ..ir.graph import Graph, Node
from ..record.calls import rebuild_call
from ..record.record import TensorMeta
from .expr import Compute, Expr, ExprBuilder, Ref, ScalarArg, opmath
from .layout import coalesce, lane_strides
from .optable import Unsupported, entry_for


@dataclass(frozen=True)
class Lane:
    shape: tuple[int, ...]  # iteration space, size-1 dims dropped and contiguous dims merged
    loads: tuple[tuple[int, tuple[int, ...]], ...]  # per operand: (index into node.inputs, strides)
    stores: tuple[tuple[int, tuple[int, ...]], ...]  # per store: (target, strides); see KernelSpec.targets
    scalars: tuple[int, ...]  # per kernel scalar: its index in the call's flat dynamic-scalar list

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True)
class KernelSpec:
    """Everything a backend needs to render and launch one fused kernel.

    A call writes *targets*: first the tensors it allocates (`allocations`), then the node inputs
    it updates in place (`written_inputs`, positions in node.inputs). `Lane.stores` index them.
    """

    name: str
    exprs: tuple[Expr, ...]
    load_dtypes: tuple[torch.dtype, ...]  # per operand (storage type)
    store_exprs: tuple[tuple[int, torch.dtype], ...]  # per store: expression index, storage type
    scalar_types: tuple[type, ...]  # per kernel scalar: float or int
    lanes: tuple[Lane, ...]
    allocations: tuple[TensorMeta, ...]  # tensors a call allocates (unless the caller hands them in)
    written_inputs: tuple[int, ...]  # positions in node.inputs written in place
    output_sources: tuple[tuple[str, int], ...]  # per node output: ("new", allocation) or ("input", position)
    input_metas: tuple[TensorMeta, ...]  # aligned with node.inputs: the layouts the lanes assume
    device: torch.device
    # a row kernel (jit_fuse_reduce, rows.py): the reduction over the last dim its "row" leaf stands for
    row: Any = None

    @property
    def numel(self) -> int:
        return sum(lane.numel for lane in self.lanes)


@dataclass
class _WriteRole:
    """One storage from outside the group that a member writes: per lane (input position, value id)."""

    values: list[tuple[int, int]]
    element: Ref


def live_exprs(spec: KernelSpec) -> set[int]:
    """Indices of the expressions some store needs (lowering may leave others, e.g. unused loads)."""
    needed: set[int] = set()
    stack = [ref for ref, _ in spec.store_exprs]
    while stack:
        index = stack.pop()
        if index not in needed:
            needed.add(index)
            stack.extend(spec.exprs[index].args)
    return needed


def lower_fused(graph: Graph, node: Node) -> KernelSpec:
    """The kernel of a FUSED node; raises Unsupported when some member cannot be expressed."""
    from .rows import is_row_op, lower_row

    if node.target.kind != "elementwise":
        raise Unsupported(f"{node.name} is a {node.target.kind} group, not elementwise")
    if any(is_row_op(m.target) for m in node.members):
        return lower_row(graph, node)
    return _Lowering(graph, node).run()


def lane_count(node: Node) -> int:
    """How many lanes a member op has: its list length for `_foreach_*` ops, else 1."""
    found = entry_for(node.target)
    if found is None or not found[1]:
        return 1
    first = node.statics[0]
    return len(first) if isinstance(first, tuple) else 1


# ops whose number operand (`x + 0.1`, `x < 0.1`) eager wraps as a tensor of the common type
_NUMBER_OPERANDS = frozenset({"add", "sub", "rsub", "eq", "ne", "lt", "le", "gt", "ge"})


class _Tensor:
    __slots__ = ("value",)

    def __init__(self, value: int):
        self.value = value


class _Scalar:
    __slots__ = ("index", "type")

    def __init__(self, index: int, type_: type):
        self.index = index
        self.type = type_


class _Lowering:
    merge_dims = True  # coalesce the iteration space (row kernels keep the last dim apart)

    def __init__(self, graph: Graph, node: Node):
        self.graph = graph
        self.node = node
        self.lanes = lane_count(node.members[0])
        self.builder = ExprBuilder()
        self.env: list[dict[int, Ref]] = [{} for _ in range(self.lanes)]  # per lane: value id -> element
        self.operands: list[tuple[int, ...]] = []  # per operand: value id per lane
        self.scalars: list[tuple[int, ...]] = []  # per kernel scalar: flat scalar index per lane
        self.scalar_types: list[type] = []
        self.input_index = {v: i for i, v in enumerate(node.inputs)}
        self.produced: list[tuple[Ref, tuple[int, ...]]] = []  # computed values: element, value id per lane
        self.write_roles: list[_WriteRole] = []
        self.role_of_root: dict[int, _WriteRole] = {}  # lane-0 root handle -> its write role

    def run(self) -> KernelSpec:
        for member in self.node.members:
            if lane_count(member) != self.lanes:
                raise Unsupported("members with different list lengths")
            self._lower_member(member)
        return self._spec()

    # -- members ----------------------------------------------------------------------------------

    def _lower_member(self, member: Node) -> None:
        found = entry_for(member.target)
        if found is None:
            raise Unsupported(f"{member.target} is not in the op table")
        entry, foreach = found
        base = member.scalar_base
        scalars = [_Scalar(base + i, type(s)) for i, s in enumerate(member.scalars)]
        args, kwargs = rebuild_call(member.statics, [_Tensor(v) for v in member.inputs], scalars)
        values = _bind_schema(member.target, args, kwargs)
        per_lane = [[_lane_item(v, j) for v in values] if foreach else values for j in range(self.lanes)]
        operands = [self._across_lanes([lane[k] for lane in per_lane]) for k in range(len(values))]
        compute, common = self._compute_type(entry, per_lane[0])
        if any(self._compute_type(entry, lane) != (compute, common) for lane in per_lane[1:]):
            # one kernel computes every lane in one type (a float32 lane and a float64 lane of one
            # `_foreach_` list promote differently)
            raise Unsupported("lanes that compute in different types")
        if common in (torch.float16, torch.bfloat16):
            operands = self._rounded_to_common(entry, operands, per_lane[0], common)
        element = entry.lower(Compute(self.builder, compute, self._device_type(member)), *operands)
        written = self._written_per_lane(member, per_lane)
        if written is None:
            outputs = [v for v in member.outputs if v is not None]
            vids = tuple(outputs[j] if foreach else outputs[0] for j in range(self.lanes))
        else:
            vids = tuple(after for _, after in written)
        _same_dtype_across_lanes(self.graph, vids, "results")
        element = self.builder.cast(element, self.graph.values[vids[0]].meta.dtype)
        for j, vid in enumerate(vids):
            self.env[j][vid] = element
        if written is None or not self._write_storage(written, element):
            self.produced.append((element, vids))

    def _device_type(self, member: Node) -> str:
        vid = next(v for v in (*member.outputs, *member.inputs) if v is not None)
        return self.graph.values[vid].meta.device.type

    def _across_lanes(self, items: list):
        """The element for one argument position, which every lane must agree on."""
        first = items[0]
        if isinstance(first, _Tensor):
            if not all(isinstance(i, _Tensor) for i in items):
                raise Unsupported("lanes disagree on an argument")
            known = [self.env[j].get(i.value) for j, i in enumerate(items)]
            if all(k is not None for k in known):
                if len(set(known)) != 1:
                    raise Unsupported("lanes read different elements at one argument")
                return known[0]
            if any(k is not None for k in known) or any(i.value not in self.input_index for i in items):
                raise Unsupported("a value read through an alias of a value the group computes")
            _same_dtype_across_lanes(self.graph, [i.value for i in items], "operands")
            self.operands.append(tuple(i.value for i in items))
            ref = self.builder.emit("load", (), self.graph.values[first.value].meta.dtype, len(self.operands) - 1)
            for j, item in enumerate(items):
                self.env[j][item.value] = ref
            return ref
        if isinstance(first, _Scalar):
            self.scalars.append(tuple(i.index for i in items))
            self.scalar_types.append(first.type)
            return ScalarArg(len(self.scalars) - 1, first.type)
        if isinstance(first, list):
            raise Unsupported("a list argument outside a multi-tensor op")
        return first

    def _rounded_to_common(self, entry, operands: list, items: list, common: torch.dtype) -> list:
        """Operands of a half-type op rounded to that type before it computes in float32, as eager
        converts them (an int32 or float32 element, the number in `x + 0.1` or `x < 0.1`). Not
        rounded: the op's parameters (`alpha`, a slope, a weight), masks, and the one-element second
        operand of `mul` and `div` (a number, a 0-d tensor), which eager's CPU kernels take at
        full precision."""
        positions = entry.promote_args if entry.promote_args is not None else range(len(operands))
        rounded = list(operands)
        for k in positions:
            operand, item = operands[k], items[k]
            if entry.name in ("mul", "div") and k == 1 and self._one_element(item):
                continue
            if isinstance(operand, ScalarArg) and k == 1 and entry.name in _NUMBER_OPERANDS:
                raw = self.builder.emit("scalar", (), torch.float64 if operand.type is float else torch.int64,
                                        operand.index)
                rounded[k] = self.builder.cast(raw, common)
            elif isinstance(operand, Ref) and self.builder.dtype(operand) not in (common, torch.bool):
                rounded[k] = self.builder.cast(operand, common)
        return rounded

    def _one_element(self, item) -> bool:
        if isinstance(item, _Scalar):
            return True
        return isinstance(item, _Tensor) and math.prod(self.graph.values[item.value].meta.shape) == 1

    def _compute_type(self, entry, operands: list) -> tuple[torch.dtype, torch.dtype]:
        """The type one member computes in and the common type its operands are converted to first,
        by PyTorch's promotion rule (results are cast after)."""
        samples = []
        if entry.promote_args is not None:
            operands = [operands[i] for i in entry.promote_args]
        for item in operands:
            if isinstance(item, _Tensor):
                meta = self.graph.values[item.value].meta
                samples.append(torch.empty(meta.shape, dtype=meta.dtype, device="meta"))
            elif isinstance(item, _Scalar):
                samples.append(1.0 if item.type is float else 1)
        if len(samples) > 1 and any(s.dtype != torch.bool for s in samples if isinstance(s, torch.Tensor)):
            # conditions and masks select; they do not take part in promotion
            samples = [s for s in samples if not (isinstance(s, torch.Tensor) and s.dtype == torch.bool)]
        compute, result = elementwise_dtypes(*samples, type_promotion_kind=entry.promotion)
        if compute.is_complex or result.is_complex:
            raise Unsupported("complex numbers")
        common = result
        if entry.promotion == Promotion.ALWAYS_BOOL:  # a comparison converts to its operands' common type
            common = elementwise_dtypes(*samples, type_promotion_kind=Promotion.DEFAULT)[1]
        return opmath(compute), common

    def _written_per_lane(self, member: Node, per_lane: list) -> list[int] | None:
        """Per lane, the value id of the written target's new version (None for out-of-place ops)."""
        if not member.writes:
            return None
        found = []
        for lane in per_lane:
            target = lane[0]
            if not isinstance(target, _Tensor):
                raise Unsupported("an in-place op whose target is not its first argument")
            handle = self.graph.values[target.value].handle
            new = [w for w in member.writes if self.graph.values[w].handle == handle]
            if len(new) != 1:
                raise Unsupported("an in-place op writing more than its first argument")
            found.append((target.value, new[0]))
        return found

    def _write_storage(self, written: list[tuple[int, int]], element: Ref) -> bool:
        """Note an in-place write; False when the target is a temporary the group created itself."""
        before = written[0][0]
        root = self.graph.values[before].root
        role = self.role_of_root.get(root)
        if before in self.input_index:
            if role is not None:
                raise Unsupported("a storage written twice through different views")
            role = _WriteRole([(self.input_index[b], a) for b, a in written], element)
            self.write_roles.append(role)
            self.role_of_root[root] = role
            return True
        if role is None:
            return False
        role.values = [(position, a) for (position, _), (_, a) in zip(role.values, written)]
        role.element = element
        return True

    # -- the spec ------------------------------------------------------------------------------------

    def _spec(self) -> KernelSpec:
        outputs = set(self.node.outputs)
        allocations: list[TensorMeta] = []
        lane_stores: list[list[tuple[int, int, TensorMeta]]] = [[] for _ in range(self.lanes)]
        store_exprs: list[tuple[int, torch.dtype]] = []
        sources: dict[int, tuple[str, int]] = {}
        for ref, vids in self.produced:
            if not any(v in outputs for v in vids):
                continue  # lives in registers only
            store_exprs.append((ref, self.graph.values[vids[0]].meta.dtype))
            for j, vid in enumerate(vids):
                meta = self.graph.values[vid].meta
                allocations.append(meta)
                lane_stores[j].append((len(allocations) - 1, vid, meta))
                sources[vid] = ("new", len(allocations) - 1)
        written_inputs: list[int] = []
        for role in self.write_roles:
            store_exprs.append((role.element, self.graph.values[role.values[0][1]].meta.dtype))
            for j, (position, vid) in enumerate(role.values):
                if position not in written_inputs:
                    written_inputs.append(position)
                meta = self.graph.values[self.node.inputs[position]].meta
                lane_stores[j].append((-1 - position, vid, meta))
                sources[vid] = ("input", position)
        missing = [v for v in self.node.outputs if v not in sources]
        if missing:
            raise Unsupported(f"outputs {missing} are not the final value of their storage")
        lanes = tuple(self._lane(j, lane_stores[j], len(allocations), written_inputs) for j in range(self.lanes))
        return KernelSpec(
            name=self.node.name,
            exprs=tuple(self.builder.exprs),
            load_dtypes=tuple(self.graph.values[vids[0]].meta.dtype for vids in self.operands),
            store_exprs=tuple(store_exprs),
            scalar_types=tuple(self.scalar_types),
            lanes=lanes,
            allocations=tuple(allocations),
            written_inputs=tuple(written_inputs),
            output_sources=tuple(sources[v] for v in self.node.outputs),
            input_metas=tuple(self.graph.values[v].meta for v in self.node.inputs),
            device=self.graph.values[self.node.outputs[0] if self.node.outputs else self.node.inputs[0]].meta.device,
        )

    def _lane(self, lane: int, stores: list[tuple[int, int, TensorMeta]], allocated: int,
              written_inputs: list[int]) -> Lane:
        if not stores:
            raise Unsupported("a kernel that stores nothing")
        shape = stores[0][2].shape
        if any(meta.shape != shape for _, _, meta in stores):
            raise Unsupported("stores of different shapes in one lane")
        load_metas = [self.graph.values[vids[lane]].meta for vids in self.operands]
        strides = [lane_strides(meta, shape) for meta in load_metas] + [meta.stride for _, _, meta in stores]
        if any(s is None for s in strides):
            raise Unsupported("an operand that does not broadcast to the iteration space")
        if self.merge_dims:
            shape, strides = coalesce(shape, strides, order=len(load_metas))
        loads = tuple((self.input_index[vids[lane]], st) for vids, st in zip(self.operands, strides))
        targets = [t if t >= 0 else allocated + written_inputs.index(-1 - t) for t, _, _ in stores]
        return Lane(shape, loads, tuple(zip(targets, strides[len(load_metas):])),
                    tuple(slots[lane] for slots in self.scalars))


def _same_dtype_across_lanes(graph: Graph, vids, what: str) -> None:
    """A kernel has one element type per operand and per store, which every lane's tensor must have:
    the renderers address every lane's tensor with that one type (a float64 lane read as float32
    gives garbage, a float32 lane written as float64 overruns its buffer)."""
    if len({graph.values[v].meta.dtype for v in vids}) > 1:
        raise Unsupported(f"{what} of different dtypes across the lanes of a multi-tensor op")


def _lane_item(value, lane: int):
    return value[lane] if isinstance(value, list) else value


def _bind_schema(op, args: list, kwargs: dict) -> list:
    """The op's arguments in schema order, defaults filled in."""
    values = []
    for i, argument in enumerate(op._schema.arguments):
        if i < len(args) and not argument.kwarg_only:
            values.append(args[i])
        elif argument.name in kwargs:
            values.append(kwargs[argument.name])
        elif argument.has_default_value():
            values.append(argument.default_value)
        else:
            raise Unsupported(f"{op} is missing argument {argument.name}")
    return values
