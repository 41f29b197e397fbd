"""verify() after every pass (TRACEJIT_VERIFY=1, set for the whole suite by conftest.py): a pass that
breaks a graph is named, with the node it broke."""

import dataclasses
import os
import warnings

import pytest
import torch
from graph_builder import GraphBuilder

import tracejit
import tracejit.passes as passes_module
from tracejit.ir import GraphVerificationError, Op, verify
from tracejit.passes import run_pipeline
from tracejit.passes.group import group_elementwise

aten = torch.ops.aten


def elementwise(graph, node):
    return torch.Tag.pointwise in node.target.tags


def run_broken(graph, broken_pass):
    return run_pipeline(graph, 2, check=True, passes=[(0, broken_pass)])


def with_value_meta(graph, vid, **changes):
    values = list(graph.values)
    values[vid] = dataclasses.replace(values[vid], meta=dataclasses.replace(values[vid].meta, **changes))
    return dataclasses.replace(graph, values=tuple(values))


def call_nodes(graph, target):
    return [(i, n) for i, n in enumerate(graph.nodes) if n.op is Op.CALL and n.target is target]


def test_the_suite_verifies_every_pass_of_a_traced_call():
    assert os.environ["TRACEJIT_VERIFY"] == "1"

    def step(x):
        return (x * 2).sin().sum(0)

    traced = tracejit.trace(step, without_host=True, backend="reference")
    for _ in range(3):
        x = torch.randn(4, 3)
        torch.testing.assert_close(traced(x), step(x), rtol=0, atol=0)
    assert traced.stats.host_free_calls >= 1
    assert [name for name, _, _ in traced.history][-3:] == ["group_elementwise", "plan_memory", "make_views_static"]


def test_a_traced_call_names_the_pass_that_broke_its_graph(monkeypatch):
    def widen_the_multiply(graph):  # claims mul's float32 result is float64
        index, node = call_nodes(graph, aten.mul.Tensor)[0]
        return with_value_meta(graph, node.outputs[0], dtype=torch.float64)

    monkeypatch.setattr(passes_module, "PIPELINE", [*passes_module.PIPELINE, (0, widen_the_multiply)])

    def step(x):
        return (x * 2).sin()

    traced = tracejit.trace(step, without_host=True)
    with pytest.raises(GraphVerificationError, match=r"after pass widen_the_multiply:\n  node \d+ "
                                                     r"\(aten\.mul\.Tensor\) result 0 is float64\[4\], but "
                                                     r"aten\.mul\.Tensor of its inputs gives float32\[4\]"):
        for _ in range(3):
            traced(torch.randn(4))
    monkeypatch.setenv("TRACEJIT_VERIFY", "0")  # unverified, the broken graph fails later, far from its cause
    traced = tracejit.trace(step, without_host=True)
    with pytest.raises(Exception) as failure:
        for _ in range(3):
            traced(torch.randn(4))
    assert not isinstance(failure.value, GraphVerificationError)


def test_a_view_of_the_wrong_size_is_caught():
    b = GraphBuilder()
    x = b.arg(torch.randn(2, 3))
    out = b.call(aten.view.default, b.call(aten.exp.default, x), [6])
    graph = verify(b.build([out]))

    def reshape_wrongly(graph):
        index, view = call_nodes(graph, aten.view.default)[0]
        nodes = list(graph.nodes)
        nodes[index] = dataclasses.replace(view, statics=(view.statics[0], (3, 2)))
        return graph.with_nodes(nodes, "reshape_wrongly")

    with pytest.raises(GraphVerificationError, match=r"after pass reshape_wrongly:\n  node \d+ \(aten\.view\.default\) "
                                                     r"result 0 is float32\[6\], but .* gives float32\[3, 2\]"):
        run_broken(graph, reshape_wrongly)


def test_an_input_of_another_shape_than_recorded_is_caught():
    b = GraphBuilder()
    x, y = b.arg(torch.randn(2, 3)), b.arg(torch.randn(3))
    out = b.call(aten.neg.default, x)
    graph = verify(b.build([out, y]))

    def rewire(graph):
        index, neg = call_nodes(graph, aten.neg.default)[0]
        nodes = list(graph.nodes)
        nodes[index] = dataclasses.replace(neg, inputs=(graph.outputs[1],))
        return graph.with_nodes(nodes, "rewire")

    with pytest.raises(GraphVerificationError, match=r"after pass rewire:\n  node \d+ \(aten\.neg\.default\) input 0 "
                                                     r"was recorded as cpu float32\[2, 3\] but reads a cpu float32\[3\]"):
        run_broken(graph, rewire)


def test_a_use_before_definition_names_the_pass():
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    out = b.call(aten.sin.default, b.call(aten.exp.default, x))
    graph = verify(b.build([out]))

    def swap(graph):
        nodes = list(graph.nodes)
        nodes[-1], nodes[-2] = nodes[-2], nodes[-1]
        return graph.with_nodes(nodes, "swap")

    with pytest.raises(GraphVerificationError, match=r"after pass swap:\n  node 1 \(aten\.sin\.default\) reads \d+ "
                                                     r"before it is defined"):
        run_broken(graph, swap)


def fused_graph():
    b = GraphBuilder()
    x, w = b.arg(torch.randn(6)), b.external(torch.randn(6))
    a = b.call(aten.mul.Tensor, x, w)
    c = b.call(aten.add.Tensor, a, w)
    graph = group_elementwise(verify(b.build([c])), elementwise)
    index = next(i for i, n in enumerate(graph.nodes) if n.op is Op.FUSED)
    return graph, index


def test_a_fused_group_missing_a_member_is_caught():
    graph, index = fused_graph()
    verify(graph)

    def drop_first_member(graph):
        nodes = list(graph.nodes)
        nodes[index] = dataclasses.replace(nodes[index], members=nodes[index].members[1:])
        return graph.with_nodes(nodes, "drop_first_member")

    with pytest.raises(GraphVerificationError, match=r"after pass drop_first_member:\n  node \d+ \(fused0_mul_add\) "
                                                     r"member 0 \(aten\.add\.Tensor\) reads \[\d+\]: neither a group "
                                                     r"input nor an earlier member's value"):
        run_broken(graph, drop_first_member)


def test_a_fused_group_over_another_shape_is_caught():
    graph, index = fused_graph()

    def reshape_group(graph):
        nodes = list(graph.nodes)
        nodes[index] = dataclasses.replace(nodes[index], target=dataclasses.replace(nodes[index].target, shape=(2, 3)))
        return graph.with_nodes(nodes, "reshape_group")

    with pytest.raises(GraphVerificationError, match=r"after pass reshape_group:\n  node \d+ \(fused0_mul_add\) "
                                                     r"member 0 \(aten\.mul\.Tensor\) computes \[6\] in a group over "
                                                     r"\[2, 3\]"):
        run_broken(graph, reshape_group)


def test_verify_rejects_a_bad_switch_value(monkeypatch):
    monkeypatch.setenv("TRACEJIT_VERIFY", "yes")
    traced = tracejit.trace(lambda x: x.sin(), without_host=True)
    with pytest.raises(ValueError, match="TRACEJIT_VERIFY must be 0 or 1, got 'yes'"):
        for _ in range(3):
            traced(torch.randn(3))


def test_a_tensor_reshaped_in_place_has_its_new_shape_in_the_graph_and_no_kept_buffer():
    # found by verify(): a value after `t_()` kept its handle's first shape, and plan_memory gave the
    # tensor a kept out= buffer that the next call found transposed (torch resized it, with a warning)
    def step(x):
        y = x * 2
        y.t_()
        return y + 1

    traced = tracejit.trace(step, without_host=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(4):
            x = torch.randn(2, 3)
            torch.testing.assert_close(traced(x), step(x), rtol=0, atol=0)
    assert traced.stats.host_free_calls >= 2
    record_graph, final = traced.history[0][1], traced.history[-1][1]
    add = call_nodes(record_graph, aten.add.Tensor)[0][1]
    assert record_graph.values[add.inputs[0]].meta.shape == (3, 2)
    assert call_nodes(final, aten.mul.Tensor)[0][1].buffer is None


def test_a_view_rooted_in_a_storage_its_node_does_not_read_is_named():
    """plan_memory keeps a view's root alive while the view is read: a pass that substitutes a
    value but leaves the views of it rooted in the old one (rematerialize did, for backward's
    transposes of recomputed activations) lets the view's real storage be reused under it."""
    b = GraphBuilder()
    x, y = b.arg(torch.randn(3, 4)), b.arg(torch.randn(3, 4))
    t = b.call(aten.t.default, x)
    graph = b.build([t, y])
    verify(graph)
    (index, node), = call_nodes(graph, aten.t.default)
    moved = dataclasses.replace(node, inputs=(graph.values[graph.outputs[1]].id,))  # reads y, rooted in x
    broken = dataclasses.replace(graph, nodes=graph.nodes[:index] + (moved,) + graph.nodes[index + 1:])
    with pytest.raises(GraphVerificationError, match=r"makes view \d+ in storage t0, which it does not read \(it reads t1\)"):
        verify(broken)
