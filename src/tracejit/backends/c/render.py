"""KernelSpec -> C source: one function per fused kernel, all of a graph in one translation unit.

A one-lane kernel takes one pointer per tensor and one argument per dynamic scalar:

    void k(const float* restrict in0, float* restrict in2, float* restrict out0, double s0)

and runs nested loops over its (merged) iteration space with the strides baked in; the innermost
loop is what the compiler vectorizes, the outermost is split across OpenMP threads when the
kernel is large enough to pay for the fork. A multi-lane kernel (one lane per tensor of a
`_foreach_` list) takes arrays instead, `k(void* const* ptrs, const double* sd, const int64_t* si)`,
lane by lane, and splits a static table of (lane, block) work items across threads.
"""

from __future__ import annotations

import math

import torch

from ..expr import TRANSCENDENTAL, Expr
from ..lower import KernelSpec, live_exprs
from ..optable import Unsupported
from .mathlib import FLOAT_FUNCTIONS, math_source

C_TYPES = {
    torch.float32: "float", torch.float64: "double", torch.int64: "int64_t", torch.int32: "int32_t",
    torch.int16: "int16_t", torch.int8: "int8_t", torch.uint8: "uint8_t", torch.bool: "bool",
}
PARALLEL_MIN_ELEMENTS = 1 << 15  # below this an OpenMP fork costs more than it saves
BLOCK = 1 << 14  # elements per work item of a split flat loop

_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
          "eq": "==", "ne": "!=", "and": "&&", "or": "||", "xor": "!="}
_ROUNDING = {"floor": "floor", "ceil": "ceil", "trunc": "trunc", "round": "rint"}


def prelude(specs: list[KernelSpec]) -> str:
    """Includes, the zeros of _cast and the math functions the kernels use."""
    used = {FLOAT_FUNCTIONS[e.op][0] for s in specs for e in s.exprs
            if e.op in TRANSCENDENTAL and e.dtype == torch.float32}
    return ("#include <stdint.h>\n#include <stdbool.h>\n#include <stdlib.h>\n#include <string.h>\n#include <math.h>\n"
            "static volatile float tj_zero_f_storage = 0.0f;\nstatic volatile double tj_zero_d_storage = 0.0;\n"
            + math_source(used))


# read once per kernel call, before the loops (a volatile read inside would stop vectorization)
_ZERO = {torch.float32: "tj_zero_f", torch.float64: "tj_zero_d"}
_ZERO_LOADS = "  const float tj_zero_f = tj_zero_f_storage; const double tj_zero_d = tj_zero_d_storage;\n"


def _zero_loads(body: list[str]) -> str:
    return _ZERO_LOADS if any("tj_zero" in line for line in body) else ""


def render_kernel(spec: KernelSpec, name: str) -> str:
    if spec.row is not None:
        from .rows import render_row_kernel

        return render_row_kernel(spec, name)
    if len(spec.lanes) == 1:
        return _render_single(spec, name)
    return _render_multi(spec, name)


# -- expressions --------------------------------------------------------------------------------------

def _literal(value, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "1" if value else "0"
    if not dtype.is_floating_point:
        return f"((int64_t){int(value)}LL)"
    suffix = "f" if dtype == torch.float32 else ""
    if math.isnan(value):
        return f"__builtin_nan{suffix}(\"\")"
    if math.isinf(value):
        return f"({'-' if value < 0 else ''}__builtin_inf{suffix}())"
    return f"{float(value).hex()}{suffix}"


def _cast(value: str, source: torch.dtype | None, target: torch.dtype) -> str:
    """`value` converted as eager converts on x86: to bool by `!= 0`; from floating point to an
    integer type through int32 (int64 for int64) with out-of-range values and NaN giving the minimum
    (what cvttss2si returns), then truncated to the target's bits. A plain C cast of such values is
    undefined behaviour and, vectorized, gave trunc-like results (issue 11)."""
    t = C_TYPES[target]
    if target == torch.bool:
        return f"(({value}) != 0)"
    if target.is_floating_point and source is not None and not source.is_floating_point and source != torch.bool:
        # Under -fno-trapping-math GCC turns (float)(int)x into truncf(x), which is -0.0 for x in
        # (-1, -0.0] where the conversions give +0.0. Adding zero mends it (-0.0 + 0.0 is +0.0), a
        # zero the compiler cannot see (it drops a literal `+ 0.0`, knowing (float)int is never -0.0).
        return f"(({t})({value}) + {_ZERO[target]})"
    if source is not None and source.is_floating_point and not target.is_floating_point:
        if target == torch.int64:
            return f"((({value}) >= -0x1p63 && ({value}) < 0x1p63) ? (int64_t)({value}) : INT64_MIN)"
        return f"(({t})((({value}) >= -0x1p31 && ({value}) < 0x1p31) ? (int32_t)({value}) : INT32_MIN))"
    return f"(({t})({value}))"


def expression(expr: Expr, names: list[str], load, scalar, types: list | None = None) -> str:
    op, a = expr.op, [names[i] for i in expr.args]
    source = types[expr.args[0]] if types is not None and expr.args else None
    t = C_TYPES[expr.dtype]
    floating = expr.dtype.is_floating_point
    f = "f" if expr.dtype == torch.float32 else ""
    if op == "load":
        return load(expr.value)
    if op == "scalar":
        return scalar(expr.value)
    if op == "const":
        return _literal(expr.value, expr.dtype)
    if op == "cast":
        return _cast(a[0], source, expr.dtype)
    if op in _INFIX:
        return f"({a[0]} {_INFIX[op]} {a[1]})"
    if op == "neg":
        return f"(-{a[0]})"
    if op == "not":
        return f"(!{a[0]})"
    if op == "abs":
        return f"fabs{f}({a[0]})" if floating else f"({a[0]} < 0 ? -{a[0]} : {a[0]})"
    if op == "isnan":
        return f"({a[0]} != {a[0]})"
    if op == "where":
        return f"({a[0]} ? {a[1]} : {a[2]})"
    if op in ("maximum", "minimum"):
        # equal operands (+0.0 and -0.0) give the second, as eager's vectorized loops do (its
        # scalar tail gives the first: eager disagrees with itself there)
        pick = ">" if op == "maximum" else "<"
        chosen = f"({a[0]} {pick} {a[1]} ? {a[0]} : {a[1]})"
        return f"({a[0]} != {a[0]} ? {a[0]} : ({a[1]} != {a[1]} ? {a[1]} : {chosen}))" if floating else chosen
    if op == "sign":
        return f"(({t})(({a[0]} > 0) - ({a[0]} < 0)))"
    if op in _ROUNDING:
        return f"__builtin_{_ROUNDING[op]}{f}({a[0]})" if floating else a[0]
    if op == "sqrt":
        return f"sqrt{f}({a[0]})"
    if op == "rsqrt":
        return f"(({t})1 / sqrt{f}({a[0]}))"
    if op == "reciprocal":
        return f"(({t})1 / {a[0]})"
    if op in TRANSCENDENTAL:
        single, double = FLOAT_FUNCTIONS[op]
        return f"{single}({a[0]})" if expr.dtype == torch.float32 else double.format(a[0])
    raise ValueError(f"the C backend cannot render primitive {op!r}")


def _body(spec: KernelSpec, load, scalar, store) -> list[str]:
    """Statements computing one element: each needed expression once, then the stores."""
    needed = live_exprs(spec)
    types = [e.dtype for e in spec.exprs]
    names: list[str] = []
    lines = []
    for index, expr in enumerate(spec.exprs):
        names.append(f"v{index}")
        if index in needed:
            lines.append(f"{C_TYPES[expr.dtype]} v{index} = {expression(expr, names, load, scalar, types)};")
    for k, (ref, dtype) in enumerate(spec.store_exprs):
        lines.append(store(k, f"(({C_TYPES[dtype]})v{ref})"))
    return lines



# -- one lane -----------------------------------------------------------------------------------------

def single_parameters(spec: KernelSpec) -> list[tuple[str, str]]:
    """(kind, name) of each C parameter: ("input", i), ("target", k), ("scalar", k), in order."""
    lane = spec.lanes[0]
    inputs = sorted({i for i, _ in lane.loads} | set(spec.written_inputs))
    allocated = len(spec.allocations)
    params = [("input", i) for i in inputs]
    params += [("target", k) for k in range(allocated)]
    params += [("scalar", k) for k in range(len(spec.scalar_types))]
    return params


def single_declarations(spec: KernelSpec) -> list[str]:
    """The C parameter declarations of a one-lane kernel, in `single_parameters` order."""
    lane = spec.lanes[0]
    allocated = len(spec.allocations)
    written = set(spec.written_inputs)
    input_types = {}
    for k, (i, _) in enumerate(lane.loads):
        input_types[i] = C_TYPES[spec.load_dtypes[k]]
    for (target, _), (_, dtype) in zip(lane.stores, spec.store_exprs):
        if target >= allocated:
            input_types[spec.written_inputs[target - allocated]] = C_TYPES[dtype]
    decls = []
    for kind, index in single_parameters(spec):
        if kind == "input":
            const = "" if index in written else "const "
            decls.append(f"{const}{input_types[index]}* restrict in{index}")
        elif kind == "target":
            decls.append(f"{C_TYPES[spec.allocations[index].dtype]}* restrict out{index}")
        else:
            decls.append(f"{'double' if spec.scalar_types[index] is float else 'int64_t'} s{index}")
    return decls


def _render_single(spec: KernelSpec, name: str) -> str:
    lane = spec.lanes[0]
    allocated = len(spec.allocations)
    decls = single_declarations(spec)
    dims = len(lane.shape)
    index_vars = [f"i{d}" for d in range(dims)]

    def offset(strides: tuple[int, ...]) -> str:
        terms = [f"{i}*{s}" if s != 1 else i for i, s in zip(index_vars, strides) if s != 0]
        return " + ".join(terms) or "0"

    def target_name(target: int) -> str:
        return f"out{target}" if target < allocated else f"in{spec.written_inputs[target - allocated]}"

    body = _body(
        spec,
        load=lambda k: f"in{lane.loads[k][0]}[{offset(lane.loads[k][1])}]",
        scalar=lambda k: f"s{k}",
        store=lambda k, value: f"{target_name(lane.stores[k][0])}[{offset(lane.stores[k][1])}] = {value};",
    )
    return (f"void {name}({', '.join(decls) or 'void'}) {{\n" + _zero_loads(body)
            + _loops(lane.shape, index_vars, body) + "}\n")


def _loops(shape: tuple[int, ...], index_vars: list[str], body: list[str]) -> str:
    numel = math.prod(shape)
    if not shape:
        return "".join(f"  {line}\n" for line in ["const int64_t i = 0; (void)i;", *body])
    lines = []
    parallel = numel >= PARALLEL_MIN_ELEMENTS
    if len(shape) == 1 and parallel:
        blocks = -(-shape[0] // BLOCK)
        lines += ["#pragma omp parallel for schedule(static)",
                  f"for (int64_t b = 0; b < {blocks}; b++) {{",
                  f"  const int64_t end = b * {BLOCK} + {BLOCK} < {shape[0]} ? b * {BLOCK} + {BLOCK} : {shape[0]};",
                  f"  for (int64_t i0 = b * {BLOCK}; i0 < end; i0++) {{"]
        closing = ["  }", "}"]
        indent = "    "
    else:
        if parallel and shape[0] > 1:
            lines.append("#pragma omp parallel for schedule(static)")
        closing = []
        indent = ""
        for d, size in enumerate(shape):
            lines.append(f"{indent}for (int64_t {index_vars[d]} = 0; {index_vars[d]} < {size}; {index_vars[d]}++) {{")
            closing.insert(0, f"{indent}}}")
            indent += "  "
    lines += [indent + line for line in body] + closing
    return "".join(f"  {line}\n" for line in lines)


# -- many lanes -----------------------------------------------------------------------------------------

def multi_layout(spec: KernelSpec) -> tuple[list[bool], list[int]]:
    """Per tensor slot (operands, then stores) whether it is broadcast (one element); per lane its size.
    Raises Unsupported for lanes it cannot walk flat (the group then runs through the reference kernel)."""
    slots = len(spec.load_dtypes) + len(spec.store_exprs)
    broadcast = [None] * slots
    for lane in spec.lanes:
        if len(lane.shape) > 1:
            raise Unsupported("multi-lane kernels walk flat lanes")
        if lane.numel <= 1:
            continue
        strides = [s for _, s in lane.loads] + [s for _, s in lane.stores]
        for k, stride in enumerate(strides):
            flag = stride[0] == 0
            if stride[0] not in (0, 1) or (broadcast[k] is not None and broadcast[k] != flag):
                raise Unsupported("lanes of a multi-lane kernel must be contiguous or broadcast alike")
            broadcast[k] = flag
    return [bool(b) for b in broadcast], [lane.numel for lane in spec.lanes]


def _render_multi(spec: KernelSpec, name: str) -> str:
    broadcast, sizes = multi_layout(spec)
    operands = len(spec.load_dtypes)
    slots = operands + len(spec.store_exprs)
    scalars = len(spec.scalar_types)
    work = [(lane, start) for lane, size in enumerate(sizes) for start in range(0, max(size, 1), BLOCK)]
    table_lane = ", ".join(str(lane) for lane, _ in work)
    table_start = ", ".join(str(start) for _, start in work)
    lane_sizes = ", ".join(str(max(size, 0)) for size in sizes)
    types = [C_TYPES[d] for d in spec.load_dtypes] + [C_TYPES[d] for _, d in spec.store_exprs]
    scalar_kind = ["sd" if t is float else "si" for t in spec.scalar_types]

    alias = _store_aliases(spec)

    def element(slot: int) -> str:
        slot = alias.get(slot, slot)
        return f"a{slot}[{'0' if broadcast[slot] else 'i'}]"

    body = _body(
        spec,
        load=lambda k: element(k),
        scalar=lambda k: f"{scalar_kind[k]}[lane * {max(scalars, 1)} + {k}]",
        store=lambda k, value: f"{element(operands + k)} = {value};",
    )
    parallel = "#pragma omp parallel for schedule(static)\n" if spec.numel >= PARALLEL_MIN_ELEMENTS else ""
    inner = "".join(f"      {line}\n" for line in body)
    return (
        f"static const int32_t {name}_lane[{len(work)}] = {{{table_lane}}};\n"
        f"static const int64_t {name}_start[{len(work)}] = {{{table_start}}};\n"
        f"static const int64_t {name}_size[{len(sizes)}] = {{{lane_sizes}}};\n"
        f"void {name}(void* const* ptrs, const double* sd, const int64_t* si) {{\n"
        f"  (void)sd; (void)si;\n"
        f"{_zero_loads(body)}"
        f"{parallel}"
        f"  for (int64_t w = 0; w < {len(work)}; w++) {{\n"
        f"    const int64_t lane = {name}_lane[w];\n"
        f"    void* const* p = ptrs + lane * {slots};\n"
        + "".join(f"    {types[k]}* restrict a{k} = ({types[k]}*)p[{k}];\n" for k in range(slots) if k not in alias) +
        f"    const int64_t start = {name}_start[w];\n"
        f"    const int64_t end = start + {BLOCK} < {name}_size[lane] ? start + {BLOCK} : {name}_size[lane];\n"
        f"    for (int64_t i = start; i < end; i++) {{\n"
        f"{inner}"
        f"    }}\n"
        f"  }}\n"
        f"}}\n"
    )


def _store_aliases(spec: KernelSpec) -> dict[int, int]:
    """Store slot -> operand slot when an in-place store writes the tensor that operand reads, so one
    pointer serves both (two `restrict` pointers to one tensor would be undefined behaviour)."""
    operands = len(spec.load_dtypes)
    allocated = len(spec.allocations)
    aliases = {}
    for k in range(len(spec.store_exprs)):
        targets = [spec.written_inputs[lane.stores[k][0] - allocated] if lane.stores[k][0] >= allocated else None
                   for lane in spec.lanes]
        if None in targets:
            continue
        for m in range(operands):
            if all(lane.loads[m][0] == target for lane, target in zip(spec.lanes, targets)):
                aliases[operands + k] = m
                break
    return aliases
