"""KernelSpec -> Triton source: one `@triton.jit` kernel per fused group.

A one-lane kernel takes one pointer per tensor and one argument per dynamic scalar, and walks its
(merged) iteration space in blocks of BLOCK elements, one block per program:

    @triton.jit(do_not_specialize=["s0"])
    def k(in0, in1, out0, s0: tl.float64):
        offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
        mask = offs < 1000
        v0 = tl.load(in0 + offs, mask=mask)
        ...
        tl.store(out0 + offs, v7, mask=mask)

Shapes and strides are baked in; an N-d space splits the flat block index into per-dimension
indices by div/mod with constant divisors (a flat contiguous space needs none). Offsets are int32
unless some tensor spans 2^31 elements. Every operand is loaded once (a fully broadcast one as a
scalar), every store happens once. Scalars are `tl.float64`/`tl.int64` arguments that are never
specialized on, so a changing learning rate reuses the compiled kernel.

A multi-lane kernel (one lane per tensor of a `_foreach_` list) is ONE launch for all lanes: a
static work table holds (lane, start, end) per program, a per-call table holds every lane's
pointers and scalars (pointers cast with `tl.pointer_type`, float scalars as float64 bits).

The element arithmetic is expressions.py's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from ..lower import KernelSpec, Lane
from .expressions import SIGNATURE_TYPES, TL_TYPES, NotRenderable, element_statements

MAX_BLOCK = 1024  # elements per program: 8 per thread with 4 warps
MIN_BLOCK = 16
# Compile options every launch and every AOT build passes: no contraction of a*b+c into one rounding
# (expr.py: one rounding per primitive, as eager computes), and libdevice keeps float32 subnormals
# (its default flushes them to zero, which eager does not).
OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


@dataclass(frozen=True)
class TritonKernel:
    """A rendered kernel: its source and what a launcher and an AOT build need to know."""

    name: str
    source: str
    signature: dict[str, str] = field(hash=False)  # parameter -> Triton type ("*fp32", "fp64", "i64")
    # one lane: ("input", position), ("target", allocation), ("scalar", k); many: ("work", 0), ("table", 0)
    parameters: tuple[tuple[str, int], ...]
    grid: int  # programs per launch
    num_warps: int
    work: tuple[tuple[int, int, int], ...] = ()  # multi-lane: (lane, start, end) per program
    # a row kernel that sums over all rows: the kernel launched after it (same arguments) that adds
    # the partial sums, and the scratch buffer (elements, dtype) both take as their last argument
    combine: TritonKernel | None = None
    scratch: tuple[int, torch.dtype] | None = None


def render_kernel(spec: KernelSpec) -> TritonKernel:
    """Raises NotRenderable for layouts the renderer does not handle."""
    if spec.row is not None:
        from .rows import render_row

        return render_row(spec, single_signature, declarations, _assemble, _make_row_kernel)
    if len(spec.lanes) == 1:
        name, source, signature, parameters, grid, warps = _render_single(spec)
        work = ()
    else:
        name, source, signature, parameters, grid, warps, work = _render_multi(spec)
    return TritonKernel(name, source, signature, parameters, grid, warps, work)


def kernel_name(spec: KernelSpec, body: str) -> str:
    """A name that tells the group and identifies the source (identical kernels share a name)."""
    return f"tj_{spec.name.split('_')[0]}_{hashlib.sha1(body.encode()).hexdigest()[:12]}"


# -- one lane -------------------------------------------------------------------------------------------

def _block_size(numel: int) -> int:
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << max(numel - 1, 0).bit_length()))


def _warps(block: int) -> int:
    return max(1, min(4, block // 256))


def single_parameters(spec: KernelSpec) -> list[tuple[str, int]]:
    """("input", node input position) per addressed input, ("target", k) per allocation, ("scalar", k)."""
    lane = spec.lanes[0]
    inputs = sorted({i for i, _ in lane.loads} | set(spec.written_inputs))
    params = [("input", i) for i in inputs]
    params += [("target", k) for k in range(len(spec.allocations))]
    params += [("scalar", k) for k in range(len(spec.scalar_types))]
    return params


def single_signature(spec: KernelSpec) -> tuple[list[tuple[str, int]], dict[str, str]]:
    """The parameters of a kernel over one lane and Triton's type for each (`*fp32`, `i64`...)."""
    pointer_types = _pointer_types(spec)
    parameters = single_parameters(spec)
    signature: dict[str, str] = {}
    for kind, index in parameters:
        if kind == "input":
            signature[f"in{index}"] = "*" + SIGNATURE_TYPES[pointer_types[index]]
        elif kind == "target":
            signature[f"out{index}"] = "*" + SIGNATURE_TYPES[spec.allocations[index].dtype]
        else:
            signature[f"s{index}"] = "fp64" if spec.scalar_types[index] is float else "i64"
    return parameters, signature


def declarations(signature: dict[str, str]) -> tuple[list[str], list[str]]:
    """The kernel's parameter list (scalars typed) and its scalar parameters."""
    declared = [f"{p}: {'tl.float64' if t == 'fp64' else 'tl.int64'}" if not t.startswith("*") else p
                for p, t in signature.items()]
    return declared, [p for p, t in signature.items() if not t.startswith("*")]


def _pointer_types(spec: KernelSpec) -> dict[int, torch.dtype]:
    """Element type of each addressed node input (as loaded, or as stored when only written)."""
    lane = spec.lanes[0]
    allocated = len(spec.allocations)
    types = {i: spec.load_dtypes[k] for k, (i, _) in enumerate(lane.loads)}
    for (target, _), (_, dtype) in zip(lane.stores, spec.store_exprs):
        if target >= allocated:
            types.setdefault(spec.written_inputs[target - allocated], dtype)
    return types


def _index_lines(lane: Lane, wide: bool, block: int) -> list[str]:
    """Flat block offsets, the tail mask and the per-dimension indices i0..i{n-1}."""
    if not lane.shape:
        return []
    pid = "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"
    lines = [f"offs = {pid} * {block} + tl.arange(0, {block})"]
    if lane.numel % block:
        lines.append(f"mask = offs < {lane.numel}")
    dims = len(lane.shape)
    if dims == 1:
        return lines
    rest = "offs"
    for d in range(dims - 1, 0, -1):
        lines.append(f"i{d} = {rest} % {lane.shape[d]}")
        lines.append(f"r{d} = {rest} // {lane.shape[d]}")
        rest = f"r{d}"
    return lines + [f"i0 = {rest}"]


def _offset(strides: tuple[int, ...]) -> str | None:
    """The element offset of one tensor; None when every index has stride 0 (one element)."""
    index = ["offs"] if len(strides) == 1 else [f"i{d}" for d in range(len(strides))]
    terms = [i if s == 1 else f"{i} * {s}" for i, s in zip(index, strides) if s != 0]
    if not terms:
        return None
    return terms[0] if len(terms) == 1 else f"({' + '.join(terms)})"


def _wide(lane: Lane, block: int) -> bool:
    spans = [sum((size - 1) * abs(s) for size, s in zip(lane.shape, strides))
             for _, strides in (*lane.loads, *lane.stores)]
    return max([lane.numel, *spans]) + block >= 2**31


def _render_single(spec: KernelSpec):
    lane = spec.lanes[0]
    block = _block_size(lane.numel)
    allocated = len(spec.allocations)
    mask = ", mask=mask" if lane.shape and lane.numel % block else ""

    def address(pointer: str, strides: tuple[int, ...], store: bool) -> tuple[str, str]:
        offset = _offset(strides) if lane.shape else None
        if offset is None:
            if store and lane.numel > 1:
                raise NotRenderable("a store that broadcasts")
            return pointer, ""
        return f"{pointer} + {offset}", mask

    def load(k: int) -> str:
        where, masked = address(f"in{lane.loads[k][0]}", lane.loads[k][1], False)
        return f"tl.load({where}{masked})"

    def store(k: int, value: str) -> str:
        target, strides = lane.stores[k]
        pointer = f"out{target}" if target < allocated else f"in{spec.written_inputs[target - allocated]}"
        where, masked = address(pointer, strides, True)
        return f"tl.store({where}, {value}{masked})"

    statements = _index_lines(lane, _wide(lane, block), block) + element_statements(
        spec, load, lambda k, dtype: f"tl.full([], s{k}, {TL_TYPES[dtype]})", store)
    parameters, signature = single_signature(spec)
    declared, scalars = declarations(signature)
    warps = _warps(block)
    name, source = _assemble(spec, declared, scalars, statements)
    grid = -(-lane.numel // block) if lane.shape else 1
    return name, source, signature, tuple(parameters), grid, warps


def _assemble(spec: KernelSpec, declared: list[str], scalars: list[str], statements: list[str],
              suffix: str = "") -> tuple[str, str]:
    decorator = f"@triton.jit(do_not_specialize={scalars!r})" if scalars else "@triton.jit"
    text = "".join(f"    {line}\n" for line in statements)
    signature = ", ".join(declared)
    name = kernel_name(spec, signature + "\n" + text) + (f"_{suffix}" if suffix else "")
    return name, f"{decorator}\ndef {name}({signature}):\n{text}"


def _make_row_kernel(name, source, signature, parameters, grid, warps, combine=None, scratch=None) -> TritonKernel:
    return TritonKernel(name, source, signature, parameters, grid, warps, combine=combine, scratch=scratch)


# -- many lanes -----------------------------------------------------------------------------------------

def multi_layout(spec: KernelSpec) -> list[bool]:
    """Per tensor slot (operands, then stores) whether it is broadcast (one element per lane)."""
    slots = len(spec.load_dtypes) + len(spec.store_exprs)
    broadcast: list[bool | None] = [None] * slots
    for lane in spec.lanes:
        if len(lane.shape) > 1:
            raise NotRenderable("multi-lane kernels walk flat lanes")
        if lane.numel <= 1:
            continue
        for k, (_, strides) in enumerate((*lane.loads, *lane.stores)):
            flag = strides[0] == 0
            if strides[0] not in (0, 1) or (broadcast[k] is not None and broadcast[k] != flag):
                raise NotRenderable("lanes of a multi-lane kernel must be contiguous or broadcast alike")
            broadcast[k] = flag
    if any(broadcast[len(spec.load_dtypes):]):
        raise NotRenderable("a store that broadcasts")
    return [bool(b) for b in broadcast]


def table_layout(spec: KernelSpec) -> tuple[int, int, list[int]]:
    """(int64 words per lane, float scalars per lane, per scalar its column in its part of the row).

    The per-call table is `lanes` rows of [slot pointers..., int scalars...] followed by `lanes`
    rows of float scalars (their float64 bits)."""
    slots = len(spec.load_dtypes) + len(spec.store_exprs)
    columns, ints, floats = [], 0, 0
    for kind in spec.scalar_types:
        if kind is float:
            columns.append(floats)
            floats += 1
        else:
            columns.append(slots + ints)
            ints += 1
    return slots + ints, floats, columns


def _render_multi(spec: KernelSpec):
    broadcast = multi_layout(spec)
    operands = len(spec.load_dtypes)
    row, floats, columns = table_layout(spec)
    lanes = len(spec.lanes)
    largest = max(lane.numel for lane in spec.lanes)
    block = _block_size(largest)
    work = tuple((j, start, min(start + block, lane.numel)) for j, lane in enumerate(spec.lanes)
                 for start in range(0, lane.numel, block))
    types = [*spec.load_dtypes, *(dtype for _, dtype in spec.store_exprs)]
    head = [
        "w = tl.program_id(0) * 3",
        "lane = tl.load(work + w)",
        "offs = tl.load(work + w + 1) + tl.arange(0, " + str(block) + ")",
        "mask = offs < tl.load(work + w + 2)",
    ]
    head += [f"p{k} = tl.load(table + lane * {row} + {k}).to(tl.pointer_type({TL_TYPES[t]}))"
             for k, t in enumerate(types)]

    def element(k: int) -> tuple[str, str]:
        return (f"p{k}", "") if broadcast[k] else (f"p{k} + offs", ", mask=mask")

    def load(k: int) -> str:
        where, masked = element(k)
        return f"tl.load({where}{masked})"

    def scalar(k: int, dtype: torch.dtype) -> str:
        if spec.scalar_types[k] is float:
            return f"tl.load(table + {lanes * row} + lane * {floats} + {columns[k]}).to(tl.float64, bitcast=True)"
        return f"tl.load(table + lane * {row} + {columns[k]})"

    def store(k: int, value: str) -> str:
        where, masked = element(operands + k)
        return f"tl.store({where}, {value}{masked})"

    name, source = _assemble(spec, ["work", "table"], [], head + element_statements(spec, load, scalar, store))
    signature = {"work": "*i64", "table": "*i64"}
    return name, source, signature, (("work", 0), ("table", 0)), len(work), _warps(block), work
