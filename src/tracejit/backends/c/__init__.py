"""The C backend: fused CPU kernels as generated C with OpenMP loops, built by the system compiler."""

from __future__ import annotations

import hashlib

from ...ir.graph import Graph, Node
from ..base import CompiledBackend, Kernel
from ..lower import KernelSpec
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
        sources = []
        names = []
        for spec in specs:
            body = render_kernel(spec, "KERNEL")
            name = f"tj_{spec.name.split('_')[0]}_{hashlib.sha1(body.encode()).hexdigest()[:12]}"
            names.append(name)
            sources.append(body.replace("KERNEL", name))
        unit = prelude(specs) + "\n" + "\n".join(dict.fromkeys(sources))
        library = build(unit)
        kernels: list[Kernel | None] = []
        for spec, node, name, source in zip(specs, nodes, names, sources):
            launcher = make_launcher(spec, getattr(library, name), self.fallback(graph, node), name)
            launcher.source = source
            kernels.append(launcher)
        return kernels


__all__ = ["CBackend"]
