"""A symbolic recording whose run for real raises at an op (a bad batch: a label out of range)
leaves the Python state as an eager call that raised there: `.grad` and optimizer state the
recording's backward and step set to placeholders of ops that never ran are put back."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import train_step as train

import tracejit

MODES = [{"symbolic": True}, {"symbolic_shape": True}]


def accumulate(x, y, *, model):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def zero_first(x, y, *, model):
    model.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def batches():
    generator = torch.Generator().manual_seed(0)
    x, good = torch.randn(16, 12, generator=generator), torch.randint(0, 5, (16,), generator=generator)
    bad = good.clone()
    bad[3] = 99
    return x, good, bad


def outcome(step, *args, **kwargs):
    try:
        return step(*args, **kwargs)
    except IndexError:
        return IndexError


def assert_same_gradients(model_a, model_b):
    for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("options", MODES, ids=str)
def test_a_first_call_that_raises_leaves_no_gradient_and_the_next_accumulates_as_eager(options):
    torch.manual_seed(0)
    model_a = nn.Linear(12, 5)
    model_b = copy.deepcopy(model_a)
    traced = tracejit.trace(accumulate, backend="aten", **options)
    x, good, bad = batches()
    assert outcome(accumulate, x, bad, model=model_a) is IndexError
    assert outcome(traced, x, bad, model=model_b) is IndexError
    assert model_b.weight.grad is None and model_b.bias.grad is None  # as eager leaves them
    for _ in range(4):
        assert torch.equal(traced(x, good, model=model_b), accumulate(x, good, model=model_a))
        assert_same_gradients(model_a, model_b)
    assert traced.stats.checked_replays >= 2, traced.stats


@pytest.mark.parametrize("options", MODES, ids=str)
@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
def test_a_first_training_step_that_raises_leaves_no_optimizer_state(options, optimizer):
    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5))
    model_b = copy.deepcopy(model_a)

    def make(model):
        if optimizer == "adam":
            return torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)  # symbolic: no host reads
        return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    opt_a, opt_b = make(model_a), make(model_b)
    traced = tracejit.trace(train, backend="aten", **options)
    x, good, bad = batches()
    assert outcome(train, x, bad, model=model_a, opt=opt_a) is IndexError
    assert outcome(traced, x, bad, model=model_b, opt=opt_b) is IndexError
    assert not opt_b.state and not opt_a.state
    assert all(p.grad is None for p in model_b.parameters())
    for _ in range(4):
        assert torch.equal(traced(x, good, model=model_b, opt=opt_b), train(x, good, model=model_a, opt=opt_a))
        for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
            assert torch.equal(a, b)
        for state_a, state_b in zip(opt_a.state.values(), opt_b.state.values(), strict=True):
            for key, value in state_a.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b[key])), key
    assert traced.stats.checked_replays >= 2, traced.stats


def test_bad_batches_later_in_a_symbolic_shape_training_leave_no_gradient():
    torch.manual_seed(0)
    model_a = nn.Linear(12, 5)
    model_b = copy.deepcopy(model_a)
    traced = tracejit.trace(zero_first, backend="aten", symbolic_shape=True)
    x, good, bad = batches()
    for labels in [good, good, good, good, bad, good, bad, bad, good]:
        want = outcome(zero_first, x, labels, model=model_a)
        got = outcome(traced, x, labels, model=model_b)
        assert (got is IndexError) == (want is IndexError)
        if want is not IndexError:
            assert torch.equal(got, want)
        assert_same_gradients(model_a, model_b)
    assert traced.stats.checked_replays >= 2, traced.stats
