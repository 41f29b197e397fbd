"""Parameters replaced between calls (`lin.weight = nn.Parameter(w)`, `load_state_dict(...,
assign=True)`), found by an adversarial hunt (2026-11-27): the gradient state that picks a trace
(which parameters require grad and hold a `.grad`) listed a module's parameters once and kept
reading the replaced objects. A frozen replacement kept training, and accumulation after a
restore overwrote `.grad` instead of adding to it, in every mode. Each test failed before its fix.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from models import train_step
from torch import nn

import tracejit

MODES = {"checked": {}, "symbolic": {"symbolic": True}, "without_host": {"without_host": True}}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(i)
    return torch.randn(5, 6, generator=generator), torch.randint(0, 3, (5,), generator=generator)


def _assert_same(eager: nn.Module, traced: nn.Module, where: str) -> None:
    for (name, a), b in zip(eager.named_parameters(), traced.parameters()):
        assert torch.equal(a, b), f"{where}: {name}"
        assert (a.grad is None) == (b.grad is None), f"{where}: {name}.grad"
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), f"{where}: {name}.grad"


def _compared_step(i: int, traced, eager: nn.Module, model: nn.Module, optimizers: list) -> None:
    """Call i of train_step, eagerly on `eager` and traced on `model`: the same loss and state."""
    x, y = _batch(i)
    want = train_step(x, y, model=eager, opt=optimizers[0])
    got = traced(x, y, model=model, opt=optimizers[1])
    assert torch.equal(got.detach(), want.detach()), f"call {i}"
    _assert_same(eager, model, f"call {i}")


def _accumulating_step(x, y, *, model, opt, do_step):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if do_step:
        opt.step()
        opt.zero_grad()
    return loss


@pytest.mark.parametrize("mode", MODES)
def test_a_replaced_parameter_frozen_later_stays_frozen(mode):
    eager = _model()
    model = copy.deepcopy(eager)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    traced = tracejit.trace(train_step, backend="aten", **MODES[mode])
    weight = torch.randn(8, 6)
    for i in range(8):
        if i == 2:  # a new first layer weight, which the optimizer follows
            for m, opt in zip((eager, model), optimizers):
                old = m[0].weight
                m[0].weight = nn.Parameter(weight.clone())
                group = opt.param_groups[0]
                group["params"] = [m[0].weight if p is old else p for p in group["params"]]
        if i == 4:
            eager[0].weight.requires_grad_(False)
            model[0].weight.requires_grad_(False)
        _compared_step(i, traced, eager, model, optimizers)
    stats = traced.stats
    assert stats.checked_replays + stats.host_free_calls >= 4, stats


@pytest.mark.parametrize("mode", MODES)
def test_accumulation_after_a_restore_by_assignment_adds_to_the_gradients(mode):
    eager = _model()
    model = copy.deepcopy(eager)
    checkpoint = copy.deepcopy(eager.state_dict())

    def optimizer(m):
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    optimizers = [optimizer(eager), optimizer(model)]
    traced = tracejit.trace(_accumulating_step, backend="aten", **MODES[mode])
    for i in range(18):
        if i == 9:  # restore by assignment (new Parameter objects), with a new optimizer
            for m in (eager, model):
                m.load_state_dict(copy.deepcopy(checkpoint), assign=True)
            optimizers = [optimizer(eager), optimizer(model)]
        x, y = _batch(i)
        do_step = i % 3 == 2
        want = _accumulating_step(x, y, model=eager, opt=optimizers[0], do_step=do_step)
        got = traced(x, y, model=model, opt=optimizers[1], do_step=do_step)
        assert torch.equal(got.detach(), want.detach()), f"call {i}"
        _assert_same(eager, model, f"call {i}")
    stats = traced.stats
    assert stats.checked_replays + stats.host_free_calls >= 9, stats


def test_a_new_parameter_outside_the_optimizer_accumulates_its_gradient_without_the_host():
    eager = _model()
    model = copy.deepcopy(eager)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, model)]
    traced = tracejit.trace(train_step, backend="aten", without_host=True)
    weight = torch.randn(8, 6)
    for i in range(6):
        if i == 1:  # a new first layer weight the optimizer does not hold: its .grad accumulates
            for m in (eager, model):
                m[0].weight = nn.Parameter(weight.clone())
        _compared_step(i, traced, eager, model, optimizers)
    assert traced.stats.host_free_calls >= 2, traced.stats


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.register_parameter("scale", None)  # an optional parameter, absent

    def forward(self, x):
        out = self.lin(x)
        return out + self.shift if "shift" in self._parameters else out


def test_a_parameter_registered_where_a_none_entry_was_removed_is_seen():
    """`del m.scale` (a None entry) then `register_parameter("shift", p)`: as many entries as
    before and every recorded name read as None, so the cached list missed `shift` and its
    freezing (found by review of the cache)."""
    torch.manual_seed(0)
    eager = _Scaled()
    model = copy.deepcopy(eager)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    traced = tracejit.trace(train_step, backend="aten", without_host=True)
    for i in range(7):
        if i == 2:
            for m, opt in zip((eager, model), optimizers):
                del m.scale
                m.register_parameter("shift", nn.Parameter(torch.zeros(3)))
                opt.add_param_group({"params": [m.shift]})
        if i == 4:
            eager.shift.requires_grad_(False)
            model.shift.requires_grad_(False)
        _compared_step(i, traced, eager, model, optimizers)
    assert traced.stats.host_free_calls >= 2, traced.stats
