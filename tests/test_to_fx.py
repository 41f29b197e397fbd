"""to_fx(): a trace as a torch.fx.GraphModule that computes what the traced function computes."""

import operator

import pytest
import torch
import torch.nn.functional as F
from models import MLP, batch

import tracejit
from tracejit.ir import Op, to_fx

aten = torch.ops.aten


def call_targets(module):
    return [n.target for n in module.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def training_step(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def state_of(model, opt):
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def restore(model, opt, saved):
    live = list(model.parameters())
    for state in opt.state.values():
        live += [v for v in state.values() if isinstance(v, torch.Tensor)]
    with torch.no_grad():
        for tensor, value in zip(live, saved):
            tensor.copy_(value)


@pytest.mark.parametrize("without_host", [True, False])
def test_inference_mlp_module_reproduces_the_trace(without_host):
    model = MLP().eval()

    @tracejit.trace(without_host=without_host)
    def infer(x, *, model):
        return model(x)

    x = batch("mlp", 0)[0]
    with torch.no_grad():
        for _ in range(3):
            traced = infer(x, model=model)
    module = infer.to_fx()
    # parameters are attributes holding the model's own tensors, the input is the one placeholder
    assert [n.target for n in module.graph.nodes if n.op == "placeholder"] == ["x"]
    assert module.model_net_0_weight is model.net[0].weight
    assert all(isinstance(t, torch._ops.OpOverload) for t in call_targets(module))
    # the host-free graph (without_host, and checked replay at the API level) fuses addmm and relu
    assert infer._entries()[-1].host_free is not None
    expected_ops = {aten._addmm_activation.default, aten.addmm.default, aten.t.default}
    assert set(call_targets(module)) == expected_ops
    with torch.no_grad():
        assert torch.equal(module(x), traced)
        x2 = batch("mlp", 1)[0]
        assert torch.equal(module(x2), model(x2))


@pytest.mark.parametrize("without_host,opt_name", [(True, "adam_fused"), (False, "adam_fused"), (False, "sgd")])
def test_training_step_module_updates_parameters_like_the_trace(without_host, opt_name):
    model = MLP()
    opt = (torch.optim.Adam(model.parameters(), lr=1e-2, fused=True) if opt_name == "adam_fused"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    traced_step = tracejit.trace(training_step, without_host=without_host)
    for i in range(3):
        traced_step(*batch("mlp", i), model=model, opt=opt)
    module = traced_step.to_fx()
    x, y = batch("mlp", 3)
    before = state_of(model, opt)
    loss_traced = traced_step(x, y, model=model, opt=opt)
    after_traced = state_of(model, opt)
    restore(model, opt, before)
    loss_module = module(x, y)
    after_module = state_of(model, opt)
    assert torch.equal(loss_module, loss_traced)
    assert len(after_module) == len(after_traced) > 6
    for a, b in zip(after_module, after_traced):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(after_module, before))  # the step did change them


def test_in_place_writes_through_views_are_seen_by_later_reads():
    @tracejit.trace(without_host=True, opt_level=0)
    def f(x):
        y = x * 2
        y.add_(1)
        row = y[0]
        row.mul_(3)  # writes y's storage through a view
        z = y * y
        return {"z": z, "y": y}

    x = torch.randn(3, 4)
    for _ in range(2):
        traced = f(x)
    module = f.to_fx()
    assert aten.add_.Tensor in call_targets(module) and aten.mul_.Tensor in call_targets(module)
    out = module(x)
    assert set(out) == {"z", "y"}
    expected = x * 2 + 1
    expected[0] *= 3
    assert torch.equal(out["y"], expected) and torch.equal(out["z"], expected * expected)
    assert torch.equal(out["z"], traced["z"])


def test_fused_nodes_are_expanded_into_their_members():
    @tracejit.trace(without_host=True, backend="reference")
    def chain(x, y):
        return ((x * y + 1).sigmoid() * x - y).tanh() * 0.5 + x

    x, y = torch.randn(64), torch.randn(64)
    for _ in range(2):
        traced = chain(x, y)
    graph = chain._entries()[0].host_free.program.graph
    fused = [n for n in graph.nodes if n.op is Op.FUSED]
    assert len(fused) == 1
    module = chain.to_fx()
    assert call_targets(module) == [m.target for m in fused[0].members]
    assert torch.equal(module(x, y), traced)


def test_externals_without_objects_become_placeholders():
    model = MLP().eval()

    @tracejit.trace(without_host=True)
    def infer(x, *, model):
        return model(x)

    x = batch("mlp", 0)[0]
    with torch.no_grad():
        infer(x, model=model)
        traced = infer(x, model=model)
    graph = infer._entries()[0].host_free.program.graph
    module = to_fx(graph)
    names = [n.target for n in module.graph.nodes if n.op == "placeholder"]
    assert names == ["x"] + [f"model_net_{i}_{p}" for i in (0, 2, 4) for p in ("weight", "bias")]
    params = [p for layer in (0, 2, 4) for p in (model.net[layer].weight, model.net[layer].bias)]
    with torch.no_grad():
        (out,) = module(x, *params)
    assert torch.equal(out, traced)


def test_source_lines_and_value_names_carry_over():
    @tracejit.trace
    def f(x):
        return (x + 1).relu()

    x = torch.randn(5)
    f(x)
    module = f.to_fx()
    calls = [n for n in module.graph.nodes if n.op == "call_function"]
    assert [n.name for n in calls] == ["t1", "t2"]
    assert all("test_to_fx.py" in n.meta["stack_trace"] for n in calls)
    assert "return (x + 1).relu()" in calls[0].meta["stack_trace"]
    assert torch.equal(module(x), (x + 1).relu())


def test_to_fx_before_any_call_is_refused():
    traced = tracejit.trace(lambda x: x + 1)
    with pytest.raises(RuntimeError, match="no trace yet"):
        traced.to_fx()
