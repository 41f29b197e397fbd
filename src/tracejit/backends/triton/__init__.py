"""The Triton backend: fused CUDA kernels as generated Triton, compiled lazily by Triton's JIT.

This package is the only place that imports `triton`, so CPU-only installs never need it. Under
`TRITON_INTERPRET=1` the backend also takes CPU tensors: its kernels then run in Triton's
interpreter, which is how the tests prove them without a GPU (docs/kernels.md).
"""

from __future__ import annotations

from ...ir.graph import Graph, Node
from ..base import CompiledBackend, Kernel
from ..lower import KernelSpec
from .expressions import TL_TYPES, NotRenderable
from .jit import interpreting, kernel_function
from .launch import make_launcher
from .render import TritonKernel, render_kernel


class TritonBackend(CompiledBackend):
    name = "triton"
    device_type = "cuda"
    dtypes = frozenset(TL_TYPES)

    def __init__(self, interpret: bool | None = None):
        self.interpret = interpreting() if interpret is None else interpret

    @property
    def device_types(self) -> frozenset[str]:
        """CUDA tensors; CPU tensors too when kernels run in the interpreter."""
        return frozenset({"cuda", "cpu"}) if self.interpret else frozenset({"cuda"})

    def build(self, graph: Graph, specs: list[KernelSpec], nodes: list[Node]) -> list[Kernel | None]:
        kernels: list[Kernel | None] = []
        for spec, node in zip(specs, nodes):
            if self.interpret and spec.device.type != "cpu" and len(spec.lanes) > 1:
                kernels.append(None)  # the interpreter cannot follow a table of device pointers
                continue
            try:
                kernel = render_kernel(spec)
            except NotRenderable:
                kernels.append(None)  # runs op by op through aten
                continue
            function = kernel_function(kernel.name, kernel.source, self.interpret)
            kernels.append(make_launcher(spec, kernel, function, self.fallback(graph, node), self.interpret))
        return kernels


__all__ = ["TritonBackend", "TritonKernel", "render_kernel"]
