"""Calls alternating between two traces take the fast paths of both (hunt N, C7): the generated
host-free call or the API level's signature check of the last two traces used, not the full
signature and lookup on every call."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit


def _accumulating_step(x, y, *, model, opt, do_step):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    if do_step:
        opt.step()
        opt.zero_grad()
    return loss.detach()


def _pair():
    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model_b = copy.deepcopy(model_a)
    return ((model_a, torch.optim.Adam(model_a.parameters(), lr=0.01, fused=True)),
            (model_b, torch.optim.Adam(model_b.parameters(), lr=0.01, fused=True)))


@pytest.mark.parametrize("options", [{}, {"without_host": True}], ids=["checked", "without_host"])
@pytest.mark.parametrize("alternating", ["batch_size", "do_step"])
def test_two_alternating_traces_both_take_the_fast_path(options, alternating, monkeypatch):
    (model_a, opt_a), (model_b, opt_b) = _pair()
    traced = tracejit.trace(_accumulating_step, **options)
    slow = []
    original = type(traced)._call
    monkeypatch.setattr(type(traced), "_call", lambda self, a, k: slow.append(1) or original(self, a, k))
    for i in range(24):
        n = 6 + i % 2 if alternating == "batch_size" else 6
        do_step = True if alternating == "batch_size" else i % 2 == 1
        x, y = torch.randn(n, 4), torch.randn(n, 2)
        want = _accumulating_step(x, y, model=model_a, opt=opt_a, do_step=do_step)
        got = traced(x, y, model=model_b, opt=opt_b, do_step=do_step)
        assert torch.allclose(want, got, atol=1e-6, rtol=1e-5), i
        for p, q in zip(model_a.parameters(), model_b.parameters()):
            assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), i
    # warm: neither trace goes through the signature and lookup (each warms up in a few calls)
    assert len(slow) <= 12, len(slow)
    fast = traced.stats.host_free_calls if options else traced.stats.api_replays
    assert fast >= 12


def _step_on_a_batch_dict(*, batch, model, opt):
    loss = F.mse_loss(model(batch["x"]), batch["y"])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_without_host_calls_that_keep_missing_say_which_guard_fails():
    # a batch in a keyword dict is a new tensor where the program was bound to the old one: every
    # call ran the function, at a twentieth of eager's speed, and nothing said so
    (model_a, opt_a), (model_b, opt_b) = _pair()
    traced = tracejit.trace(_step_on_a_batch_dict, without_host=True)
    with pytest.warns(tracejit.HostFreeMissWarning, match=r"kwargs\['batch'\]\['x'\] is another tensor"):
        for i in range(6):
            batch = {"x": torch.randn(5, 4), "y": torch.randn(5, 2)}
            want = _step_on_a_batch_dict(batch=batch, model=model_a, opt=opt_a)
            got = traced(batch=batch, model=model_b, opt=opt_b)
            assert torch.allclose(want, got, atol=1e-6, rtol=1e-5), i
    assert traced.stats.host_free_misses >= 3


def test_a_rarely_missing_host_free_trace_does_not_warn():
    # misses were compared with the calls of the slow path only: every miss looked like a whole
    (model_a, opt_a), (model_b, opt_b) = _pair()
    traced = tracejit.trace(_accumulating_step, without_host=True)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(60):
            if i % 10 == 9:  # a new optimizer every ten calls: the next call runs the function
                opt_a = torch.optim.Adam(model_a.parameters(), lr=0.01, fused=True)
                opt_b = torch.optim.Adam(model_b.parameters(), lr=0.01, fused=True)
            x, y = torch.randn(6, 4), torch.randn(6, 2)
            want = _accumulating_step(x, y, model=model_a, opt=opt_a, do_step=True)
            assert torch.allclose(traced(x, y, model=model_b, opt=opt_b, do_step=True), want, atol=1e-6, rtol=1e-5)
    assert not [w for w in caught if issubclass(w.category, tracejit.HostFreeMissWarning)]
    assert traced.stats.host_free_calls >= 30


def test_the_garbage_collector_runs_during_the_function_of_a_slow_call():
    # it was paused for the whole slow path, the user's function included
    import gc

    seen = []

    def step(x):
        seen.append(gc.isenabled())
        return x.neg().exp()

    traced = tracejit.trace(step)
    for _ in range(3):
        traced(torch.ones(2))
    assert all(seen) and gc.isenabled()
