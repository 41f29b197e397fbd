"""Which fused-kernel backend a trace uses, as the two things the compiler needs from it.

`can_fuse(graph, node)` decides which ops may join a group (passes/group.py), and `compile` turns
the graph's FUSED nodes into kernels (runtime/fused.py). The `reference` backend groups every
pointwise op and runs each group op by op through aten: no speed, but every fusion code path
(grouping, placeholders, on-demand reads) runs, with bit-exact results. It exists for tests and
for bisecting a suspected miscompile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..ir.graph import Graph, Node

_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Fusion:
    name: str
    can_fuse: Callable[[Graph, Node], bool]
    compile: Callable[[Graph, list], dict[int, Any]] | None  # None: every group runs by reference


def _pointwise_on_one_device(graph: Graph, node: Node) -> bool:
    if torch.Tag.pointwise not in node.target.tags:
        return False
    values = [graph.values[v] for v in (*node.inputs, node.outputs[0])]
    devices = {v.meta.device for v in values}
    return len(devices) == 1 and graph.values[node.outputs[0]].meta.dtype in _FLOATING


REFERENCE = Fusion("reference", _pointwise_on_one_device, None)


def resolve_fusion(backend: str) -> Fusion | None:
    """The fusion of a `backend=` option value; None means ops run unfused."""
    if backend == "reference":
        return REFERENCE
    return None
