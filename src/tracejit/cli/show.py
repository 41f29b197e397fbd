"""`tracejit show FILE`: what a dumped file holds, as text or as graphviz DOT. Nothing is compiled
or run; the file is validated exactly as `tracejit.load` validates it."""

from __future__ import annotations

import argparse
import json

from ..ir.printer import format_graph
from ..serialize import read_graphs
from ..serialize.load import select
from ..serialize.portable import PortableGraph, to_graph


def show_file(args: argparse.Namespace) -> int:
    graphs = read_graphs(args.file)
    if args.graph is not None:
        graphs = [select(graphs, args.graph, option="--graph NAME")]
    texts = [to_dot(g) if args.dot else describe(g) for g in graphs]
    print("\n\n".join(texts))
    return 0


def describe(graph: PortableGraph) -> str:
    lines = [f"graph {graph.name}"]
    lines += [f"  input  {i.name}: {i.meta}" + ("" if i.value is not None else "  (unused)") for i in graph.inputs]
    for index, output in enumerate(graph.outputs):
        lines.append(f"  output {output.name if output.name is not None else index}: {graph.values[output.value].meta}")
    nbytes = sum(c.tensor.numel() * c.tensor.element_size() for c in graph.constants)
    lines.append(f"  parameters: {len(graph.constants)} tensors, {graph.parameter_numel()} values, {nbytes} bytes")
    for index, constant in enumerate(graph.constants):
        meta = graph.values[constant.value].meta
        lines.append(f"    {constant.name or f'constant {index}'}: {meta}")
    lines.append(f"  ops: {len(graph.ops)}")
    lines += [f"    {count:>5}  {name}" for name, count in graph.op_counts().items()]
    if graph.testcases:
        lines.append(f"  test cases: {len(graph.testcases)}, maxerr {graph.testcases[0].maxerr:g}"
                     + ("" if graph.testcases[0].outputs is not None else " (no reference outputs)"))
    if graph.user_info is not None:
        lines.append(f"  user_info: {json.dumps(graph.user_info)}")
    if graph.metadata is not None:
        lines.append(f"  metadata: {json.dumps(graph.metadata)}")
    lines += ["", format_graph(to_graph(graph))]
    return "\n".join(lines)


def _quote(text: str) -> str:
    return json.dumps(text)  # a valid DOT string: quotes and backslashes escaped


def to_dot(graph: PortableGraph) -> str:
    """Inputs, parameters, ops and outputs as nodes; an edge for each value an op reads."""
    lines = [f"digraph {_quote(graph.name)} {{", "  rankdir=TB;", "  node [fontname=\"monospace\", fontsize=10];"]
    producer: dict[int, str] = {}
    for index, item in enumerate(graph.inputs):
        if item.value is not None:
            producer[item.value] = f"in{index}"
            lines.append(f"  in{index} [shape=ellipse, label={_quote(f'{item.name}: {item.meta}')}];")
    for index, constant in enumerate(graph.constants):
        producer[constant.value] = f"param{index}"
        label = f"{constant.name or f'constant {index}'}\n{graph.values[constant.value].meta}"
        lines.append(f"  param{index} [shape=box, style=dashed, label={_quote(label)}];")
    for index, op in enumerate(graph.ops):
        label = op.name + (f"\n{op.source}" if op.source is not None else "")
        lines.append(f"  op{index} [shape=box, style=rounded, label={_quote(label)}];")
        for vid in op.inputs:
            if vid in producer:
                lines.append(f"  {producer[vid]} -> op{index};")
        for vid in (*op.outputs, *op.writes):
            if vid is not None:
                producer[vid] = f"op{index}"
    for index, output in enumerate(graph.outputs):
        name = output.name if output.name is not None else str(index)
        lines.append(f"  out{index} [shape=ellipse, style=bold, label={_quote(f'{name}: {graph.values[output.value].meta}')}];")
        if output.value in producer:
            lines.append(f"  {producer[output.value]} -> out{index};")
    lines.append("}")
    return "\n".join(lines)
