"""The C backend: fused CPU kernels as generated C with OpenMP loops, built by the system compiler."""

from __future__ import annotations

import hashlib

from ...ir.graph import Graph, Node
from ..base import CompiledBackend, Kernel
from ..lower import KernelSpec
from ..optable import Unsupported
from .launch import make_launcher
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

    def build(self, graph: Graph, specs: list[KernelSpec], nodes: list[Node]) -> list[Kernel | None]:
        sources: list[str | None] = []
        names: list[str | None] = []
        for spec in specs:
            try:
                body = render_kernel(spec, "KERNEL")
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
        unit = prelude(rendered) + "\n" + "\n".join(dict.fromkeys(s for s in sources if s is not None))
        library = build(unit)
        kernels: list[Kernel | None] = []
        for spec, node, name, source in zip(specs, nodes, names, sources):
            if source is None:
                kernels.append(None)
                continue
            launcher = make_launcher(spec, getattr(library, name), self.fallback(graph, node), name)
            launcher.source = source
            kernels.append(launcher)
        return kernels


__all__ = ["CBackend"]
