"""Each pass on hand-built graphs: what it removes, what it must keep."""

import dataclasses

import pytest
import torch
from graph_builder import GraphBuilder

from tracejit.backends.kernels import compile_fused_nodes
from tracejit.ir import Op, verify
from tracejit.ir.printer import format_graph
from tracejit.passes import run_pipeline
from tracejit.passes.cse import eliminate_common_subexpressions
from tracejit.passes.dce import eliminate_dead_code
from tracejit.passes.fold_constants import fold_constants
from tracejit.passes.group import group_elementwise
from tracejit.passes.hoist import hoist_external_views
from tracejit.passes.noop import remove_noop_views
from tracejit.passes.plan_memory import plan_memory
from tracejit.runtime.program import HostFreeProgram

aten = torch.ops.aten


def call_targets(graph):
    return [str(n.target) for n in graph.nodes if n.op is Op.CALL]


def run(graph, *inputs, scalars=(2.0,)):
    """Execute a host-free graph with the generated executor; inputs by input-node order."""
    program = HostFreeProgram(graph)
    env = [None] * graph.num_handles
    for handle, tensor in graph.constants.items():
        env[handle] = tensor
    for node, value in zip([n for n in graph.nodes if n.op in (Op.ARG, Op.EXTERNAL)], inputs):
        env[graph.values[node.outputs[0]].handle] = value
    program.init(env)
    program.run(env, list(scalars))
    return [env[graph.values[v].handle] for v in graph.outputs]


def test_dce_drops_unused_keeps_outputs():
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    y = b.call(aten.relu.default, x)
    b.call(aten.neg.default, x)  # nobody uses it
    graph = verify(b.build([y]))
    after = verify(eliminate_dead_code(graph))
    assert call_targets(after) == ["aten.relu.default"]


def test_dce_keeps_writes_to_observable_storage_and_rng():
    b = GraphBuilder()
    x = b.arg(torch.rand(4))
    w = b.external(torch.randn(4), "w")
    b.call(aten.add_.Tensor, w, x, writes=(w,))  # updates a parameter: a side effect
    b.call(aten.bernoulli.default, x)  # unused, but advances the RNG stream as eager does
    tmp = b.call(aten.neg.default, x)
    b.call(aten.mul_.Tensor, tmp, 2.0, writes=(tmp,))  # writes an internal nobody reads: dead
    out = b.call(aten.sin.default, x)
    after = verify(eliminate_dead_code(verify(b.build([out]))))
    assert call_targets(after) == ["aten.add_.Tensor", "aten.bernoulli.default", "aten.sin.default"]


def test_dce_keeps_writes_whose_new_version_is_read():
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    tmp = b.call(aten.neg.default, x)
    b.call(aten.mul_.Tensor, tmp, 2.0, writes=(tmp,))
    out = b.call(aten.add.Tensor, tmp, x)
    after = verify(eliminate_dead_code(verify(b.build([out]))))
    assert call_targets(after) == ["aten.neg.default", "aten.mul_.Tensor", "aten.add.Tensor"]
    x_value = torch.randn(4)
    assert torch.equal(run(after, x_value)[0], -x_value * 2 + x_value)


def test_dce_leaves_host_visible_graphs_alone():
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    b.call(aten.neg.default, x)
    y = b.call(aten.relu.default, x)
    graph = b.build([y], host_visible=True)
    assert eliminate_dead_code(graph) is graph


def test_noop_views_become_their_source():
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    d1 = b.call(aten.detach.default, x)
    d2 = b.call(aten.detach.default, d1)
    out = b.call(aten.relu.default, d2)
    after = verify(remove_noop_views(verify(b.build([out]))))
    assert call_targets(after) == ["aten.relu.default"]
    relu = [n for n in after.nodes if n.op is Op.CALL][0]
    assert after.values[relu.inputs[0]].handle == x.handle


def test_noop_views_written_through_or_returned_stay():
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    d = b.call(aten.detach.default, x)
    b.call(aten.mul_.Tensor, d, 2.0, writes=(d,))  # writes x's storage through the alias
    r = b.call(aten.detach.default, x)
    after = verify(remove_noop_views(verify(b.build([r]))))
    assert call_targets(after) == ["aten.detach.default", "aten.mul_.Tensor", "aten.detach.default"]


def test_cse_merges_identical_pure_ops():
    b = GraphBuilder()
    w = b.external(torch.randn(3, 3))
    t1 = b.call(aten.t.default, w)
    t2 = b.call(aten.t.default, w)
    out = b.call(aten.mm.default, t1, t2)
    after = verify(eliminate_common_subexpressions(verify(b.build([out]))))
    assert call_targets(after) == ["aten.t.default", "aten.mm.default"]
    mm = [n for n in after.nodes if n.op is Op.CALL][1]
    assert mm.inputs[0] == mm.inputs[1]


def test_cse_keeps_rng_scalars_and_written_values():
    b = GraphBuilder()
    x = b.arg(torch.rand(4))
    r1 = b.call(aten.bernoulli.default, x)
    r2 = b.call(aten.bernoulli.default, x)
    s1 = b.call(aten.mul.Tensor, x, 2.0)  # dynamic scalar: may differ per call
    s2 = b.call(aten.mul.Tensor, x, 2.0)
    n1 = b.call(aten.neg.default, x)
    n2 = b.call(aten.neg.default, x)
    b.call(aten.add_.Tensor, n2, x, writes=(n2,))
    outs = [b.call(aten.add.Tensor, a, c) for a, c in ((r1, r2), (s1, s2), (n1, n2))]
    after = verify(eliminate_common_subexpressions(verify(b.build(outs))))
    assert call_targets(after).count("aten.bernoulli.default") == 2
    assert call_targets(after).count("aten.mul.Tensor") == 2
    assert call_targets(after).count("aten.neg.default") == 2


@pytest.mark.parametrize("view_use", ["read_later", "escaped"])
def test_cse_moves_the_views_of_a_merged_value_into_the_kept_storage(view_use):
    # the view kept the merged value as its root, a storage no node made any more: plan_memory
    # ended the kept storage at its own last use and let `cos` overwrite what the view still shows
    b = GraphBuilder()
    x = b.arg(torch.randn(64, 64))
    kept = b.call(aten.exp.default, x)
    merged = b.call(aten.exp.default, x)
    view = b.call(aten.view.default, merged, [4096])
    c = b.call(aten.sin.default, kept)  # the last use of `kept` itself
    d = b.call(aten.cos.default, c)  # may take `kept`'s place in the arena, unless the view lives there
    if view_use == "read_later":
        graph = b.build([b.call(aten.add.Tensor, d, b.call(aten.view.default, view, [64, 64]))])
    else:
        graph = b.build([d], escaped=(view,))  # kept in Python state (`m.last = a.mean(0).detach()`)
    after = verify(plan_memory(verify(eliminate_common_subexpressions(verify(graph))), min_bytes=0))
    assert call_targets(after).count("aten.exp.default") == 1
    (exp,) = [n for n in after.nodes if n.op is Op.CALL and n.target is aten.exp.default]
    assert {v.root for v in after.values if v.handle == view.handle} == {after.values[exp.outputs[0]].root}
    x_value = torch.randn(64, 64)
    program = HostFreeProgram(after)
    for _ in range(2):  # the arena persists across calls
        env = [None] * after.num_handles
        env[x.handle] = x_value
        program.run(env, [])
        expected = x_value.exp().sin().cos()
        if view_use == "read_later":
            assert torch.equal(env[after.values[after.outputs[0]].handle], expected + x_value.exp())
        else:
            assert torch.equal(env[d.handle], expected)
            assert torch.equal(env[view.handle], x_value.exp().view(4096))


def test_fold_constants_under_capture_as_const():
    b = GraphBuilder()
    x = b.arg(torch.randn(2, 3))
    w = b.const(torch.randn(4, 3))
    wt = b.call(aten.t.default, w)
    wt2 = b.call(aten.mul.Tensor, wt, wt)
    out = b.call(aten.mm.default, x, wt2)
    graph = verify(b.build([out], capture_as_const=True))
    after = verify(fold_constants(graph))
    assert call_targets(after) == ["aten.mm.default"]
    x_value = torch.randn(2, 3)
    w_value = graph.constants[w.handle]
    assert torch.allclose(run(after, x_value)[0], x_value @ (w_value.t() * w_value.t()))
    assert fold_constants(b.build([out])) .nodes == b.build([out]).nodes  # without capture_as_const: no-op


def test_hoist_marks_views_of_externals_only():
    b = GraphBuilder()
    x = b.arg(torch.randn(2, 3))
    w = b.external(torch.randn(4, 3))
    wt = b.call(aten.t.default, w)
    wtt = b.call(aten.t.default, wt)
    xt = b.call(aten.t.default, x)
    out = b.call(aten.mm.default, b.call(aten.t.default, xt), wt)
    after = verify(hoist_external_views(verify(b.build([out, wtt]))))
    hoisted = [n for n in after.nodes if n.hoisted]
    # t(w) is hoisted; t(t(w)) is returned (a fresh object per call), t(x) depends on an input
    assert [after.values[n.outputs[0]].handle for n in hoisted] == [wt.handle]
    program = HostFreeProgram(after)
    assert program.hoisted == (wt.handle,)
    x_value, w_value = torch.randn(2, 3), torch.randn(4, 3)
    env = [None] * after.num_handles
    env[w.handle] = w_value
    program.init(env)
    assert env[wt.handle].data_ptr() == w_value.data_ptr()  # a view of the external, made once
    env[x.handle] = x_value
    program.run(env, [])
    assert torch.allclose(env[out.handle], x_value @ w_value.t())


def test_plan_memory_reuses_buffers_for_disjoint_lifetimes():
    b = GraphBuilder()
    x = b.arg(torch.randn(64, 64))
    a = b.call(aten.exp.default, x)
    c = b.call(aten.sin.default, a)      # a dies here
    d = b.call(aten.cos.default, c)      # c dies here; d can take a's place
    out = b.call(aten.add.Tensor, d, x)
    graph = verify(b.build([out]))
    after = verify(plan_memory(graph, min_bytes=0))
    buffers = {str(n.target): n.buffer for n in after.nodes if n.buffer}
    assert set(buffers) == {"aten.exp.default", "aten.sin.default", "aten.cos.default"}
    assert buffers["aten.exp.default"][0] == buffers["aten.cos.default"][0]  # reused
    assert buffers["aten.exp.default"][0] != buffers["aten.sin.default"][0]
    assert after.arena_bytes == 2 * 64 * 64 * 4
    assert "arena[" in format_graph(after)
    x_value = torch.randn(64, 64)
    program = HostFreeProgram(after)
    for _ in range(2):  # buffers persist across calls; results stay right
        env = [None] * after.num_handles
        env[x.handle] = x_value
        program.run(env, [])
        assert torch.allclose(env[out.handle], x_value.exp().sin().cos() + x_value)
    # default threshold: every CPU intermediate (a fresh CPU tensor costs more than an out= write)
    assert plan_memory(graph).arena_bytes == after.arena_bytes
    assert plan_memory(graph, min_bytes=1 << 20).arena_bytes == 0


def test_plan_memory_leaves_small_values_off_the_cpu_to_the_allocator():
    b = GraphBuilder()
    x = b.arg(torch.randn(64, 64, device="meta"))
    a = b.call(aten.exp.default, x)
    out = b.call(aten.sin.default, a)
    assert plan_memory(verify(b.build([out]))).arena_bytes == 0


def test_plan_memory_leaves_large_cpu_values_to_the_allocator():
    # a CNN step at batch 256 peaked at 1.5x eager's memory: the arena held the forward's large
    # activations through the backward, whose convolution gradients were allocated on top of it
    b = GraphBuilder()
    x = b.arg(torch.randn(1024, 512))  # 2 MiB values
    a = b.call(aten.exp.default, x)
    c = b.call(aten.sin.default, a)
    out = b.call(aten.add.Tensor, c, x)
    assert plan_memory(verify(b.build([out]))).arena_bytes == 0
    assert plan_memory(verify(b.build([out])), min_bytes=0).arena_bytes == 0


def test_plan_memory_never_plans_returned_storage():
    b = GraphBuilder()
    x = b.arg(torch.randn(64, 64))
    a = b.call(aten.exp.default, x)
    v = b.call(aten.view.default, a, [4096])  # the returned view keeps a's storage alive
    after = plan_memory(verify(b.build([v])), min_bytes=0)
    assert after.arena_bytes == 0


def test_plan_memory_leaves_reducing_losses_to_the_allocator(capfd):
    # mse_loss.out writes the unreduced loss into `out` first: a planned 0-d buffer was resized to
    # the input's shape on every call (torch warns, and deprecates resizing such outputs)
    b = GraphBuilder()
    x, y = b.arg(torch.randn(8, 2)), b.arg(torch.randn(8, 2))
    d = b.call(aten.sub.Tensor, x, y)
    loss = b.call(aten.mse_loss.default, d, y, 1)
    out = b.call(aten.mul.Tensor, loss, loss)
    after = verify(plan_memory(verify(b.build([out])), min_bytes=0))
    assert {str(n.target) for n in after.nodes if n.buffer} == {"aten.sub.Tensor"}
    x_value, y_value = torch.randn(8, 2), torch.randn(8, 2)
    env = [None] * after.num_handles
    env[x.handle], env[y.handle] = x_value, y_value
    HostFreeProgram(after).run(env, [])
    expected = torch.nn.functional.mse_loss(x_value - y_value, y_value)
    assert torch.equal(env[out.handle], expected * expected)
    assert "resized" not in capfd.readouterr().err


def pointwise(graph, node):
    return torch.Tag.pointwise in node.target.tags


def pointwise_out_of_place(graph, node):
    return pointwise(graph, node) and not node.writes


def fused_nodes(graph):
    return [n for n in graph.nodes if n.op is Op.FUSED]


def run_with_kernels(graph, *inputs):
    kernels = compile_fused_nodes(graph)
    program = HostFreeProgram(graph, kernels=kernels)
    env = [None] * graph.num_handles
    for node, value in zip([n for n in graph.nodes if n.op is Op.ARG], inputs):
        env[graph.values[node.outputs[0]].handle] = value
    program.run(env, list(GraphBuilder.last_scalars))
    return [env[graph.values[v].handle] for v in graph.outputs]


def test_group_fuses_a_chain_and_keeps_only_needed_outputs():
    b = GraphBuilder()
    x, y = b.arg(torch.randn(8)), b.arg(torch.randn(8))
    m = b.call(aten.mul.Tensor, x, y)
    a = b.call(aten.add.Tensor, m, 1.0)
    out = b.call(aten.sigmoid.default, a)
    graph = verify(b.build([out]))
    after = verify(group_elementwise(graph, pointwise))
    (fused,) = fused_nodes(after)
    assert [str(n.target) for n in fused.members] == ["aten.mul.Tensor", "aten.add.Tensor", "aten.sigmoid.default"]
    assert fused.outputs == graph.outputs and len(fused.inputs) == 2
    assert fused.positions == (0, 1, 2)
    assert "fused0_mul_add_sigmoid" in str(after) and "#   t" not in str(after).split("def")[0]
    GraphBuilder.last_scalars = b.scalars
    x_value, y_value = torch.randn(8), torch.randn(8)
    assert torch.equal(run_with_kernels(after, x_value, y_value)[0], torch.sigmoid(x_value * y_value + 1.0))


def test_group_stops_at_a_consumer_inside_the_span():
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    a = b.call(aten.exp.default, x)
    other = b.call(aten.sum.default, a)  # needs a before sin would run the group
    c = b.call(aten.sin.default, a)
    after = group_elementwise(verify(b.build([c, other])), pointwise)
    assert fused_nodes(after) == []


def test_group_stops_at_a_write_to_a_member_input():
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    w = b.external(torch.randn(4))
    a = b.call(aten.mul.Tensor, x, w)
    b.call(aten.add_.Tensor, w, x, writes=(w,))  # w changes between the members, from outside the group
    c = b.call(aten.add.Tensor, a, w)
    after = group_elementwise(verify(b.build([c])), pointwise_out_of_place)
    assert fused_nodes(after) == []


def test_group_never_spans_a_host_read():
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    a = b.call(aten.exp.default, x)
    c = b.call(aten.sin.default, a)
    graph = dataclasses.replace(verify(b.build([c])), barriers=(1,))
    assert fused_nodes(group_elementwise(graph, pointwise)) == []


def test_group_outputs_values_needed_outside():
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    a = b.call(aten.exp.default, x)
    c = b.call(aten.sin.default, a)
    d = b.call(aten.cos.default, c)
    after = group_elementwise(verify(b.build([d, a])), pointwise)  # a is returned too
    (fused,) = fused_nodes(after)
    assert [after.values[v].handle for v in fused.outputs] == [a.handle, d.handle]


def test_host_visible_group_refuses_outside_readers_of_its_inputs():
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    a = b.call(aten.exp.default, x)
    other = b.call(aten.sum.default, x)  # reads the group's input inside the span (and cannot join it)
    c = b.call(aten.sin.default, a)
    host_free = group_elementwise(verify(b.build([c, other])), pointwise)
    host_visible = group_elementwise(verify(b.build([c, other], host_visible=True)), pointwise)
    assert len(fused_nodes(host_free)) == 1 and fused_nodes(host_visible) == []


@pytest.mark.parametrize("opt_level", [0, 1, 2, 3])
def test_pipeline_levels_verify_and_record_history(opt_level):
    b = GraphBuilder()
    x = b.arg(torch.randn(4))
    d = b.call(aten.detach.default, x)
    y = b.call(aten.relu.default, d)
    b.call(aten.neg.default, x)
    result = run_pipeline(verify(b.build([y])), opt_level, check=True)
    names = [name for name, _, _ in result.history]
    assert names[0] == "record"
    assert (len(names) > 1) == (opt_level > 0)
    assert call_targets(result.graph) == (["aten.detach.default", "aten.relu.default", "aten.neg.default"]
                                          if opt_level == 0 else ["aten.relu.default"])
    assert result.graph.provenance.startswith(names[-1])
