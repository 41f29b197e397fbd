"""The interface every fused-kernel backend implements.

The compiler needs two things from a backend: `can_fuse(graph, node)`, whether a CALL node may
join a fused group (passes/group.py forms the groups), and `compile(graph, fused)`, kernels for
the graph's FUSED nodes (kernels.py calls it). Compiled backends share the rest: the op
table decides which ops exist (`optable.py`), lowering turns a group into a `KernelSpec`
(`lower.py`), and a backend only renders specs to source and builds them (`render` + `build`),
keeping the text apart from the toolchain as tinygrad's renderers and runtimes do.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch

from ..ir.fused_group import FusedGroup
from ..ir.graph import Graph, Node, Op
from .lower import KernelSpec, lower_fused
from .optable import Unsupported, entry_for
from .reference import ReferenceKernel
from .rows import is_row_op

Kernel = Callable[..., tuple]


class Backend(abc.ABC):
    """What the compiler asks of a backend; subclasses set `name`, `device_type` and `dtypes`."""

    name = "base"
    device_type = "cpu"  # the device `auto` routes to this backend
    dtypes: frozenset = frozenset()

    @property
    def device_types(self) -> frozenset[str]:
        """Devices whose tensors the kernels take (Triton's interpreter adds the CPU)."""
        return frozenset({self.device_type})

    def can_fuse(self, graph: Graph, node: Node) -> bool:
        return entry_for(node.target) is not None and self._addresses(graph, node) and _lowers_alone(graph, node)

    def can_chain_linear(self, graph: Graph, node: Node) -> bool:
        """Whether a small matrix product may become (part of) a linear kernel (passes/chain_linear.py)."""
        return False

    def can_fuse_row(self, graph: Graph, node: Node) -> bool:
        """Whether a row op (rows.py: softmax and friends over the last dim) may head a row kernel."""
        return is_row_op(node.target) and self._addresses(graph, node) and _lowers_alone(graph, node)

    def _addresses(self, graph: Graph, node: Node) -> bool:
        """Whether a kernel may read and write the node's tensors through their memory: of a device and
        dtype it takes, and without a negation or conjugation bit (`z.conj().imag`), which aten applies
        when it reads the tensor (eager resolves it into a copy first: the op stays aten's)."""
        metas = [graph.values[v].meta for v in (*node.inputs, *(o for o in node.outputs if o is not None))]
        return not any(m.device.type not in self.device_types or m.dtype not in self.dtypes or m.math_bits
                       for m in metas)

    @abc.abstractmethod
    def compile(self, graph: Graph, fused: list[tuple[int, Node]]) -> dict[int, Kernel]:
        """node index -> kernel; groups left out run by reference, op by op."""

    @staticmethod
    def fallback(graph: Graph, node: Node) -> ReferenceKernel:
        return ReferenceKernel(graph, node)


class CompiledBackend(Backend):
    """A backend that renders KernelSpecs to source and builds them (C, Triton)."""

    def compile(self, graph: Graph, fused: list[tuple[int, Node]]) -> dict[int, Kernel]:
        specs, indices = [], []
        for index, node in fused:
            try:
                specs.append(self.lower(graph, node))
                indices.append(index)
            except Unsupported:
                continue
        if not specs:
            return {}
        kernels = self.build(graph, specs, [node for i, node in fused if i in set(indices)])
        return {index: kernel for index, kernel in zip(indices, kernels) if kernel is not None}

    def lower(self, graph: Graph, node: Node) -> Any:
        """What `build` renders for a FUSED node; raises Unsupported when it cannot be a kernel."""
        return lower_fused(graph, node)

    @abc.abstractmethod
    def build(self, graph: Graph, specs: list[KernelSpec], nodes: list[Node]) -> list[Kernel | None]:
        """One kernel per spec (None: that group runs by reference)."""


def _lowers_alone(graph: Graph, node: Node) -> bool:
    """Whether the op can be expressed as a kernel at all (its argument values included)."""
    key = (node.target, _hashable(node.statics), tuple(type(s) for s in node.scalars),
           tuple(graph.values[v].meta for v in node.inputs), tuple(graph.values[v].meta for v in node.writes),
           tuple(None if v is None else graph.values[v].meta for v in node.outputs))
    try:
        return _lowering_check(key, graph, node)
    except TypeError:  # an unhashable argument: check without the cache
        return _try_lower(graph, node)


def _lowering_check(key: tuple, graph: Graph, node: Node) -> bool:
    known = _LOWERS.get(key)
    if known is None:
        if len(_LOWERS) > 16384:
            _LOWERS.clear()
        known = _LOWERS[key] = _try_lower(graph, node)
    return known


_LOWERS: dict[tuple, bool] = {}  # a probe per distinct (op, arguments, layouts)


def lowered_ops(graph: Graph, node: Node) -> set[str] | None:
    """The primitives the op alone lowers to (None when it cannot be a kernel)."""
    try:
        spec = lower_fused(graph, _probe(graph, node))
    except Unsupported:
        return None
    return {e.op for e in spec.exprs}


def _probe(graph: Graph, node: Node) -> Node:
    """A FUSED node of the op alone."""
    produced = {v for v in (*node.outputs, *node.writes) if v is not None}
    inputs = tuple(dict.fromkeys(v for v in node.inputs if v not in produced))
    handed = {graph.values[v].handle for v in node.inputs}
    outputs = tuple(v for v in (*node.outputs, *node.writes)
                    if v is not None and graph.values[v].handle in handed | {graph.values[o].handle for o in
                                                                              node.outputs if o is not None})
    return Node(Op.FUSED, FusedGroup("probe", ()), inputs, tuple(dict.fromkeys(outputs)), writes=node.writes,
                positions=node.positions, source=node.source, members=(node,))


def _try_lower(graph: Graph, node: Node) -> bool:
    try:
        lower_fused(graph, _probe(graph, node))
    except Unsupported:
        return False
    return True


def _hashable(value: Any) -> Any:
    hash(value)
    return value


def device_of(graph: Graph, node: Node) -> torch.device:
    vid = next(v for v in (*node.outputs, *node.inputs) if v is not None)
    return graph.values[vid].meta.device
