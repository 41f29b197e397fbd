"""A branch the first call takes because of state it then changes (AveragedModel's
`if self.n_averaged == 0: copy`) goes the other way on the next call, as an optimizer's lazily
made state differs on the next call: the first replay of such a trace records again instead of
raising TraceMismatchError. A branch on the inputs' values still raises."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import tracejit


def _swa_step(x, y, *, model, opt, avg):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    avg.update_parameters(model)
    return loss.detach()


@pytest.mark.parametrize("averaging", ["swa", "ema"])
@pytest.mark.parametrize("backend", ["aten", "c"])
def test_an_averaged_model_updated_inside_the_step_trains_as_eager(averaging, backend):
    # used to raise TraceMismatchError on the 2nd call (plain SGD: the record created no state)
    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    model_b = copy.deepcopy(model_a)
    options = {"multi_avg_fn": get_ema_multi_avg_fn(0.9)} if averaging == "ema" else {}
    avg_a, avg_b = AveragedModel(model_a, **options), AveragedModel(model_b, **options)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.05)
    traced = tracejit.trace(_swa_step, backend=backend)
    generator = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 4, (8,), generator=generator)
        want = _swa_step(x, y, model=model_a, opt=opt_a, avg=avg_a)
        got = traced(x, y, model=model_b, opt=opt_b, avg=avg_b)
        assert torch.allclose(want, got, atol=1e-6)
        for a, b in zip(avg_a.state_dict().values(), avg_b.state_dict().values()):
            assert torch.allclose(a.float(), b.float(), atol=1e-6)
    assert avg_b.n_averaged.item() == 6
    assert traced.stats.records == 1 and traced.stats.rerecords == 1 and traced.stats.checked_replays >= 4


def test_a_branch_on_the_inputs_values_still_raises_on_the_first_replay():
    @tracejit.trace
    def f(x, *, count):
        s = x.sum()
        out = x * 2 if s.item() > 0 else x - 2
        count.add_(1)  # state the call changes, which the branch does not read
        return out

    count = torch.zeros(())
    f(torch.ones(3), count=count)
    with pytest.raises(tracejit.TraceMismatchError, match="aten.sub.Tensor instead of aten.mul.Tensor"):
        f(-torch.ones(3), count=count)


def test_a_branch_on_the_loss_of_a_training_step_still_raises_on_the_first_replay():
    # the parameters the loss depends on are state the step writes, but the loss depends on the
    # inputs too: such a branch is no first-call initialization
    model = nn.Linear(4, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    @tracejit.trace
    def step(x, *, model, opt):
        loss = model(x).sum()
        loss = loss * 2 if loss.item() > 0 else loss - 1
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with torch.no_grad():
        model.weight.fill_(1.0)
    step(torch.ones(2, 4), model=model, opt=opt)
    with pytest.raises(tracejit.TraceMismatchError, match="aten.sub.Tensor instead of aten.mul.Tensor"):
        step(-torch.ones(2, 4), model=model, opt=opt)


def _mse_step(x, y, *, model, opt):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("options", [{}, {"without_host": True}, {"backend": "aten"}])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_resetting_the_optimizer_state_of_a_re_initialized_head_records_again(options, optimizer):
    # the state of some parameters only dropped (`opt.state.pop(p)`): the next step creates it
    # lazily, as the first call did; it raised TraceMismatchError in every mode
    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    model_b = copy.deepcopy(model_a)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=0.01, fused=True)}[optimizer]
    opt_a, opt_b = make(model_a.parameters()), make(model_b.parameters())
    traced = tracejit.trace(_mse_step, **options)
    generator = torch.Generator().manual_seed(2)
    for call in range(9):
        if call == 4:
            torch.manual_seed(5)
            model_a[2].reset_parameters()
            torch.manual_seed(5)
            model_b[2].reset_parameters()
            for model, opt in ((model_a, opt_a), (model_b, opt_b)):
                for p in model[2].parameters():
                    opt.state.pop(p)
        x, y = torch.randn(5, 6, generator=generator), torch.randn(5, 3, generator=generator)
        want = _mse_step(x, y, model=model_a, opt=opt_a)
        assert torch.allclose(want, traced(x, y, model=model_b, opt=opt_b), atol=1e-6), call
        for a, b in zip(model_a.parameters(), model_b.parameters()):
            assert torch.allclose(a, b, atol=1e-6)
    assert traced.stats.rerecords >= 2 and traced.stats.calls - traced.stats.records - traced.stats.rerecords >= 5
