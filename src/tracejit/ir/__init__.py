"""The graph IR: Graph, Node, Value; building from a record; printing; verification."""

from .build import build_graph
from .graph import Graph, Node, Op, Value
from .printer import format_graph, tabular
from .to_fx import to_fx
from .verify import GraphVerificationError, verify

__all__ = ["Graph", "GraphVerificationError", "Node", "Op", "Value", "build_graph", "format_graph", "tabular",
           "to_fx", "verify"]
