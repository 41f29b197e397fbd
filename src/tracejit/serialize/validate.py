"""Which ops a dumped graph may hold, and checking every op against the values it claims.

The op rule: an op is `aten::<name>.<overload>` of the torch that loads the file, its results
are tensors (or nothing), and it is not on the denylist of ops that touch files, global state or
memory without bounds checks. Anything else is refused, so a file can only ask for computation
torch itself offers with its own argument checks.

`check_graph` runs every op on fake tensors (no memory, no kernels, no random numbers drawn) of
the declared input metadata and compares what comes out with the declared output metadata, so a
file whose metadata lies about shapes, dtypes or devices is refused before anything runs.
"""

from __future__ import annotations

import contextlib
import logging
import re

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)

from ..errors import LoadError
from ..ir.meta_check import mispredicted_dtype
from ..record.autocast_keys import outside_autocast
from ..record.calls import is_view_op, may_copy, rebuild_call
from ..record.record import TENSOR, KwargStatic, ScalarSlot
from .portable import PortableGraph, PortableOp, default_dtype
from .schema import extent

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}\Z")

# Ops that read or write files, change process-wide state, or index memory without bounds checks.
DENIED_OPS = frozenset({
    "from_file", "save", "_print", "manual_seed", "seed", "initial_seed", "set_", "set_data",
    "set_grad_enabled", "record_stream", "_make_dep_token", "_set_item", "_cufft_clear_plan_cache",
    "_cufft_set_plan_cache_max_size", "_unsafe_index", "_unsafe_index_put", "_unsafe_masked_index",
    "_unsafe_masked_index_put_accumulate", "_sparse_coo_tensor_unsafe", "_sparse_csr_tensor_unsafe",
    "_sparse_csc_tensor_unsafe", "_sparse_bsr_tensor_unsafe", "_sparse_bsc_tensor_unsafe",
    "_sparse_compressed_tensor_unsafe",
})
_TENSOR_RETURNS = {"Tensor", "Optional[Tensor]", "List[Tensor]", "List[Optional[Tensor]]"}
# The aten ops whose names are Python operator names (`x << 1` dispatches aten.__lshift__.Scalar);
# other dunder names are refused before anything looks them up as attributes
_DUNDER_OPS = frozenset({"__lshift__", "__rshift__", "__ilshift__", "__irshift__", "__and__", "__or__", "__xor__",
                         "__iand__", "__ior__", "__ixor__"})
OUT_KINDS = ("tensor", "tuple", "list", "none")


def resolve_op(qualified: object) -> torch._ops.OpOverload:
    """`aten::addmm.default` -> torch.ops.aten.addmm.default, if the op rule allows it."""
    if not isinstance(qualified, str) or not qualified.startswith("aten::"):
        raise LoadError(f"op {qualified!r} is not an aten op (a graph may only hold aten::<name>.<overload> ops)")
    name, _, overload = qualified.removeprefix("aten::").partition(".")
    if not (_IDENTIFIER.match(name) and _IDENTIFIER.match(overload)) or (name.startswith("__") and name not in _DUNDER_OPS):
        raise LoadError(f"op {qualified!r} is not of the form aten::<name>.<overload>")
    if name in DENIED_OPS:
        raise LoadError(f"op {qualified} is not allowed in a loaded graph (it touches files, process state or "
                        f"unchecked memory)")
    try:
        torch._C._dispatch_find_schema_or_throw(f"aten::{name}", "" if overload == "default" else overload)
        op = getattr(getattr(torch.ops.aten, name), overload)
    except (RuntimeError, AttributeError):
        raise LoadError(f"op {qualified} does not exist in torch {torch.__version__}") from None
    returns = [str(r.type) for r in op._schema.returns]
    if any(r not in _TENSOR_RETURNS for r in returns):
        raise LoadError(f"op {qualified} returns {', '.join(returns)}: a graph may only hold ops that return tensors")
    return op


def check_arguments(op: PortableOp, where: str) -> None:
    """The arguments fit the op's schema and the op's tensor and scalar lists."""
    schema = op.target._schema
    names = {a.name for a in schema.arguments}
    positional = [s for s in op.statics if not isinstance(s, KwargStatic)]
    if len(positional) > len(schema.arguments):
        raise LoadError(f"{where}: {len(positional)} positional arguments, the op takes {len(schema.arguments)}")
    for item in op.statics:
        # keyword names become code in the generated program: only the schema's own names pass
        if isinstance(item, KwargStatic) and item.name not in names:
            raise LoadError(f"{where}: the op has no argument named {item.name[:60]!r}")
    tensors, slots = _count_markers(op.statics)
    if tensors != len(op.inputs):
        raise LoadError(f"{where}: the arguments hold {tensors} tensors but the op lists {len(op.inputs)} inputs")
    if len(slots) != len(op.scalars):
        raise LoadError(f"{where}: the arguments hold {len(slots)} scalar slots but the op lists "
                        f"{len(op.scalars)} scalars")
    for slot, value in zip(slots, op.scalars):
        if type(value) is not slot.type:
            raise LoadError(f"{where}: scalar {value!r} is not of its slot's type {slot.type.__name__}")
    if op.out_kind not in OUT_KINDS:
        raise LoadError(f"{where}: unknown result kind {op.out_kind!r} (known: {', '.join(OUT_KINDS)})")
    expected = {"tensor": 1, "none": 0}.get(op.out_kind)
    if expected is not None and len(op.outputs) != expected:
        raise LoadError(f"{where}: result kind {op.out_kind!r} does not fit {len(op.outputs)} outputs")


def _count_markers(statics: tuple) -> tuple[int, list[ScalarSlot]]:
    tensors, slots = 0, []
    stack = list(reversed(statics))
    while stack:
        item = stack.pop()
        if isinstance(item, KwargStatic):
            stack.append(item.value)
        elif item is TENSOR:
            tensors += 1
        elif isinstance(item, ScalarSlot):
            slots.append(item)
        elif isinstance(item, tuple):
            stack.extend(reversed(item))
    return tensors, slots


def check_handles(graph: PortableGraph) -> None:
    """The values describe one consistent set of tensors, as the program keeps them (one slot per
    handle): every handle is made once (an input, a constant, or a new result of an op), later
    values of it are in-place writes (or an op returning its input as is); all values of a handle
    live in one root storage with one dtype and device; a root is not itself a view; inputs and
    constants are roots of their own at version 0; an op writes only storage it reads, and a write
    changes the metadata only of the tensor the op returns. Raises LoadError naming the value."""
    values = graph.values
    made: dict[int, int] = {}  # handle -> the value that made it
    latest: dict[int, int] = {}  # handle -> its current value
    where_of = {}

    def describe(vid: int) -> str:
        value = values[vid]
        return f"value {vid} (handle {value.handle}, root {value.root}, version {value.version}, {value.meta})"

    def make(vid: int, where: str, own_root: bool) -> None:
        value = values[vid]
        if value.handle in made:
            raise LoadError(f"{where}: {describe(vid)} makes handle {value.handle} again; value {made[value.handle]} "
                            f"({where_of[value.handle]}) made it (a handle is one tensor)")
        if own_root and (value.root != value.handle or value.version != 0):
            raise LoadError(f"{where}: {describe(vid)} must be a tensor of its own (root = handle, version 0)")
        made[value.handle], latest[value.handle], where_of[value.handle] = vid, vid, where

    for index, item in enumerate(graph.inputs):
        if item.value is not None:
            make(item.value, f"inputs[{index}] {item.name!r}", True)
    constant_roots = set()  # a folded weight (`t(fc.weight)`) keeps the root of what it was folded from
    for index, constant in enumerate(graph.constants):
        make(constant.value, f"constants[{index}]", False)
        if values[constant.value].version != 0:
            raise LoadError(f"constants[{index}]: {describe(constant.value)} must be at version 0")
        constant_roots.add(values[constant.value].root)
    for index, op in enumerate(graph.ops):
        where = f"op #{index} {op.target}"
        read = {values[v].handle: v for v in op.inputs}
        read_roots = {values[v].root for v in op.inputs}
        before = dict(latest)  # a handle made twice (`lift_fresh`) is written twice by one op
        for vid in op.writes:
            value = values[vid]
            if value.handle not in before:
                raise LoadError(f"{where}: writes {describe(vid)}, a handle no earlier value made")
            previous = values[before[value.handle]]
            if value.root not in read_roots:
                raise LoadError(f"{where}: writes {describe(vid)} in storage t{value.root}, which it does not read")
            if value.version <= previous.version:
                raise LoadError(f"{where}: writes {describe(vid)}, not a newer version than value {previous.id}")
            if value.meta != previous.meta and vid not in op.outputs:
                raise LoadError(f"{where}: writes {describe(vid)}, whose metadata differs from value {previous.id}'s "
                                f"though the op does not return it")
            latest[value.handle] = vid
        for vid in op.outputs:
            if vid is None or vid in op.writes:
                continue
            value = values[vid]
            if value.handle in read:  # the op returned its input as is (`lift_fresh`)
                same = values[latest.get(value.handle, read[value.handle])]
                if (value.version, value.root, value.meta) != (same.version, same.root, same.meta):
                    raise LoadError(f"{where}: returns {describe(vid)} as its input value {same.id}, which differs")
                continue
            if value.root == value.handle and is_view_op(op.target) and not may_copy(op.target):
                raise LoadError(f"{where}: {describe(vid)} is declared a tensor of its own, but the op returns a "
                                f"view of its input")
            make(vid, where, False)
    for value in values:
        if value.handle not in made:
            continue  # defined nowhere: the structure check names it
        first = values[made[value.handle]]
        if (value.root, value.meta.dtype, value.meta.device) != (first.root, first.meta.dtype, first.meta.device):
            raise LoadError(f"{describe(value.id)} differs in root, dtype or device from {describe(first.id)}, "
                            f"a value of the same handle")
        if value.root != value.handle:
            root = made.get(value.root)
            if root is None and value.root in constant_roots:
                continue  # views of a weight the file holds only folded
            if root is None or values[root].root != value.root:
                raise LoadError(f"{describe(value.id)} is a view of handle {value.root}, which is not a tensor of "
                                f"the graph with storage of its own")


def check_graph(graph: PortableGraph) -> None:
    """Run every op on fake tensors of its declared inputs; raise LoadError where the declared
    outputs are not what the op produces."""
    check_handles(graph)
    offsets = {i.value: i.storage_offset for i in graph.inputs if i.value is not None and i.storage_offset}
    # the ops run under the default dtype the graph was traced with, as a loaded graph's calls do
    with _quiet_fake_tensor_log(), FakeTensorMode(allow_fallback_kernels=False, allow_non_fake_inputs=False), \
            outside_autocast(), default_dtype(graph.default_dtype):  # a caller's autocast would cast the ops again
        for index, op in enumerate(graph.ops):
            where = f"op #{index} {op.target}"
            check_arguments(op, where)
            samples = [_fake(graph, v, offsets.get(v, 0)) for v in op.inputs]
            args, kwargs = rebuild_call(op.statics, samples, list(op.scalars))
            _check_pin_memory(op, args, kwargs, where)
            _check_dim(op, args, kwargs, where)
            try:
                result = op.target(*args, **kwargs)
            except (DynamicOutputShapeException, DataDependentOutputException):
                raise LoadError(f"{where}: its output shape depends on tensor data; a graph needs static "
                                f"shapes") from None
            except UnsupportedOperatorException:
                raise LoadError(f"{where}: torch has no shape function for this op, so its metadata cannot "
                                f"be checked") from None
            except Exception as error:  # noqa: BLE001 - any complaint of torch's own argument checks
                raise LoadError(f"{where}: its arguments are invalid for this op: {_first_line(error)}") from None
            _compare(graph, op, result, where)


# ops whose shape functions take any `dim` (torch checks it only in the kernel, at the first call)
_DIM_UNCHECKED = frozenset({"aten::_softmax", "aten::sort", "aten::argsort"})


def _check_dim(op: PortableOp, args: tuple, kwargs: dict, where: str) -> None:
    """`dim` of `self` in range, as the kernel would insist on every call."""
    schema = op.target._schema
    if schema.name not in _DIM_UNCHECKED:
        return
    names = [a.name for a in schema.arguments]
    bound = {**dict(zip(names, args)), **kwargs}
    tensor, dim = bound.get("self"), bound.get("dim", -1)
    if isinstance(tensor, torch.Tensor) and type(dim) is int:
        rank = max(tensor.dim(), 1)
        if not -rank <= dim < rank:
            raise LoadError(f"{where}: dim {dim} is out of range for its {tensor.dim()}-d input "
                            f"(expected {-rank} to {rank - 1})")


def _check_pin_memory(op: PortableOp, args: tuple, kwargs: dict, where: str) -> None:
    """Fake tensors ignore `pin_memory=True`, which a machine without an accelerator cannot honour."""
    names = [a.name for a in op.target._schema.arguments]
    if "pin_memory" not in names:
        return
    index = names.index("pin_memory")
    pinned = kwargs.get("pin_memory", args[index] if index < len(args) else None)
    if pinned is True and not torch.cuda.is_available():
        raise LoadError(f"{where}: pin_memory=True needs a CUDA device, which this machine does not have")


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """FakeTensorMode logs the stack trace of every meta kernel that raises ("failed while attempting
    to run meta for ..."): a damaged file is refused with one LoadError, not a page of log."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = disabled


def _fake(graph: PortableGraph, vid: int, offset: int = 0) -> torch.Tensor:
    meta = graph.values[vid].meta
    if offset:  # an input at the storage offset it was traced with (as a call gets it, loaded.py)
        storage = torch.empty(offset + extent(meta.shape, meta.stride), dtype=meta.dtype, device=meta.device)
        return storage.as_strided(meta.shape, meta.stride, offset)
    return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=meta.device)


def _compare(graph: PortableGraph, op: PortableOp, result: object, where: str) -> None:
    if op.out_kind == "none":
        produced = [] if result is None else [result]
    elif op.out_kind == "tensor":
        produced = [result]
    elif isinstance(result, (tuple, list)):
        produced = list(result)
    else:
        raise LoadError(f"{where}: the op produces {type(result).__name__}, the graph declares a {op.out_kind}")
    if len(produced) != len(op.outputs):
        raise LoadError(f"{where}: the op produces {len(produced)} results, the graph declares {len(op.outputs)}")
    for position, (tensor, vid) in enumerate(zip(produced, op.outputs)):
        if vid is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise LoadError(f"{where}: result {position} is {type(tensor).__name__}, the graph declares a tensor")
        meta = graph.values[vid].meta
        # a view's strides follow from its input's: the program's kernels address it through them
        if is_view_op(op.target) and tuple(tensor.stride()) != meta.stride and tensor.numel() > 1:
            raise LoadError(f"{where}: result {position} has strides {list(tensor.stride())}, the graph declares "
                            f"{list(meta.stride)}")
        # a dtype the meta kernel is known to mispredict is the kernel's (ir/meta_check.py)
        same_dtype = tensor.dtype == meta.dtype or mispredicted_dtype(op.target, position, meta.dtype, tensor.dtype)
        if tuple(tensor.shape) != meta.shape or not same_dtype or tensor.device != meta.device:
            raise LoadError(f"{where}: result {position} is {tensor.device.type} {tensor.dtype} "
                            f"{list(tensor.shape)}, the graph declares {meta}")


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:300]
