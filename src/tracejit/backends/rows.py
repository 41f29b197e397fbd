"""Row kernels (`jit_fuse_reduce`): reductions, with the elementwise ops that feed and consume them,
as one kernel that walks one row at a time.

A row group (passes/fuse_reduce.py forms them) holds row ops (the table below) and elementwise
members that all live in one `RowSpace`: an iteration space whose `reduced` dims a row spans and
whose other (kept) dims enumerate the rows. Lowering reuses the elementwise lowering (lower.py)
and adds a few primitives that only row kernels have:

    rowsum(v)  rowmax(v)  rowargmax(v, p)  the reduction of an element value over the row (one
                                           value per row; rowargmax gives p at the maximum)
    colsum(v)  allsum(v)                   sums over all rows (of an element value: one per column,
                                           of a row value: one in all); known after every row ran
    index(d)                               the iteration index along dim d (an int64)

So every row op is an expression: softmax is `e = exp(x - rowmax(x)); e * (1 / rowsum(e))`. Each
expression has a *level*, derived from what it reads (`plan`): "G" the same for the whole kernel,
"R" one per row, "E" one per element, "P" known after all rows (the results of colsum/allsum and
what is computed from them). A backend renders, per row: the reductions in passes over the row (a
pass computes every reduction whose operands are known), the row values, then one pass that stores
every element value; "P" values are combined from per-chunk partial sums at the end, in a fixed
order (the same numbers for any thread count).

Numerics follow eager's CPU kernels: the row maximum is subtracted before `exp`, sums accumulate in
the tensor's own type (float32 for float32) left to right (eager sums in vector lanes and cascades:
a few ulp of the row's magnitude apart), NaN propagates through maxima, a row of -inf gives NaN;
each op's formula is eager's (cited where it is defined below).

    softmax              e = exp(x - max); y = e * (1 / sum(e))
    log_softmax          y = (x - max) - log(sum(exp(x - max)))
    softmax_backward     dx = y * (g - sum(g * y))
    log_softmax_backward dx = g - exp(y) * sum(g)
    layer_norm           mean = sum(x) / n; rstd = 1 / sqrt(sum((x - mean)^2) / n + eps);
                         y = (x - mean) * rstd [* w] [+ b]  (eager: Welford's moments, a few ulp apart)
    layer_norm_backward  as eager's layer_norm_backward_frame: ds = sum(dy*x*w), db = sum(dy*w),
                         b = (db*mean - ds)*rstd^3/n, c = -b*mean - db*rstd/n, dx = rstd*dy*w + b*x + c;
                         dw = colsum(dy * (rstd*x - rstd*mean)), db = colsum(dy)
    sum, mean, amax      over any dims that include the innermost one; mean = sum / n as eager
    nll_loss_forward     loss = 0 - x[t0] - x[t1] ... (/ count for mean; x[t] selected by an argmax of
                         j == t, exact), rows with t == ignore_index
                         skipped; a target out of range: the C kernel hands the call to aten (which
                         raises eager's IndexError), Triton gives NaN
    nll_loss_backward    dx[r, j] = -(g / total) where j == t[r] (and t[r] != ignore_index), else 0
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..ir.graph import Graph, Node
from ..record.calls import rebuild_call
from ..record.record import TensorMeta
from .expr import Compute, Ref
from .layout import lane_strides
from .lower import KernelSpec, Lane, _bind_schema, _Lowering, _Scalar, _Tensor
from .optable import Unsupported

aten = torch.ops.aten

ROW_DTYPES = (torch.float32, torch.float64)
MAX_ROW = 1 << 20  # elements per row (the Triton renderer takes rows of up to 8192 in one block)
ROW_REDUCTIONS = frozenset({"rowsum", "rowmax", "rowargmax"})
ALL_ROWS = frozenset({"colsum", "allsum"})
ROW_PRIMITIVES = ROW_REDUCTIONS | ALL_ROWS | {"index"}


# -- the space a row kernel walks -------------------------------------------------------------------

@dataclass(frozen=True)
class RowSpace:
    """`element`: the shape of the tensors a row kernel reads and writes element by element;
    `reduced`: its dims one row spans. `window` (pooling) splits the last len(window) dims into
    (outputs, window): the iteration space is `(*lead, *outputs, *window)` and a row is one window."""

    element: tuple[int, ...]
    reduced: tuple[int, ...]
    window: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, ...]:
        """The iteration space."""
        if not self.window:
            return self.element
        w = len(self.window)
        outputs = tuple(s // k for s, k in zip(self.element[-w:], self.window))
        return self.element[:-w] + outputs + self.window

    @property
    def reduced_dims(self) -> tuple[int, ...]:
        """The iteration dims a row spans."""
        if not self.window:
            return self.reduced
        n = len(self.shape)
        return tuple(range(n - len(self.window), n))

    @property
    def kept_dims(self) -> tuple[int, ...]:
        return tuple(d for d in range(len(self.shape)) if d not in self.reduced_dims)

    @property
    def rows(self) -> int:
        return math.prod(self.shape[d] for d in self.kept_dims)

    @property
    def cols(self) -> int:
        return math.prod(self.shape[d] for d in self.reduced_dims)

    def row_shapes(self) -> dict[tuple[int, ...], str]:
        """Shapes of one-value-per-row tensors and their class: "rowk" (keepdim) or "row"."""
        shapes = {tuple(self.shape[d] for d in self.kept_dims): "row"}
        if not self.window:
            shapes[tuple(1 if d in self.reduced else s for d, s in enumerate(self.element))] = "rowk"
        return shapes

    def col_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[d] for d in self.reduced_dims)

    def member_class(self, shape: tuple[int, ...]) -> str | None:
        """How an elementwise member of this output shape iterates: "element", a row class, or None."""
        if tuple(shape) == self.element:
            return "element"
        return self.row_shapes().get(tuple(shape))

    def allowed_shapes(self) -> set[tuple[int, ...]]:
        """Shapes a member of such a group may produce (ir/verify.py)."""
        return {self.element, *self.row_shapes(), self.col_shape(), ()}

    def to_iteration(self, cls: str, strides: tuple[int, ...]) -> tuple[int, ...]:
        """Strides of a tensor of class `cls` (its strides over its own shape) in the iteration space."""
        shape = self.shape
        out = [0] * len(shape)
        if cls == "element":
            if self.window:
                w = len(self.window)
                lead = len(self.element) - w
                out[:lead] = strides[:lead]
                for i, (k, s) in enumerate(zip(self.window, strides[lead:])):
                    out[lead + i] = s * k
                    out[lead + w + i] = s
            else:
                out = list(strides)
        elif cls == "rowk":
            for d in self.kept_dims:
                out[d] = strides[d]
        elif cls == "row":
            for d, s in zip(self.kept_dims, strides):
                out[d] = s
        elif cls == "col":
            for d, s in zip(self.reduced_dims, strides):
                out[d] = s
        elif cls != "global":
            raise ValueError(cls)
        return tuple(0 if size == 1 else s for size, s in zip(shape, out))

    def class_shape(self, cls: str) -> tuple[int, ...]:
        if cls == "element":
            return self.element
        if cls == "global":
            return ()
        if cls == "col":
            return self.col_shape()
        return next(s for s, c in self.row_shapes().items() if c == cls)


# -- the row ops ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RowOp:
    kind: str
    space: Callable[[Graph, Node, list], RowSpace | None]  # None: this call is not a row kernel
    lower: Callable[[_RowLowering, Node, list], None]
    # a group of this op alone is worth a kernel (aten's own reductions are as fast alone)
    alone: bool = True
    # its kernel gives eager's numbers bit for bit (nothing is summed): on at the default opt_level
    exact: bool = False


ROW_OPS: dict[object, RowOp] = {}


def _row_op(op, kind: str, space, alone: bool = True, exact: bool = False):
    def register(lower):
        ROW_OPS[op] = RowOp(kind, space, lower, alone, exact)
        return lower
    return register


def is_row_op(target) -> bool:
    return target in ROW_OPS


def is_exact_row_op(target) -> bool:
    """A row op whose kernel computes eager's numbers bit for bit (max pooling and its backward)."""
    found = ROW_OPS.get(target)
    return found is not None and found.exact


def _meta(graph: Graph, value) -> TensorMeta | None:
    return graph.values[value.value].meta if isinstance(value, _Tensor) else None


def _bound(node: Node) -> list:
    scalars = [_Scalar(node.scalar_base + i, type(s)) for i, s in enumerate(node.scalars)]
    args, kwargs = rebuild_call(node.statics, [_Tensor(v) for v in node.inputs], scalars)
    return _bind_schema(node.target, args, kwargs)


def row_space(graph: Graph, node: Node) -> RowSpace | None:
    """The space a row op's kernel walks, or None when this call cannot be one."""
    found = ROW_OPS.get(node.target)
    if found is None:
        return None
    try:
        return found.space(graph, node, _bound(node))
    except Unsupported:
        return None


def alone_worth_a_kernel(target) -> bool:
    found = ROW_OPS.get(target)
    return found is not None and found.alone


def _float_rows(meta: TensorMeta | None, reduced: tuple[int, ...]) -> bool:
    return (meta is not None and meta.dtype in ROW_DTYPES and len(meta.shape) > 0 and 0 not in meta.shape
            and bool(reduced) and 0 < math.prod(meta.shape[d] for d in reduced) <= MAX_ROW)


def _dim(dim, ndim: int) -> int:
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise Unsupported("a row op over a dim that is not a number")
    return dim % ndim


def _last_dim_space(graph: Graph, x, dim) -> RowSpace:
    meta = _meta(graph, x)
    if meta is None or not meta.shape or _dim(dim, len(meta.shape)) != len(meta.shape) - 1:
        raise Unsupported("a softmax over another dim than the last")
    space = RowSpace(meta.shape, (len(meta.shape) - 1,))
    if not _float_rows(meta, space.reduced):
        raise Unsupported("a softmax of another type than float32/float64")
    return space


def _softmax_space(graph, node, values):
    return _last_dim_space(graph, values[0], values[1])


def _softmax_backward_space(graph, node, values):
    return _last_dim_space(graph, values[0], values[2])


def _layer_norm_space(graph, node, values):
    meta, normalized = _meta(graph, values[0]), values[1]
    if meta is None or not isinstance(normalized, (list, tuple)) or not normalized:
        raise Unsupported("a layer norm of a shape it cannot normalize")
    k = len(normalized)
    if len(meta.shape) < k or list(meta.shape[-k:]) != list(normalized):
        raise Unsupported("a layer norm over other dims than the last")
    reduced = tuple(range(len(meta.shape) - k, len(meta.shape)))
    if not _float_rows(meta, reduced):
        raise Unsupported("a layer norm of another type than float32/float64")
    return RowSpace(meta.shape, reduced)


def _layer_norm_backward_space(graph, node, values):
    return _layer_norm_space(graph, node, [values[1], values[2]])


def _reduce_space(graph, node, values):
    """sum/mean/amax over dims that include the innermost (stride-1) one, not over all dims."""
    meta, dims = _meta(graph, values[0]), values[1]
    if meta is None or not meta.shape:
        raise Unsupported("a reduction of a 0-d tensor")
    if not isinstance(dims, (list, tuple)) or not dims:
        raise Unsupported("a reduction over every dim")  # dim=[] or None reduces everything
    reduced = tuple(sorted({_dim(d, len(meta.shape)) for d in dims}))
    if len(reduced) == len(meta.shape):
        raise Unsupported("a reduction over every dim")
    if len(values) > 3 and values[3] is not None and values[3] != meta.dtype:
        raise Unsupported("a reduction that changes the type")
    innermost = min(range(len(meta.shape)), key=lambda d: (meta.shape[d] == 1, abs(meta.stride[d]), -d))
    if innermost not in reduced or not _float_rows(meta, reduced):
        raise Unsupported("a reduction that does not span the innermost dim, or not float32/float64")
    return RowSpace(meta.shape, reduced)


def _batch_norm_space(graph, node, values, training_at: int):
    """Per channel (dim 1) over every other dim; training only (eval is elementwise)."""
    meta = _meta(graph, values[0])
    if meta is None or len(meta.shape) < 3 or values[training_at] is not True:
        raise Unsupported("a batch norm in eval mode, or of an input without spatial dims")
    reduced = tuple(d for d in range(len(meta.shape)) if d != 1)
    innermost = min(range(len(meta.shape)), key=lambda d: (meta.shape[d] == 1, abs(meta.stride[d]), -d))
    if innermost == 1 or not _float_rows(meta, reduced):
        raise Unsupported("a batch norm of a channels-last input, or not float32/float64")
    return RowSpace(meta.shape, reduced)


def _pool_window(graph, values) -> RowSpace:
    """Max pooling whose windows tile the input: stride = kernel, no padding or dilation."""
    meta, kernel, stride, padding, dilation = (_meta(graph, values[0]), *values[1:5])
    if meta is None or len(meta.shape) not in (3, 4) or meta.dtype not in ROW_DTYPES or 0 in meta.shape:
        raise Unsupported("max pooling of another input than (N, C, H, W) float32/float64")
    kernel = list(kernel) * (2 // len(kernel)) if len(kernel) in (1, 2) else None
    stride = kernel if not stride else list(stride) * (2 // len(stride))
    if (kernel is None or stride != kernel or any(p != 0 for p in padding) or any(d != 1 for d in dilation)
            or any(size % k for size, k in zip(meta.shape[-2:], kernel))):
        raise Unsupported("max pooling with overlapping or partial windows, padding or dilation")
    return RowSpace(meta.shape, (), tuple(kernel))


def _max_pool_space(graph, node, values):
    return _pool_window(graph, values)


def _max_pool_backward_space(graph, node, values):
    return _pool_window(graph, values[1:])


def _nll_space(graph, node, values):
    meta, target, weight = _meta(graph, values[0]), _meta(graph, values[1]), values[2]
    if meta is None or len(meta.shape) != 2 or target is None or target.dtype != torch.int64:
        raise Unsupported("nll_loss of other than (batch, classes) scores and int64 targets")
    if weight is not None:
        raise Unsupported("nll_loss with class weights")
    if not _float_rows(meta, (1,)) or values[3] not in (0, 1, 2) or not isinstance(values[4], int):
        raise Unsupported("nll_loss of another type than float32/float64")
    return RowSpace(meta.shape, (1,))


def _nll_backward_space(graph, node, values):
    return _nll_space(graph, node, [values[1], values[2], values[3], values[4], values[5]])


# -- lowering ---------------------------------------------------------------------------------------

def lower_row(graph: Graph, node: Node) -> KernelSpec:
    return _RowLowering(graph, node).run()


class _RowLowering(_Lowering):
    merge_dims = False

    def __init__(self, graph: Graph, node: Node):
        super().__init__(graph, node)
        spaces = {row_space(graph, m) for m in node.members if is_row_op(m.target)}
        if len(spaces) != 1 or None in spaces:
            raise Unsupported("row ops of different spaces in one kernel")
        self.space: RowSpace = spaces.pop()
        self.reading: str = "element"  # the class of the member being lowered
        self.seen: dict[int, tuple[int, ...]] = {}  # value id -> its strides in the iteration space
        self.operand_strides: list[tuple[int, ...]] = []
        self.checks: list[Ref] = []
        self.pinned: dict[int, str] = {}  # value id -> class, for values whose shape is ambiguous
        self.row_writes: list[tuple[int, int, Ref]] = []  # (position in node.inputs, new version, element)

    # -- operands ---------------------------------------------------------------------------------

    def _iteration_strides(self, vid: int, cls: str) -> tuple[int, ...]:
        meta = self.graph.values[vid].meta
        strides = lane_strides(meta, self.space.class_shape(cls))
        if strides is None:
            raise Unsupported("an operand that does not broadcast to the row space")
        return self.space.to_iteration(cls, strides)

    def _across_lanes(self, items: list):
        first = items[0]
        if not isinstance(first, _Tensor):
            return super()._across_lanes(items)
        return self.operand(first, self.reading)

    def operand(self, tensor, cls: str) -> Ref:
        """The element of `tensor` read as class `cls`: a load, or the value the group computes."""
        vid = tensor.value
        strides = self._iteration_strides(vid, cls)
        known = self.env[0].get(vid)
        if known is not None:
            seen = self.seen[vid]
            if [s != 0 for s in seen] != [s != 0 for s in strides] or (vid in self.input_index and seen != strides):
                raise Unsupported("a value read along other dims than it varies")
            return known
        if vid not in self.input_index:
            raise Unsupported("a value read through an alias of a value the group computes")
        self.operands.append((vid,))
        self.operand_strides.append(strides)
        self.seen[vid] = strides
        ref = self.builder.emit("load", (), self.graph.values[vid].meta.dtype, len(self.operands) - 1)
        self.env[0][vid] = ref
        return ref

    def define(self, vid: int | None, ref: Ref, cls: str) -> None:
        """`vid` is the value `ref` computes, of class `cls`."""
        if vid is None:
            return
        meta = self.graph.values[vid].meta
        ref = self.builder.cast(ref, meta.dtype)
        self.env[0][vid] = ref
        self.produced.append((ref, (vid,)))
        self.pinned[vid] = cls
        self.seen[vid] = self._iteration_strides_of_shape(meta.shape, cls)

    def write(self, member: Node, before, ref: Ref, cls: str) -> None:
        """The member writes `ref` into its argument `before` (batch norm's running statistics)."""
        if before is None:
            return
        handle = self.graph.values[before.value].handle
        after = [w for w in member.writes if self.graph.values[w].handle == handle]
        if len(after) != 1 or before.value not in self.input_index:
            raise Unsupported("an in-place write the row kernel cannot follow")
        meta = self.graph.values[before.value].meta
        self.row_writes.append((self.input_index[before.value], after[0], self.builder.cast(ref, meta.dtype)))
        self.pinned[after[0]] = cls
        self.env[0][after[0]] = ref

    def _iteration_strides_of_shape(self, shape: tuple[int, ...], cls: str) -> tuple[int, ...]:
        strides, step = [], 1
        for size in reversed(shape):
            strides.insert(0, step)
            step *= size
        return self.space.to_iteration(cls, tuple(strides))

    # -- members ----------------------------------------------------------------------------------

    def _lower_member(self, member: Node) -> None:
        found = ROW_OPS.get(member.target)
        if found is not None:
            self.reading = "element"
            found.lower(self, member, _bound(member))
            return
        outputs = [v for v in member.outputs if v is not None]
        if len(outputs) != 1 or member.writes:
            raise Unsupported("an elementwise member of a row kernel that writes in place")
        cls = self.space.member_class(self.graph.values[outputs[0]].meta.shape)
        if cls is None:
            raise Unsupported("an elementwise member in another space than the rows")
        self.reading = cls
        super()._lower_member(member)
        vid = outputs[0]
        self.pinned[vid] = cls
        self.seen[vid] = self._iteration_strides_of_shape(self.graph.values[vid].meta.shape, cls)

    def compute(self, dtype: torch.dtype) -> Compute:
        return Compute(self.builder, dtype)

    def index(self, dim: int) -> Ref:
        return self.builder.emit("index", (), torch.int64, dim)

    def reduce(self, op: str, value: Ref, dtype: torch.dtype, init: float | None = None) -> Ref:
        return self.builder.emit(op, (self.builder.cast(value, dtype),), dtype, init)

    def scalar(self, value, dtype: torch.dtype) -> Ref:
        """A number argument (eps, momentum) as an element of `dtype`: a kernel scalar or a constant."""
        if isinstance(value, _Scalar):
            arg = super()._across_lanes([value])
            return Compute(self.builder, dtype).value(arg)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return Compute(self.builder, dtype).value(float(value))
        raise Unsupported("a row op argument that is not a number")

    # -- the spec ---------------------------------------------------------------------------------

    def _spec(self) -> KernelSpec:
        outputs = set(self.node.outputs)
        allocations: list[TensorMeta] = []
        stores: list[tuple[int, tuple[int, ...]]] = []
        store_exprs: list[tuple[int, torch.dtype]] = []
        sources: dict[int, tuple[str, int]] = {}
        for ref, (vid,) in self.produced:
            if vid not in outputs or vid in sources:
                continue
            meta = self.graph.values[vid].meta
            cls = self.pinned.get(vid) or self.space.member_class(meta.shape)
            strides = self.space.to_iteration(cls, lane_strides(meta, meta.shape))
            allocations.append(meta)
            stores.append((len(allocations) - 1, strides))
            store_exprs.append((ref, meta.dtype))
            sources[vid] = ("new", len(allocations) - 1)
        written: list[int] = []
        for position, vid, ref in self.row_writes:
            meta = self.graph.values[self.node.inputs[position]].meta
            strides = self.space.to_iteration(self.pinned[vid], lane_strides(meta, meta.shape))
            written.append(position)
            stores.append((-1 - position, strides))
            store_exprs.append((ref, meta.dtype))
            sources[vid] = ("input", position)
        stores = [(t if t >= 0 else len(allocations) + written.index(-1 - t), st) for t, st in stores]
        for position, (vid, _), (_, strides) in zip(written, [(v, r) for _, v, r in self.row_writes],
                                                    stores[len(stores) - len(written):]):
            # a tensor written in place is read only where it is written (its own row's element)
            if any(p == position and st != strides for p, st in zip(
                    (self.input_index[v[0]] for v in self.operands), self.operand_strides)):
                raise Unsupported("a tensor written in place read at other elements")
        missing = [v for v in self.node.outputs if v not in sources]
        if missing:
            raise Unsupported(f"outputs {missing} are not computed by the row kernel")
        if not stores:
            raise Unsupported("a kernel that stores nothing")
        loads = tuple((self.input_index[vids[0]], st) for vids, st in zip(self.operands, self.operand_strides))
        lane = Lane(self.space.shape, loads, tuple(stores), tuple(slots[0] for slots in self.scalars))
        spec = KernelSpec(
            name=self.node.name,
            exprs=tuple(self.builder.exprs),
            load_dtypes=tuple(self.graph.values[vids[0]].meta.dtype for vids in self.operands),
            store_exprs=tuple(store_exprs),
            scalar_types=tuple(self.scalar_types),
            lanes=(lane,),
            allocations=tuple(allocations),
            written_inputs=tuple(written),
            output_sources=tuple(sources[v] for v in self.node.outputs),
            input_metas=tuple(self.graph.values[v].meta for v in self.node.inputs),
            device=self.graph.values[self.node.outputs[0]].meta.device,
            row=RowProgram(self.space.shape, self.space.reduced_dims, tuple(self.checks)),
        )
        plan(spec)  # raises Unsupported for values mixing per-row and all-row levels
        return spec


@dataclass(frozen=True)
class RowProgram:
    """What a row KernelSpec adds (KernelSpec.row): the reduced dims of `lanes[0].shape` and the
    per-row conditions that must hold (a target in range); a C kernel returns nonzero when one fails."""

    shape: tuple[int, ...]
    reduced: tuple[int, ...]
    checks: tuple[Ref, ...] = ()


# -- the plan both renderers follow -----------------------------------------------------------------

LEVELS = ("G", "R", "E", "P")


@dataclass
class RowPlan:
    """Per expression its level (see the module docstring); the passes over a row, each with the
    row reductions it computes (a reduction runs in the pass after those its operand needs); the
    stores by level (element stores run in one more pass, after the reductions)."""

    levels: list[str]
    passes: list[list[int]]
    stores: dict[str, list[int]]


def plan(spec: KernelSpec) -> RowPlan:
    row: RowProgram = spec.row
    lane = spec.lanes[0]
    reduced = set(row.reduced)
    levels: list[str] = []
    for index, expr in enumerate(spec.exprs):
        args = [levels[a] for a in expr.args]
        if expr.op in ("const", "scalar"):
            level = "G"
        elif expr.op == "load":
            strides = lane.loads[expr.value][1]
            along = [d for d, s in enumerate(strides) if s != 0]
            level = "E" if reduced & set(along) else ("R" if along else "G")
        elif expr.op == "index":
            level = "E" if expr.value in reduced else "R"
        elif expr.op in ROW_REDUCTIONS:
            if "P" in args:
                raise Unsupported("a row reduction of a value known after all rows")
            level = "R"
        elif expr.op == "colsum":
            if "P" in args:
                raise Unsupported("a sum over rows of a value known after all rows")
            level = "P"
        elif expr.op == "allsum":
            if "P" in args or "E" in args:
                raise Unsupported("a sum over all rows of an element value")
            level = "P"
        elif "P" in args:
            if "R" in args or "E" in args:
                raise Unsupported("a value mixing one row and all rows")
            level = "P"
        else:
            level = max(args, key=LEVELS.index) if args else "G"
        levels.append(level)
    passes: dict[int, int] = {}
    for index, expr in enumerate(spec.exprs):
        if expr.op in ROW_REDUCTIONS:
            passes[index] = 1 + max((passes.get(a, 0) for a in _reductions_below(spec, index)), default=0)
    by_pass = [[i for i, p in passes.items() if p == n] for n in range(1, max(passes.values(), default=0) + 1)]
    stores: dict[str, list[int]] = {level: [] for level in LEVELS}
    for k, (ref, _) in enumerate(spec.store_exprs):
        level = levels[ref]
        strides = lane.stores[k][1]
        if level in ("R", "G") and any(strides[d] for d in reduced) and row.reduced:
            raise Unsupported("a row value stored over the row")
        if level == "P" and any(strides[d] for d in range(len(strides)) if d not in reduced):
            raise Unsupported("a value known after all rows stored per row")
        stores[level].append(k)
    for ref in row.checks:
        if levels[ref] not in ("R", "G"):
            raise Unsupported("a check that is not one per row")
    return RowPlan(levels, by_pass, stores)


def _reductions_below(spec: KernelSpec, index: int) -> set[int]:
    """The row reductions the operands of reduction `index` depend on (not looking past them)."""
    found: set[int] = set()
    stack = list(spec.exprs[index].args)
    seen: set[int] = set()
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        if spec.exprs[i].op in ROW_REDUCTIONS:
            found.add(i)
            continue
        stack.extend(spec.exprs[i].args)
    return found


def needed(spec: KernelSpec, roots: list[int], stop: Callable[[int], bool] = lambda i: False) -> list[int]:
    """The expressions `roots` need, in order, not looking past those `stop` accepts (kept as leaves)."""
    found: set[int] = set()
    stack = list(roots)
    while stack:
        i = stack.pop()
        if i in found:
            continue
        found.add(i)
        if not stop(i):
            stack.extend(spec.exprs[i].args)
    return sorted(found)


class RowRendering:
    """What every backend's row kernel renderer starts from: the plan and the merged iteration
    space, split into the dims a row keeps (one program or loop iteration each) and the ones it
    reduces (walked inside the row)."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.plan = plan(spec)
        self.lane = spec.lanes[0]
        self.row: RowProgram = spec.row
        self.sizes, self.is_reduced, self.strides, self.dim_of = merged_space(spec)
        self.kept = [d for d, r in enumerate(self.is_reduced) if not r]
        self.red = [d for d, r in enumerate(self.is_reduced) if r]
        self.rows = math.prod(self.sizes[d] for d in self.kept)
        self.cols = math.prod(self.sizes[d] for d in self.red)


def merged_space(spec: KernelSpec) -> tuple[list[int], list[bool], list[list[int]], dict[int, int]]:
    """The iteration space with size-1 dims dropped and neighbouring dims of one kind (kept or
    reduced) merged where every tensor walks them as one: (sizes, reduced flags, strides per tensor
    (loads, then stores), merged dim of each original dim). Dims an `index` reads stay apart."""
    lane = spec.lanes[0]
    row: RowProgram = spec.row
    indexed = {e.value for e in spec.exprs if e.op == "index"}
    tensors = [list(s) for _, s in lane.loads] + [list(s) for _, s in lane.stores]
    groups: list[list[int]] = []
    for d, size in enumerate(lane.shape):
        if size == 1 and d not in indexed:
            continue
        if groups:
            p = groups[-1][-1]
            if ((p in row.reduced) == (d in row.reduced) and d not in indexed and p not in indexed
                    and all(t[p] == t[d] * size for t in tensors)):
                groups[-1].append(d)
                continue
        groups.append([d])
    sizes = [math.prod(lane.shape[d] for d in g) for g in groups]
    reduced = [g[0] in row.reduced for g in groups]
    strides = [[t[g[-1]] for g in groups] for t in tensors]
    dim_of = {d: i for i, g in enumerate(groups) for d in g}
    return sizes, reduced, strides, dim_of


# -- the row ops' formulas --------------------------------------------------------------------------

def _check_flag(values: list, count: int, meta: TensorMeta, backward: bool) -> None:
    flag = values[count + 1]
    if backward:
        if flag != meta.dtype:
            raise Unsupported("a row reduction that changes the type")
    elif flag:
        raise Unsupported("a row reduction that changes the type")


def _same_type(lowering: _RowLowering, tensors: list, dtype: torch.dtype) -> None:
    for t in tensors:
        meta = _meta(lowering.graph, t)
        if meta is None or meta.dtype != dtype or meta.shape != lowering.space.element:
            raise Unsupported("row op operands of mixed types or shapes")


@_row_op(aten._softmax.default, "softmax", _softmax_space)
def _softmax(L: _RowLowering, member: Node, values: list) -> None:
    dtype = _meta(L.graph, values[0]).dtype
    _check_flag(values, 1, _meta(L.graph, values[0]), False)
    c = L.compute(dtype)
    x = L.builder.cast(L.operand(values[0], "element"), dtype)
    e = c.exp(c.sub(x, L.reduce("rowmax", x, dtype)))
    L.define(member.outputs[0], c.mul(e, c.div(1, L.reduce("rowsum", e, dtype, 0.0))), "element")


@_row_op(aten._log_softmax.default, "log_softmax", _softmax_space)
def _log_softmax(L: _RowLowering, member: Node, values: list) -> None:
    dtype = _meta(L.graph, values[0]).dtype
    _check_flag(values, 1, _meta(L.graph, values[0]), False)
    c = L.compute(dtype)
    x = L.builder.cast(L.operand(values[0], "element"), dtype)
    shifted = c.sub(x, L.reduce("rowmax", x, dtype))
    lse = c.log(L.reduce("rowsum", c.exp(shifted), dtype, 0.0))
    L.define(member.outputs[0], c.sub(shifted, lse), "element")


def _softmax_backward_operands(L: _RowLowering, values: list) -> tuple:
    """(compute, grad_output, output, dtype) of a (log_)softmax backward: both operands of one
    floating dtype, computed in it; the dim is the row's."""
    dtype = _meta(L.graph, values[0]).dtype
    _same_type(L, values[:2], dtype)
    _check_flag(values, 2, _meta(L.graph, values[0]), True)
    c = L.compute(dtype)
    g, y = (L.builder.cast(L.operand(t, "element"), dtype) for t in values[:2])
    return c, g, y, dtype


@_row_op(aten._softmax_backward_data.default, "softmax_backward", _softmax_backward_space)
def _softmax_backward(L: _RowLowering, member: Node, values: list) -> None:
    c, g, y, dtype = _softmax_backward_operands(L, values)
    L.define(member.outputs[0], c.mul(y, c.sub(g, L.reduce("rowsum", c.mul(g, y), dtype, 0.0))), "element")


@_row_op(aten._log_softmax_backward_data.default, "log_softmax_backward", _softmax_backward_space)
def _log_softmax_backward(L: _RowLowering, member: Node, values: list) -> None:
    c, g, y, dtype = _softmax_backward_operands(L, values)
    L.define(member.outputs[0], c.sub(g, c.mul(c.exp(y), L.reduce("rowsum", g, dtype, 0.0))), "element")


def _affine(L: _RowLowering, tensors: list, dtype: torch.dtype) -> list:
    """Weight and bias of a norm (None where absent), read one value per column."""
    found = []
    for t in tensors:
        if t is None:
            found.append(None)
            continue
        meta = _meta(L.graph, t)
        if meta is None or meta.dtype != dtype:
            raise Unsupported("a norm with parameters of another type")
        found.append(L.operand(t, "col"))
    return found


@_row_op(aten.native_layer_norm.default, "layer_norm", _layer_norm_space)
def _layer_norm(L: _RowLowering, member: Node, values: list) -> None:
    x, _, weight, bias, eps = values
    dtype = _meta(L.graph, x).dtype
    c = L.compute(dtype)
    n = L.space.cols
    x = L.operand(x, "element")
    w, b = _affine(L, [weight, bias], dtype)
    mean = c.div(L.reduce("rowsum", x, dtype, 0.0), n)
    d = c.sub(x, mean)
    rstd = c.div(1, c.sqrt(c.add(c.div(L.reduce("rowsum", c.mul(d, d), dtype, 0.0), n), L.scalar(eps, dtype))))
    y = c.mul(d, rstd)
    if w is not None:
        y = c.mul(y, w)
    if b is not None:
        y = c.add(y, b)
    for vid, ref, cls in zip(member.outputs, (y, mean, rstd), ("element", "rowk", "rowk")):
        L.define(vid, ref, cls)


@_row_op(aten.native_layer_norm_backward.default, "layer_norm_backward", _layer_norm_backward_space)
def _layer_norm_backward(L: _RowLowering, member: Node, values: list) -> None:
    dy, x, _, mean, rstd, weight, bias, mask = values
    dtype = _meta(L.graph, x).dtype
    _same_type(L, [dy, x], dtype)
    if any(_meta(L.graph, t) is None or _meta(L.graph, t).dtype != dtype for t in (mean, rstd)):
        raise Unsupported("a layer norm backward with statistics of another type")
    c = L.compute(dtype)
    dy, x = L.operand(dy, "element"), L.operand(x, "element")
    mean, a = L.operand(mean, "rowk"), L.operand(rstd, "rowk")
    (w,) = _affine(L, [weight], dtype)
    scale = c.div(1, L.space.cols)
    outputs = list(member.outputs) + [None] * (3 - len(member.outputs))
    if outputs[0] is not None and mask[0]:
        dyw = dy if w is None else c.mul(dy, w)
        ds = L.reduce("rowsum", c.mul(c.mul(dy, x), w) if w is not None else c.mul(dy, x), dtype, 0.0)
        db = L.reduce("rowsum", dyw, dtype, 0.0)
        b = c.mul(c.mul(c.mul(c.mul(c.sub(c.mul(db, mean), ds), a), a), a), scale)
        cc = c.sub(c.mul(c.neg(b), mean), c.mul(c.mul(db, a), scale))
        ady = c.mul(a, dy)
        dx = c.add(c.add(ady if w is None else c.mul(ady, w), c.mul(b, x)), cc)
        L.define(outputs[0], dx, "element")
    if outputs[1] is not None and mask[1]:
        xhat = c.add(c.mul(a, x), c.mul(c.neg(a), mean))
        L.define(outputs[1], L.reduce("colsum", c.mul(dy, xhat), dtype, 0.0), "col")
    if outputs[2] is not None and mask[2]:
        L.define(outputs[2], L.reduce("colsum", dy, dtype, 0.0), "col")


def _reduce(kind: str):
    def lower(L: _RowLowering, member: Node, values: list) -> None:
        dtype = _meta(L.graph, values[0]).dtype
        c = L.compute(dtype)
        x = L.operand(values[0], "element")
        if kind == "amax":
            result = L.reduce("rowmax", x, dtype)
        else:
            result = L.reduce("rowsum", x, dtype, 0.0)
            if kind == "mean":
                result = c.div(result, L.space.cols)
        keepdim = len(values) > 2 and bool(values[2])
        L.define(member.outputs[0], result, "rowk" if keepdim else "row")
    return lower


for _op, _kind in ((aten.sum.dim_IntList, "sum"), (aten.mean.dim, "mean"), (aten.amax.default, "amax")):
    _row_op(_op, _kind, _reduce_space, alone=False)(_reduce(_kind))


@_row_op(aten.native_batch_norm.default, "batch_norm", lambda g, n, v: _batch_norm_space(g, n, v, 5))
def _batch_norm(L: _RowLowering, member: Node, values: list) -> None:
    """Eager's CPU batch norm (batch_norm_cpu_collect_stats_contiguous_impl and
    batch_norm_cpu_update_stats_template): the moments in two passes summed in float64, the mean
    and the sum of squares rounded to the input's type; invstd = 1 / sqrt(var + eps) in float64;
    y = x * alpha + beta with alpha = invstd * w, beta = b - mean * alpha; the running statistics
    updated in float64 with the unbiased variance."""
    x, weight, bias, running_mean, running_var, _, momentum, eps = values
    dtype = _meta(L.graph, x).dtype
    c, c64 = L.compute(dtype), L.compute(torch.float64)
    n = L.space.cols
    x = L.operand(x, "element")
    w, b = (None if t is None else L.operand(t, "row") for t in (weight, bias))
    for t in (weight, bias, running_mean, running_var):
        if t is not None and _meta(L.graph, t).dtype != dtype:
            raise Unsupported("a batch norm with parameters of another type")
    mean = c.value(c64.div(L.reduce("rowsum", x, torch.float64, 0.0), n))
    d = c.sub(x, mean)
    var_sum = c.value(L.reduce("rowsum", c.mul(d, d), torch.float64, 0.0))
    var = c64.value(c.div(var_sum, n))
    eps = L.scalar(eps, torch.float64)
    inverse = c64.where(L.compute(torch.bool).logical("and", c64.eq(var, 0), c64.eq(eps, 0)), 0.0,
                        c64.div(1, c64.sqrt(c64.add(var, eps))))
    invstd = c.value(inverse)
    alpha = invstd if w is None else c.mul(invstd, w)
    beta = c.sub(0.0 if b is None else b, c.mul(mean, alpha))
    outputs = list(member.outputs) + [None] * (3 - len(member.outputs))
    for vid, ref, cls in zip(outputs, (c.add(c.mul(x, alpha), beta), mean, invstd), ("element", "row", "row")):
        L.define(vid, ref, cls)
    momentum = L.scalar(momentum, torch.float64)
    keep = c64.sub(1, momentum)
    if running_mean is not None:
        old = L.operand(running_mean, "row")
        L.write(member, running_mean, c64.add(c64.mul(momentum, mean), c64.mul(keep, old)), "row")
    if running_var is not None:
        old = L.operand(running_var, "row")
        unbiased = c64.value(c.div(var_sum, n - 1))
        L.write(member, running_var, c64.add(c64.mul(momentum, unbiased), c64.mul(keep, old)), "row")


@_row_op(aten.native_batch_norm_backward.default, "batch_norm_backward",
         lambda g, n, v: _batch_norm_space(g, n, v[1:], 6))
def _batch_norm_backward(L: _RowLowering, member: Node, values: list) -> None:
    """Eager's batch_norm_cpu_backward_contiguous_impl (training): sum = sum(dy), dotp =
    sum((x - mean) * dy); dx = (dy - sum / n - (x - mean) * (dotp * invstd * invstd / n)) * invstd * w;
    dw = dotp * invstd, db = sum."""
    dy, x, weight, _, _, mean, invstd, _, _, mask = values
    dtype = _meta(L.graph, x).dtype
    _same_type(L, [dy, x], dtype)
    for t in (weight, mean, invstd):
        if t is not None and _meta(L.graph, t).dtype != dtype:
            raise Unsupported("a batch norm backward with parameters of another type")
    if mean is None or invstd is None:
        raise Unsupported("a batch norm backward without saved statistics")
    c = L.compute(dtype)
    n = L.space.cols
    dy, x = L.operand(dy, "element"), L.operand(x, "element")
    mean, invstd = L.operand(mean, "row"), L.operand(invstd, "row")
    w = None if weight is None else L.operand(weight, "row")
    total = L.reduce("rowsum", dy, dtype, 0.0)
    centered = c.sub(x, mean)
    dotp = L.reduce("rowsum", c.mul(centered, dy), dtype, 0.0)
    outputs = list(member.outputs) + [None] * (3 - len(member.outputs))
    if outputs[0] is not None and mask[0]:
        k = c.div(c.mul(c.mul(dotp, invstd), invstd), n)
        dx = c.mul(c.sub(c.sub(dy, c.div(total, n)), c.mul(centered, k)), invstd)
        L.define(outputs[0], dx if w is None else c.mul(dx, w), "element")
    if outputs[1] is not None and mask[1]:
        L.define(outputs[1], c.mul(dotp, invstd), "row")
    if outputs[2] is not None and mask[2]:
        L.define(outputs[2], total, "row")


def _window_position(L: _RowLowering) -> Ref:
    """Where the element of a pooling window lies in its (H, W) plane: h * W + w, as eager's indices."""
    i64 = L.compute(torch.int64)
    lead = len(L.space.element) - 2
    (kh, kw), width = L.space.window, L.space.element[-1]
    h = i64.add(i64.mul(L.index(lead), kh), L.index(lead + 2))
    w = i64.add(i64.mul(L.index(lead + 1), kw), L.index(lead + 3))
    return i64.add(i64.mul(h, width), w)


@_row_op(aten.max_pool2d_with_indices.default, "max_pool2d", _max_pool_space, exact=True)
def _max_pool(L: _RowLowering, member: Node, values: list) -> None:
    """Eager's cpu_max_pool: the maximum propagates NaN; the index is the last NaN's, else the
    first maximum's (`val > max || isnan(val)` over the window in row-major order)."""
    dtype = _meta(L.graph, values[0]).dtype
    x = L.operand(values[0], "element")
    out, indices = (list(member.outputs) + [None, None])[:2]
    # the value at the chosen element (not a maximum of the window: with +0.0 and -0.0 it is eager's)
    L.define(out, L.builder.emit("rowargmax", (x, x), dtype), "row")
    L.define(indices, L.builder.emit("rowargmax", (x, _window_position(L)), torch.int64), "row")


@_row_op(aten.max_pool2d_with_indices_backward.default, "max_pool2d_backward", _max_pool_backward_space,
         exact=True)
def _max_pool_backward(L: _RowLowering, member: Node, values: list) -> None:
    """Each input element gets its window's gradient where the index points at it, else 0
    (eager adds the gradient to zeros: 0 + g). An index outside its own window (not from this
    pooling) makes the C kernel hand the call to aten, and gives NaN in Triton."""
    grad, indices = values[0], values[7]
    dtype = _meta(L.graph, values[1]).dtype
    if _meta(L.graph, grad) is None or _meta(L.graph, grad).dtype != dtype:
        raise Unsupported("max pooling backward with a gradient of another type")
    c, i64, logic = L.compute(dtype), L.compute(torch.int64), L.compute(torch.bool)
    g, index = L.operand(grad, "row"), L.operand(indices, "row")
    lead = len(L.space.element) - 2
    (kh, kw), width = L.space.window, L.space.element[-1]
    # where the index lies relative to its window's first element: inside when it is in one of
    # the window's kh lines of kw elements
    corner = i64.add(i64.mul(i64.mul(L.index(lead), kh), width), i64.mul(L.index(lead + 1), kw))
    offset = i64.sub(index, corner)
    inside = None
    for dh in range(kh):
        line = logic.logical("and", i64.ge(offset, dh * width), i64.lt(offset, dh * width + kw))
        inside = line if inside is None else logic.logical("or", inside, line)
    L.checks.append(inside)
    here = i64.add(i64.mul(L.index(lead + 2), width), L.index(lead + 3))
    value = c.where(i64.eq(offset, here), c.add(0.0, g), 0.0)
    L.define(member.outputs[0], c.where(inside, value, math.nan), "element")


def _target(L: _RowLowering, target, ignore_index: int, classes: int):
    """(target, taken, in range) of each row: the class index, whether it counts, whether it is valid."""
    t = L.operand(target, "row")
    i64 = L.compute(torch.int64)
    taken = i64.ne(t, ignore_index)
    inside = L.compute(torch.bool).logical("and", i64.ge(t, 0), i64.lt(t, classes))
    bad = L.compute(torch.bool).logical("and", taken, L.compute(torch.bool).logical("not", inside))
    L.checks.append(L.compute(torch.bool).logical("not", bad))
    return t, taken, bad


@_row_op(aten.nll_loss_forward.default, "nll_loss", _nll_space)
def _nll_loss(L: _RowLowering, member: Node, values: list) -> None:
    scores, target, _, reduction, ignore_index = values
    dtype = _meta(L.graph, scores).dtype
    c = L.compute(dtype)
    x = L.operand(scores, "element")
    t, taken, bad = _target(L, target, ignore_index, L.space.cols)
    # x[t] selected, not summed (a vectorized sum of where(j == t, x, -0.0) lost the sign of a
    # picked -0.0 under GCC 12 -O3 -march=native): the value at the first maximum of j == t
    hit = c.value(L.compute(torch.int64).eq(L.index(1), t))
    picked = L.builder.emit("rowargmax", (hit, x), dtype)
    loss = c.where(bad, math.nan, c.neg(picked))  # eager raises for a target out of range
    output, total_weight = (list(member.outputs) + [None, None])[:2]
    if reduction == 0:
        L.define(output, c.where(taken, loss, 0.0), "row")
        L.define(total_weight, c.value(0.0), "global")
        return
    # eager: loss_sum = 0 - x[t0] - x[t1]...; a skipped row adds -0.0, which changes no sum
    total = L.reduce("allsum", c.where(taken, loss, -0.0), dtype, 0.0)
    weight = L.reduce("allsum", c.where(taken, 1.0, 0.0), dtype, 0.0)
    L.define(output, c.div(total, weight) if reduction == 1 else total, "global")
    L.define(total_weight, weight, "global")


@_row_op(aten.nll_loss_backward.default, "nll_loss_backward", _nll_backward_space)
def _nll_loss_backward(L: _RowLowering, member: Node, values: list) -> None:
    grad, scores, target, _, reduction, ignore_index, total_weight = values
    dtype = _meta(L.graph, scores).dtype
    if _meta(L.graph, grad) is None or _meta(L.graph, grad).dtype != dtype:
        raise Unsupported("nll_loss_backward with a gradient of another type")
    c = L.compute(dtype)
    t, taken, bad = _target(L, target, ignore_index, L.space.cols)
    if reduction == 0:
        g = c.neg(L.operand(grad, "row"))
    else:
        g = L.operand(grad, "global")
        g = c.neg(c.div(g, L.operand(total_weight, "global")) if reduction == 1 else g)
    hit = L.compute(torch.bool).logical("and", L.compute(torch.int64).eq(L.index(1), t), taken)
    L.define(member.outputs[0], c.where(bad, math.nan, c.where(hit, g, 0.0)), "element")


__all__ = ["ROW_OPS", "RowPlan", "RowProgram", "RowSpace", "alone_worth_a_kernel", "is_row_op", "lower_row",
           "merged_space", "needed", "plan", "row_space"]
