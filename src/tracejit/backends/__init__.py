"""Fused-kernel backends behind one interface (see base.py), chosen by the `backend=` option.

`auto` (the default) picks per device: the C backend for CPU tensors when a C compiler works,
Triton for CUDA tensors when Triton is installed; the `TRACEJIT_BACKEND` environment variable
replaces `auto` with a fixed choice. `aten` fuses nothing. `reference` groups like a compiled
backend but runs every group op by op through aten, for tests and for bisecting a miscompile.
"""

from __future__ import annotations

import os

from ..ir.graph import Graph, Node
from ..options import BACKENDS
from .base import Backend, Kernel, device_of
from .reference import ReferenceKernel


class ReferenceBackend(Backend):
    """Groups what the op table covers, on any device and dtype; kernels run op by op."""

    name = "reference"

    def can_fuse(self, graph: Graph, node: Node) -> bool:
        from .optable import entry_for

        if entry_for(node.target) is None:
            return False
        devices = {graph.values[v].meta.device for v in (*node.inputs, *(o for o in node.outputs if o is not None))}
        return len(devices) == 1

    def can_fuse_row(self, graph: Graph, node: Node) -> bool:
        from .base import _lowers_alone
        from .rows import is_row_op

        return is_row_op(node.target) and self.can_fuse_devices(graph, node) and _lowers_alone(graph, node)

    def can_chain_linear(self, graph: Graph, node: Node) -> bool:
        from .c.linear import LINEAR_DTYPES

        return self.can_fuse_devices(graph, node) and all(graph.values[v].meta.dtype in LINEAR_DTYPES
                                                          for v in node.inputs)

    def can_fuse_devices(self, graph: Graph, node: Node) -> bool:
        devices = {graph.values[v].meta.device for v in (*node.inputs, *(o for o in node.outputs if o is not None))}
        return len(devices) == 1

    def compile(self, graph: Graph, fused: list) -> dict:
        return {index: ReferenceKernel(graph, node) for index, node in fused}


class AutoBackend(Backend):
    """One backend per device type; a group goes to the backend of its device."""

    name = "auto"

    def __init__(self, backends: list[Backend]):
        self.by_device = {b.device_type: b for b in backends}

    def can_fuse(self, graph: Graph, node: Node) -> bool:
        backend = self.by_device.get(device_of(graph, node).type)
        return backend is not None and backend.can_fuse(graph, node)

    def can_fuse_row(self, graph: Graph, node: Node) -> bool:
        backend = self.by_device.get(device_of(graph, node).type)
        return backend is not None and backend.can_fuse_row(graph, node)

    def can_chain_linear(self, graph: Graph, node: Node) -> bool:
        backend = self.by_device.get(device_of(graph, node).type)
        return backend is not None and backend.can_chain_linear(graph, node)

    def compile(self, graph: Graph, fused: list) -> dict:
        kernels = {}
        for device_type, backend in self.by_device.items():
            mine = [(i, n) for i, n in fused if device_of(graph, n).type == device_type]
            if mine:
                kernels.update(backend.compile(graph, mine))
        return kernels


def resolve_backend(option: str) -> Backend | None:
    """The backend of a `backend=` option value; None means ops run unfused."""
    # an empty variable (`TRACEJIT_BACKEND=`) is an unset one
    choice = (os.environ.get("TRACEJIT_BACKEND") or "auto") if option == "auto" else option
    if choice not in BACKENDS:
        where = "the environment variable TRACEJIT_BACKEND" if option == "auto" else "backend"
        raise ValueError(f"{where} must be one of {', '.join(BACKENDS)}; got {choice!r}")
    if choice == "aten":
        return None
    if choice == "reference":
        return ReferenceBackend()
    backends = []
    if choice in ("auto", "c"):
        from .c import CBackend

        backend = CBackend()
        if backend.available():
            backends.append(backend)
    if choice in ("auto", "triton"):
        triton_backend = _triton_backend(required=choice == "triton")
        if triton_backend is not None:
            backends.append(triton_backend)
    if not backends:
        return None
    return backends[0] if len(backends) == 1 else AutoBackend(backends)


def _triton_backend(required: bool) -> Backend | None:
    try:
        from .triton import TritonBackend
    except ImportError as error:
        if required:
            raise RuntimeError(f"tracejit: backend='triton' needs the triton package ({error})") from error
        return None
    return TritonBackend()


__all__ = ["BACKENDS", "Backend", "Kernel", "ReferenceKernel", "resolve_backend"]
