"""group_elementwise on hand-built graphs: host reads, in-place members, merging, lanes."""

import dataclasses

import torch
from graph_builder import GraphBuilder

from tracejit.backends import ReferenceKernel
from tracejit.ir import Op
from tracejit.ir.verify import verify
from tracejit.passes.group import group_elementwise

aten = torch.ops.aten


def elementwise(graph, node):
    return torch.Tag.pointwise in node.target.tags or str(node.target).startswith("aten._foreach_")


def fused(graph):
    return [n for n in graph.nodes if n.op is Op.FUSED]


def test_a_host_read_of_an_unrelated_value_does_not_split_a_group():
    b = GraphBuilder()
    x, step = b.arg(torch.randn(4)), b.external(torch.ones(()))
    a = b.call(aten.exp.default, x)
    c = b.call(aten.sin.default, a)
    graph = verify(b.build([c]))
    unrelated = dataclasses.replace(graph, reads=((1, step.handle),))  # step.item() between exp and sin
    related = dataclasses.replace(graph, reads=((1, a.handle),))  # a.item(): a must be real by then
    assert len(fused(group_elementwise(unrelated, elementwise))) == 1
    assert fused(group_elementwise(related, elementwise)) == []


def test_an_excluded_block_always_splits_a_group():
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    c = b.call(aten.sin.default, b.call(aten.exp.default, x))
    graph = dataclasses.replace(verify(b.build([c])), barriers=(1,))
    assert fused(group_elementwise(graph, elementwise)) == []


def test_in_place_member_is_computed_in_the_kernel():
    b = GraphBuilder()
    x, w = b.arg(torch.randn(6)), b.external(torch.randn(6))
    a = b.call(aten.mul.Tensor, x, w)
    b.call(aten.add_.Tensor, w, x, writes=(w,))
    c = b.call(aten.add.Tensor, a, w)
    graph = verify(group_elementwise(verify(b.build([c], escaped=())), elementwise))
    (node,) = fused(graph)
    assert [str(m.target) for m in node.members] == ["aten.mul.Tensor", "aten.add_.Tensor", "aten.add.Tensor"]
    assert node.writes  # the FUSED node writes w


def test_reading_another_view_of_a_written_storage_prevents_fusion():
    b = GraphBuilder()
    w = b.external(torch.randn(4, 4))
    row = b.call(aten.select.int, w, 0, 1)  # a view of w
    b.call(aten.mul_.Scalar, w, 2.0, writes=(w,))
    c = b.call(aten.add.Tensor, b.call(aten.exp.default, w), row)  # reads w and its view
    graph = group_elementwise(verify(b.build([c])), elementwise)
    for node in fused(graph):  # the write may fuse with exp, never with the add reading the view
        targets = {str(m.target) for m in node.members}
        assert not {"aten.mul_.Scalar", "aten.add.Tensor"} <= targets, targets


def test_a_node_joining_two_groups_merges_them():
    b = GraphBuilder()
    m, v, g = (b.external(torch.randn(5)) for _ in range(3))
    b.call(aten.lerp_.Scalar, m, g, 0.1, writes=(m,))  # group 1: reads g
    b.call(aten.mul_.Scalar, v, 0.9, writes=(v,))  # group 2
    b.call(aten.addcmul_.default, v, g, g, value=0.1, writes=(v,))  # fed by group 2, shares g with group 1
    graph = verify(group_elementwise(verify(b.build([], escaped=(m, v))), elementwise))
    (node,) = fused(graph)
    assert len(node.members) == 3


def test_foreach_members_form_one_multi_tensor_group_and_run_by_reference():
    b = GraphBuilder()
    params = [b.external(torch.randn(3)), b.external(torch.randn(2, 2))]
    grads = [b.external(torch.randn(3)), b.external(torch.randn(2, 2))]
    b.call(aten._foreach_mul_.Scalar, grads, 0.5, writes=tuple(grads))
    b.call(aten._foreach_add_.List, params, grads, alpha=-0.1, writes=tuple(params))
    graph = verify(group_elementwise(verify(b.build([], escaped=tuple(params))), elementwise))
    (node,) = fused(graph)
    assert node.target.lanes == 2
    inputs = [b.samples[graph.values[v].handle].clone() for v in node.inputs]
    before = [t.clone() for t in inputs]
    ReferenceKernel(graph, node)(inputs, b.scalars)
    by_handle = {graph.values[v].handle: t for v, t in zip(node.inputs, inputs)}
    old = {graph.values[v].handle: t for v, t in zip(node.inputs, before)}
    for p, g in zip(params, grads):
        assert torch.allclose(by_handle[p.handle], old[p.handle] - 0.1 * (old[g.handle] * 0.5))
