"""The C backend: fused CPU kernels as generated C with OpenMP loops, built by the system compiler."""

from __future__ import annotations

import hashlib

from ...ir.graph import Graph, Node
from ..base import CompiledBackend, Kernel
from ..lower import KernelSpec
from ..optable import Unsupported
from .launch import make_launcher
from .linear import LINEAR_DTYPES, LinearChain, lower_linear, make_linear_launcher, render_linear
from .render import C_TYPES, prelude, render_kernel
from .toolchain import CompilerUnavailable, build, compiler, warn_unavailable


class CBackend(CompiledBackend):
    name = "c"
    device_type = "cpu"
    dtypes = frozenset(C_TYPES)  # half types run unfused on the CPU

    def available(self) -> bool:
        try:
            compiler()
        except CompilerUnavailable as error:
            warn_unavailable(error)
            return False
        return True

    def can_chain_linear(self, graph: Graph, node: Node) -> bool:
        return self._addresses(graph, node) and all(graph.values[v].meta.dtype in LINEAR_DTYPES for v in node.inputs)

    def lower(self, graph: Graph, node: Node) -> KernelSpec | LinearChain:
        if node.target.kind == "linear":
            return lower_linear(graph, node)
        return super().lower(graph, node)

    def build(self, graph: Graph, specs: list[KernelSpec | LinearChain], nodes: list[Node]) -> list[Kernel | None]:
        sources: list[str | None] = []
        names: list[str | None] = []
        for spec in specs:
            try:
                body = render_linear(spec, "KERNEL") if isinstance(spec, LinearChain) else render_kernel(spec, "KERNEL")
            except Unsupported:  # a layout the renderer cannot walk: the group runs by reference
                sources.append(None)
                names.append(None)
                continue
            # named by the body alone: the same kernel for every parameter of an optimizer step is
            # compiled once (a 200-parameter model's for-loop Adam has a handful of distinct bodies)
            name = f"tj_{hashlib.sha1(body.encode()).hexdigest()[:16]}"
            names.append(name)
            sources.append(body.replace("KERNEL", name))
        rendered = [spec for spec, source in zip(specs, sources) if source is not None]
        if not rendered:
            return [None] * len(specs)
        bodies = "\n".join(dict.fromkeys(s for s in sources if s is not None))
        unit = prelude([s for s in rendered if isinstance(s, KernelSpec)]) + "\n" + bodies
        library = build(unit)
        kernels: list[Kernel | None] = []
        for spec, node, name, source in zip(specs, nodes, names, sources):
            if source is None:
                kernels.append(None)
                continue
            make = make_linear_launcher if isinstance(spec, LinearChain) else make_launcher
            launcher = make(spec, getattr(library, name), self.fallback(graph, node), name)
            launcher.source = source
            kernels.append(launcher)
        return kernels


__all__ = ["CBackend"]
