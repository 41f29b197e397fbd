"""`k / t` (Tensor.__rdiv__, `t.reciprocal() * k` in torch) with a Python number that changes
between calls: the number goes to the program's mul at the torch API level, as `t * k` does,
instead of making every such call diverge (clip_grad_norm_'s `max_norm / total_norm`)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit

NUMBERS = [0.5, 0.5, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.7, 2.0]


def clipped_step(x, y, *, model, opt, max_norm):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    opt.zero_grad()
    return loss


def inverse_loss_step(x, y, *, model, opt, max_norm):
    # the number before backward: its gradient (MulBackward0) takes it too
    loss = max_norm / (1 + F.cross_entropy(model(x), y))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("backend", ["aten", "c"])
@pytest.mark.parametrize("step", [clipped_step, inverse_loss_step], ids=lambda f: f.__name__)
def test_a_changing_number_divided_by_a_tensor_stays_at_the_api_level(backend, step):
    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model_b = copy.deepcopy(model_a)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.5)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.5)
    traced = tracejit.trace(step, backend=backend)
    same = torch.equal if backend == "aten" else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-7))
    for i, number in enumerate(NUMBERS):
        generator = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 6, generator=generator) * 3, torch.randint(0, 3, (4,), generator=generator)
        want = step(x, y, model=model_a, opt=opt_a, max_norm=number)
        got = traced(x, y, model=model_b, opt=opt_b, max_norm=number)
        assert same(got, want), (i, got, want)
        for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
            assert same(a, b), i
    stats = traced.stats
    # before backward a number is passed on once a call saw its backward op change with it (as
    # for `t * k`, see _backward_links): that first new number runs its call at the aten level
    fallbacks = 0 if step is clipped_step else 1
    assert stats.api_fallbacks == fallbacks and stats.api_replays >= len(NUMBERS) - 3 - fallbacks, stats
