"""Which fused-kernel backend a trace uses (see backends/__init__.py for the choices).

The compiler needs two things from it: `can_fuse(graph, node)`, which ops may join a group
(passes/group.py), and `compile(graph, fused)`, kernels for the FUSED nodes (runtime/fused.py).
"""

from __future__ import annotations

from ..backends import Backend, resolve_backend


def resolve_fusion(backend: str) -> Backend | None:
    """The backend of a `backend=` option value; None means ops run unfused."""
    return resolve_backend(backend)
