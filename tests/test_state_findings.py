"""Python state a replayed call must leave as eager does, found by review (2026-11-26): gradients
the caller holds, parameters frozen through a closure, tensors carried from call to call, `.data`
and `requires_grad_()` inside the step. Each case runs eager and traced side by side from the same
state over several calls, in checked replay (which reaches the API level) and without the host,
and compares every parameter, gradient and output exactly."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracejit

CALLS = 9
MODES = {"checked": {}, "without_host": {"without_host": True}}


def fast_calls(traced, mode: str) -> int:
    """Calls that ran the compiled program without the function's aten ops: proof the fast path ran."""
    stats = traced.stats
    return stats.host_free_calls if mode == "without_host" else stats.api_replays


def assert_same_model(eager: nn.Module, traced: nn.Module, where: str) -> None:
    for (name, a), b in zip(eager.named_parameters(), traced.parameters()):
        assert torch.equal(a, b), f"{where}: {name}"
        assert (a.grad is None) == (b.grad is None), f"{where}: {name}.grad is None: eager {a.grad is None}"
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), f"{where}: {name}.grad"
        assert a.requires_grad == b.requires_grad, f"{where}: {name}.requires_grad"


def sgd_step(x, y, *, m, opt):
    loss = F.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("mode", MODES)
def test_a_gradient_the_caller_holds_is_still_cleared_by_zero_grad(mode):
    """An auxiliary loss backpropagated outside the step leaves `.grad` set when some calls begin,
    and the caller keeps a reference to it: the step's zero_grad() must still leave `.grad` None."""
    torch.manual_seed(0)
    data = [(torch.randn(5, 4), torch.randn(5, 2)) for _ in range(CALLS + 3)]
    models = [nn.Linear(4, 2)]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    traced = tracejit.trace(sgd_step, **MODES[mode])
    held = []
    for i, (x, y) in enumerate(data):
        losses = []
        for step, m, opt in ((sgd_step, models[0], opts[0]), (traced, models[1], opts[1])):
            if i % 3 == 2:
                (m.weight.sum() * 0.01).backward()  # outside the step
                held.append(m.weight.grad)
            losses.append(step(x, y, m=m, opt=opt))
        assert torch.equal(*losses), f"call {i}"
        assert_same_model(models[0], models[1], f"call {i}")
    assert fast_calls(traced, mode) >= 2


def make_closure_step(model):
    def step(x, y, *, opt):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


@pytest.mark.parametrize("mode", MODES)
def test_freezing_a_layer_of_a_closure_model_selects_a_trace_of_its_own(mode):
    """requires_grad_(False) on a layer of a model the step reaches by closure, between calls: the
    layer stops training as in eager (it kept training before)."""
    torch.manual_seed(0)
    data = [(torch.randn(5, 4), torch.randn(5, 2)) for _ in range(CALLS)]
    models = [nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    steps = [make_closure_step(models[0]), tracejit.trace(make_closure_step(models[1]), **MODES[mode])]
    for i, (x, y) in enumerate(data):
        if i == 4:
            for m in models:
                m[0].requires_grad_(False)
        if i == 7:
            for m in models:
                m[0].requires_grad_(True)
        losses = [step(x, y, opt=opt) for step, opt in zip(steps, opts)]
        assert torch.equal(*losses), f"call {i}"
        assert_same_model(models[0], models[1], f"call {i}")
    assert steps[1].stats.records == 2  # one trace per requires_grad state
    assert fast_calls(steps[1], mode) >= 3
