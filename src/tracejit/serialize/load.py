"""`tracejit.load`: read a dump file, validate all of it, compile a graph for the local backend.

Validation, in order: the container (zip magic, exactly the two members, declared and actual
sizes, compression ratio), the document (magic, version, every field's type and range), the
tensors (each referenced one's dtype and shape against the document, none unreferenced), the ops
(the op rule of validate.py, arguments against the schema), the graph's structure (values
defined once, before use) and the metadata of every op's results (fake-tensor propagation).
Every failure is a `LoadError`; nothing in the file is imported, unpickled or evaluated.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..errors import LoadError
from ..ir.verify import GraphVerificationError, verify
from ..options import BACKENDS
from .container import read_bytes, unpack
from .format import decode
from .loaded import LoadedGraph
from .portable import PortableGraph, default_dtype, to_graph
from .validate import check_graph


def read_graphs(source: Any) -> list[PortableGraph]:
    """Every graph of a file, fully validated (no compilation). A path, file object or bytes."""
    data = read_bytes(source)  # TypeError for a wrong kind of argument, LoadError for an unreadable file
    try:
        graph_json, tensors = unpack(data)
        return [_validated(graph) for graph in decode(graph_json, tensors)]
    except LoadError:
        raise
    except Exception as error:  # a safety net: any other failure on file data is still a LoadError
        raise LoadError(f"invalid tracejit graph file: {type(error).__name__}: {str(error)[:300]}") from error


def _validated(graph: PortableGraph) -> PortableGraph:
    devices = {v.meta.device for v in graph.values} | {i.meta.device for i in graph.inputs}
    for device in devices:
        if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
            raise LoadError(f"graph {graph.name!r} runs on {device}, which this machine does not have")
    try:
        with default_dtype(graph.default_dtype):
            verify(to_graph(graph), metadata=False)  # check_graph compares the metadata, naming the op
    except GraphVerificationError as error:
        problems = str(error).splitlines()[1:4]
        raise LoadError(f"graph {graph.name!r} is malformed: {'; '.join(p.strip() for p in problems)}") from None
    check_graph(graph)
    constants = [replace(c, tensor=c.tensor.to(graph.values[c.value].meta.device)) for c in graph.constants]
    return replace(graph, constants=constants)


def load(file: Any, *, backend: str = "auto", profiling: bool = False, name: str | None = None) -> LoadedGraph:
    """Load a graph written by `traced.dump()` and compile it for this machine.

    file: a path, a binary file object or the file's bytes.
    backend: the fused-kernel backend, as for `tracejit.trace` ("auto", "c", "triton", "aten", "reference").
    profiling: time every node; see `get_profile()`.
    name: which graph of a file holding several (dumped with append=True); default: the only one.
    """
    if backend not in BACKENDS:
        raise ValueError(f"tracejit.load: backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if not isinstance(profiling, bool):
        raise TypeError(f"tracejit.load: profiling must be a bool, got {profiling!r}")
    return compile_graph(select(read_graphs(file), name), backend, profiling)


def compile_graph(graph: PortableGraph, backend: str = "auto", profiling: bool = False) -> LoadedGraph:
    """A validated graph compiled for this machine (the last step of `load`)."""
    try:
        return LoadedGraph(graph, backend=backend, profiling=profiling)
    except Exception as error:  # the graph passed validation: say where compiling it failed
        raise LoadError(f"graph {graph.name!r} is valid but could not be compiled: {type(error).__name__}: "
                        f"{str(error)[:300]}") from error


def select(graphs: list[PortableGraph], name: str | None, option: str = "name=") -> PortableGraph:
    """The graph named `name`, or the only one; `option` is how the caller names a graph in the
    message (`--graph NAME` on the command line)."""
    names = [g.name for g in graphs]
    if name is None:
        if len(graphs) > 1:
            raise LoadError(f"tracejit.load: the file holds {len(graphs)} graphs ({', '.join(names)}); pass "
                             f"{option} to choose one")
        return graphs[0]
    for graph in graphs:
        if graph.name == name:
            return graph
    raise LoadError(f"tracejit.load: the file holds no graph named {name!r}; it holds {', '.join(names)}")
