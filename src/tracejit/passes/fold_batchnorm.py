"""fold_batchnorm: an eval-mode BatchNorm after a convolution or a Linear joins its weights.

Before (host-free, capture_as_const):                  After:
    t3 = aten.convolution.default(t0, t1, t2, ...)         t9 = aten.convolution.default(t0, t34, t35, ...)
    t9, t10, t11 = aten.native_batch_norm.default(
        t3, t5, t6, t7, t8, False, 0.1, 1e-05)

In eval mode BatchNorm is a per-channel affine map, `y = (x - mean) * scale + beta` with
`scale = gamma / sqrt(var + eps)`, so it folds into the producer: the weight's output channels
are multiplied by `scale` and the bias becomes `(bias - mean) * scale + beta` (computed in
float64, stored in the weight's dtype). The new weight and bias are constants of their own;
the old ones die in dead code elimination. Applies when the BatchNorm's statistics and affine
parameters are constants, only its first result is used, and nothing else reads the
convolution (non-transposed) or `addmm` (a Linear, without beta/alpha) result.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..ir.graph import Graph, Node, Op, Value
from ..record.calls import rebuild_call
from ..record.record import TENSOR, TensorMeta
from .analysis import identity_matters, single_version_handles

aten = torch.ops.aten

# BatchNorm op -> (index of `training` or None when the op is eval-only, index of eps)
_BATCH_NORMS = {aten.native_batch_norm.default: (5, 7), aten._native_batch_norm_legit_no_training.default: (None, 6)}
_FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class _Folder:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.values = list(graph.values)
        self.constants = dict(graph.constants)
        self.num_handles = graph.num_handles
        self.new_inputs: list[Node] = []
        self.name_of = {n.outputs[0]: n.input_name for n in graph.nodes if n.op is Op.CONST}
        self.constant_of = {n.outputs[0]: graph.constants[graph.values[n.outputs[0]].handle]
                            for n in graph.nodes if n.op is Op.CONST and graph.values[n.outputs[0]].handle in graph.constants
                            and graph.values[n.outputs[0]].handle not in graph.fresh}  # made anew each call

    def constant(self, tensor: torch.Tensor, name: str, source) -> int:
        handle = self.num_handles
        self.num_handles += 1
        value = Value(len(self.values), handle, 0, TensorMeta.of(tensor), handle)
        self.values.append(value)
        self.constants[handle] = tensor
        self.constant_of[value.id] = tensor
        self.new_inputs.append(Node(Op.CONST, None, (), (value.id,), input_name=name, source=source))
        return value.id

    def arguments(self, node: Node) -> list | None:
        """The node's positional arguments with constants filled in (TENSOR for other tensors)."""
        tensors = [self.constant_of.get(v, TENSOR) for v in node.inputs]
        args, kwargs = rebuild_call(node.statics, tensors, list(node.scalars))
        return None if kwargs else args


def fold_batchnorm(graph: Graph) -> Graph:
    if graph.host_visible or not graph.capture_as_const:
        return graph
    folder = _Folder(graph)
    producers = {n.outputs[0]: n for n in graph.nodes if n.op is Op.CALL and len(n.outputs) == 1}
    users = graph.users()
    unwritten = single_version_handles(graph)
    held = identity_matters(graph)
    replaced: dict[int, Node | None] = {}  # id(node) -> its replacement (None: dropped)
    for node in graph.nodes:
        if node.op is not Op.CALL or node.target not in _BATCH_NORMS or any(users.get(v) for v in node.outputs[1:]
                                                                            if v is not None):
            continue
        producer = producers.get(node.inputs[0])
        value = graph.values[node.inputs[0]]
        if (producer is None or id(producer) in replaced or len(users.get(value.id, [])) != 1
                or value.handle not in unwritten or value.handle in held or producer.writes):
            continue
        fused = _fold(folder, producer, node)
        if fused is not None:
            replaced[id(producer)] = None
            replaced[id(node)] = fused
    if not replaced:
        return graph
    nodes = [replaced.get(id(n), n) for n in graph.nodes]
    nodes = folder.new_inputs + [n for n in nodes if n is not None]
    return graph.with_nodes(nodes, "fold_batchnorm", values=tuple(folder.values), num_handles=folder.num_handles,
                            constants=folder.constants)


def _affine(folder: _Folder, norm: Node) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(scale, shift) in float64 of an eval-mode BatchNorm with constant parameters."""
    args = folder.arguments(norm)
    training_at, eps_at = _BATCH_NORMS[norm.target]
    if args is None or (training_at is not None and args[training_at] is not False):
        return None
    gamma, beta, mean, var = args[1:5]
    if mean is None or var is None or any(a is TENSOR for a in (gamma, beta, mean, var)):
        return None  # no running statistics, or a parameter that is not a constant
    scale = (var.double() + float(args[eps_at])).rsqrt()
    if gamma is not None:
        scale = scale * gamma.double()
    shift = -mean.double() * scale
    if beta is not None:
        shift = shift + beta.double()
    return scale, shift


def _fold(folder: _Folder, producer: Node, norm: Node) -> Node | None:
    if producer.target is aten.convolution.default:
        return _fold_convolution(folder, producer, norm)
    if producer.target is aten.addmm.default and not producer.scalars:
        return _fold_linear(folder, producer, norm)
    return None


def _fold_convolution(folder: _Folder, conv: Node, norm: Node) -> Node | None:
    args = folder.arguments(conv)
    if args is None or len(args) != 9 or args[6] is not False:  # transposed convolutions keep their BatchNorm
        return None
    weight, bias = args[1], args[2]
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _FLOATING or not (bias is None or isinstance(bias, torch.Tensor)):
        return None
    affine = _affine(folder, norm)
    if affine is None or affine[0].shape != (weight.shape[0],):
        return None
    scale, shift = affine
    new_weight = (weight.double() * scale.reshape(-1, *[1] * (weight.dim() - 1))).to(weight.dtype)
    new_bias = (shift if bias is None else bias.double() * scale + shift).to(weight.dtype)
    return _rewired(folder, conv, norm, new_weight, new_bias, weight_at=1, bias_at=2)


def _fold_linear(folder: _Folder, addmm: Node, norm: Node) -> Node | None:
    args = folder.arguments(addmm)
    if args is None or len(args) != 3:
        return None
    bias, weight_t = args[0], args[2]  # addmm(bias, x, weight.t())
    if not all(isinstance(t, torch.Tensor) for t in (bias, weight_t)) or weight_t.dtype not in _FLOATING:
        return None
    affine = _affine(folder, norm)
    if affine is None or weight_t.dim() != 2 or affine[0].shape != (weight_t.shape[1],) or bias.shape != affine[0].shape:
        return None
    scale, shift = affine
    new_weight_t = (weight_t.double() * scale).to(weight_t.dtype)
    new_bias = (bias.double() * scale + shift).to(bias.dtype)
    return _rewired(folder, addmm, norm, new_weight_t, new_bias, weight_at=2, bias_at=0)


def _rewired(folder: _Folder, producer: Node, norm: Node, weight: torch.Tensor, bias: torch.Tensor, weight_at: int,
             bias_at: int) -> Node:
    """The producer reading the folded weight and bias and producing the BatchNorm's result."""
    original = producer.statics
    original_ids = dict(zip([i for i, item in enumerate(original) if item is TENSOR], producer.inputs))
    statistics = folder.name_of.get(norm.inputs[-2], "batch norm")  # running_mean, then running_var
    folded = f"folded with {statistics.removesuffix('.running_mean')}"
    base = folder.name_of.get(original_ids[weight_at], "weight")
    bias_name = folder.name_of.get(original_ids.get(bias_at)) or f"{base.removesuffix('weight')}bias"
    new_ids = {weight_at: folder.constant(weight, f"{base} {folded}", producer.source),
               bias_at: folder.constant(bias, f"{bias_name} {folded}", producer.source)}
    statics = list(original)
    statics[bias_at] = TENSOR  # a convolution without bias gains one
    inputs = [new_ids.get(index, original_ids.get(index)) for index, item in enumerate(statics) if item is TENSOR]
    metas = tuple(folder.values[v].meta for v in inputs)
    return replace(producer, inputs=tuple(inputs), outputs=(norm.outputs[0],),
                   positions=tuple(sorted((*producer.positions, *norm.positions))), statics=tuple(statics),
                   input_metas=metas)
