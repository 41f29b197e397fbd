"""A chain of small matrix products (passes/chain_linear.py) as one C function, and its launcher.

    void k(const float* restrict in0, const float* restrict in1, ..., float* restrict out0)

computes each product of the chain in turn, the intermediates in arrays on the stack, the last
into the output. Shapes and strides are baked in, as in every kernel; the launcher runs the
chain through aten when it is handed tensors of another layout. A product whose weight is read
along the inner dimension (`F.linear`'s `weight.t()`) is a dot product per output with sixteen
partial sums the compiler keeps in vector registers; one whose weight is read along the columns
accumulates a row of outputs per inner index, the innermost loop over columns.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...ir.graph import Graph, Node
from ...passes.chain_linear import LINEAR_OPS, product_shape
from ..optable import Unsupported
from .render import C_TYPES

aten = torch.ops.aten
PARTIAL_SUMS = 16
LINEAR_DTYPES = frozenset({torch.float32, torch.float64})


@dataclass(frozen=True)
class Product:
    rows: int
    inner: int
    columns: int
    left: int | None  # index into node.inputs; None: the previous product's result
    weight: int
    bias: int | None
    relu: bool


@dataclass(frozen=True)
class LinearChain:
    """What the C function of a linear group computes, with the layouts it was specialized for."""

    products: tuple[Product, ...]
    dtype: torch.dtype
    strides: tuple[tuple[int, ...], ...]  # per node input
    output_shape: tuple[int, ...]
    output_stride: tuple[int, ...]
    output_device: torch.device


def lower_linear(graph: Graph, node: Node) -> LinearChain:
    position = {v: i for i, v in enumerate(node.inputs)}
    products = []
    for k, member in enumerate(node.members):
        shape = product_shape(graph, member)
        if shape is None:
            raise Unsupported(f"{member.name} is not a small product")
        roles = dict(zip(LINEAR_OPS[member.target], member.inputs))
        left = None if k else position[roles["left"]]
        if k and roles["left"] != node.members[k - 1].outputs[0]:
            raise Unsupported(f"{member.name} does not multiply the previous product")
        products.append(Product(*shape, left, position[roles["weight"]],
                                position[roles["bias"]] if "bias" in roles else None,
                                member.target is aten._addmm_activation.default))
    metas = [graph.values[v].meta for v in node.inputs]
    out = graph.values[node.outputs[0]].meta
    dtypes = {m.dtype for m in metas} | {out.dtype}
    if len(dtypes) != 1 or out.dtype not in LINEAR_DTYPES:
        raise Unsupported(f"{node.name} mixes or uses types a linear kernel does not take: {sorted(map(str, dtypes))}")
    return LinearChain(tuple(products), out.dtype, tuple(tuple(m.stride) for m in metas), tuple(out.shape),
                       tuple(out.stride), out.device)


def render_linear(chain: LinearChain, name: str) -> str:
    ctype = C_TYPES[chain.dtype]
    inputs = ", ".join(f"const {ctype}* restrict in{i}" for i in range(len(chain.strides)))
    lines = [f"void {name}({inputs}, {ctype}* restrict out0) {{"]
    source, source_stride = None, None
    for k, p in enumerate(chain.products):
        if p.left is not None:
            source, source_stride = f"in{p.left}", chain.strides[p.left]
        last = k == len(chain.products) - 1
        if last:
            target, target_stride = "out0", chain.output_stride
        else:
            target, target_stride = f"t{k}", (p.columns, 1)
            lines.append(f"  {ctype} t{k}[{p.rows * p.columns}];")
        lines += [f"  {line}" for line in _product(p, ctype, source, source_stride, target, target_stride,
                                                   chain.strides)]
        source, source_stride = target, target_stride
    lines.append("}")
    return "\n".join(lines) + "\n"


def _product(p: Product, ctype: str, left: str, left_stride: tuple, target: str, target_stride: tuple,
             strides: tuple) -> list[str]:
    w0, w1 = strides[p.weight]
    x = f"{left}[m * {left_stride[0]} + {{k}} * {left_stride[1]}]"
    out = f"{target}[m * {target_stride[0]} + n * {target_stride[1]}]"
    bias = f" + in{p.bias}[n * {strides[p.bias][0]}]" if p.bias is not None else ""
    finish = f"{ctype} v = {{sum}}{bias}; {out} = {'v < 0 ? 0 : v' if p.relu else 'v'};"
    lines = [f"for (int64_t m = 0; m < {p.rows}; m++) {{"]
    if w0 == 1 or w1 != 1:  # a dot product per output, along the weight's inner dimension
        lines += [
            f"  for (int64_t n = 0; n < {p.columns}; n++) {{",
            f"    {ctype} acc[{PARTIAL_SUMS}] = {{0}};",
            "    int64_t k = 0;",
            f"    for (; k + {PARTIAL_SUMS} <= {p.inner}; k += {PARTIAL_SUMS})",
            f"      for (int j = 0; j < {PARTIAL_SUMS}; j++)",
            f"        acc[j] += {x.format(k='(k + j)')} * in{p.weight}[(k + j) * {w0} + n * {w1}];",
            f"    {ctype} sum = 0;",
            f"    for (int j = 0; j < {PARTIAL_SUMS}; j++) sum += acc[j];",
            f"    for (; k < {p.inner}; k++) sum += {x.format(k='k')} * in{p.weight}[k * {w0} + n * {w1}];",
            f"    {finish.format(sum='sum')}",
            "  }",
        ]
    else:  # a row of outputs per inner index, along the weight's columns
        lines += [
            f"  for (int64_t n = 0; n < {p.columns}; n++) {out} = 0;",
            f"  for (int64_t k = 0; k < {p.inner}; k++) {{",
            f"    const {ctype} xv = {x.format(k='k')};",
            # unrolled whole, a narrow row (16 columns) is vectorized across k with shuffles: 7x slower
            "#pragma GCC unroll 1",
            f"    for (int64_t n = 0; n < {p.columns}; n++) {out} += xv * in{p.weight}[k * {w0} + n];",
            "  }",
            f"  for (int64_t n = 0; n < {p.columns}; n++) {{ {finish.format(sum=out)} }}",
        ]
    return [*lines, "}"]


def make_linear_launcher(chain: LinearChain, function: Any, fallback: Callable, name: str) -> Callable:
    """`kernel(inputs, s, outs=None)`: the chain's C function on the inputs' memory."""
    count = len(chain.strides)
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * (count + 1)
    namespace: dict[str, Any] = {"FN": function, "FALLBACK": fallback, "EMPTY": torch.empty_strided,
                                 "D": chain.dtype, "V": chain.output_device}
    names = [f"x{i}" for i in range(count)]
    checks = " or ".join(f"x{i}.stride() != {stride!r}" for i, stride in enumerate(chain.strides))
    fresh = f"EMPTY({chain.output_shape!r}, {chain.output_stride!r}, dtype=D, device=V)"
    pointers = ", ".join(f"{n}.data_ptr()" for n in [*names, "o0"])
    source = "\n".join([
        f"def {name}(inputs, s, outs=None):",
        f"    {', '.join(names)}{',' if count == 1 else ''} = inputs",
        f"    if {checks}: return FALLBACK(inputs, s, outs)",
        f"    o0 = outs[0] if outs is not None and outs[0] is not None else {fresh}",
        f"    FN({pointers})",
        "    return (o0,)",
    ]) + "\n"
    exec(compile(source, f"<tracejit C launcher {name}>", "exec"), namespace)
    launcher = namespace[name]
    launcher.spec = chain
    return launcher
