"""Graph -> deterministic Python-like text, and a numbered tabular listing."""

from __future__ import annotations

from ..record.record import render_statics
from .graph import INPUT_OPS, Graph, Node, Op, Value


def value_name(value: Value) -> str:
    return f"t{value.handle}" if value.version == 0 else f"t{value.handle}_{value.version}"


def _name(graph: Graph, value_id: int | None) -> str:
    """Name of a value id; robust to the broken graphs verify() prints."""
    if value_id is None:
        return "_"
    if not 0 <= value_id < len(graph.values):
        return f"<bad value {value_id}>"
    return value_name(graph.values[value_id])


def _meta(value: Value) -> str:
    meta = value.meta
    dtype = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64",
             "int32": "i32", "bool": "b8"}.get(str(meta.dtype).removeprefix("torch."), str(meta.dtype))
    return f"{meta.device.type} {dtype}[{','.join(map(str, meta.shape))}]"


def _call_text(graph: Graph, node: Node) -> str:
    names = [_name(graph, v) for v in node.inputs]
    args = render_statics(node.statics, names, node.scalars)
    return f"{node.name}({args})"


def _lhs(graph: Graph, node: Node) -> str:
    outs = [_name(graph, v) for v in node.outputs]
    if node.writes and not outs:
        outs = [_name(graph, v) for v in node.writes]
    return ", ".join(outs) + " = " if outs else ""


def _comment(graph: Graph, node: Node) -> str:
    parts = [", ".join(_meta(graph.values[v]) for v in node.outputs if v is not None and v < len(graph.values))]
    if node.buffer is not None:
        offset, nbytes = node.buffer
        parts.append(f"arena[{offset}:{offset + nbytes}]")
    if node.static_view:
        parts.append("static view")
    if any(b is not None for b in node.buffers):
        parts.append("arena" + ",".join(f"[{b[0]}:{b[0] + b[1]}]" if b else "-" for b in node.buffers))
    if node.source is not None and node.source.filename:
        parts.append(str(node.source))
    return "  # " + "  ".join(p for p in parts if p)


def format_graph(graph: Graph) -> str:
    inputs = [n for n in graph.nodes if n.op in (Op.ARG, Op.KWARG)]
    params = ", ".join(f'{value_name(graph.values[n.outputs[0]])}: "{_meta(graph.values[n.outputs[0]])}"'
                       for n in inputs)
    lines = [f"# produced by {graph.provenance}", f"def {graph.function_name}({params}):"]
    for node in graph.nodes:
        if node.op in (Op.EXTERNAL, Op.CONST):
            value = graph.values[node.outputs[0]]
            lines.append(f"  {value_name(value)} = {node.op.value}({node.input_name!r})  # {_meta(value)}")
    for node in graph.nodes:
        if node.op in INPUT_OPS:
            continue
        text = f"  {_lhs(graph, node)}{_call_text(graph, node) if node.op is Op.CALL else _fused_text(graph, node)}"
        lines.append(f"{text:<64}{_comment(graph, node)}")
        for member in node.members:
            lines.append(f"    # {_lhs(graph, member)}{_call_text(graph, member)}")
    outs = ", ".join(_name(graph, v) for v in graph.outputs)
    lines.append(f"  return ({outs}{',' if len(graph.outputs) == 1 else ''})")
    return "\n".join(lines)


def _fused_text(graph: Graph, node: Node) -> str:
    names = ", ".join(_name(graph, v) for v in node.inputs)
    return f"{node.name}({names})"


def tabular(graph: Graph) -> str:
    """One numbered row per node: index, op, inputs, outputs, record positions."""
    rows = [f"{'#':>4}  {'op':<40} {'inputs':<24} {'outputs':<20} positions"]
    for i, node in enumerate(graph.nodes):
        ins = " ".join(_name(graph, v) for v in node.inputs)
        outs = " ".join(_name(graph, v) for v in node.outputs if v is not None)
        pos = ",".join(map(str, node.positions))
        rows.append(f"{i:>4}  {node.name:<40} {ins:<24} {outs:<20} {pos}")
    return "\n".join(rows)
