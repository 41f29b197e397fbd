"""Dumping traced graphs for inference and loading them without the code that defined them."""

from .dump import DumpInfo, dump_trace
from .load import load, read_graphs
from .loaded import LoadedGraph

__all__ = ["DumpInfo", "LoadedGraph", "dump_trace", "load", "read_graphs"]
