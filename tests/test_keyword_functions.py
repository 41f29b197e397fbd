"""A function passed by keyword (a loss, an activation) selects a trace of its own.

A step given `loss_fn=F.l1_loss` after `F.mse_loss` dispatches other ops: a checked call used to
raise TraceMismatchError for it (the signature did not tell the functions apart). Now each function
is a trace of its own in every mode, while a lambda or closure made anew on every call is one
function (its captured numbers reach the ops, where a checked call compares them)."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit
from tracejit.signature import describe_signature, signature


def _step(x, y, *, model, opt, loss_fn):
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


class _Losses:
    def __init__(self, delta):
        self.delta = delta

    def huber(self, a, b):
        return F.huber_loss(a, b, delta=self.delta)


class _Absolute:
    def __call__(self, a, b):
        return (a - b).abs().mean()


class _Squared:
    def __call__(self, a, b):
        return (a - b).pow(2).mean()


MODES = [{}, {"backend": "aten"}, {"without_host": True}]


def _pair():
    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model_b = copy.deepcopy(model_a)
    return (model_a, torch.optim.Adam(model_a.parameters(), lr=0.05, fused=True)), \
        (model_b, torch.optim.Adam(model_b.parameters(), lr=0.05, fused=True))


def _assert_same(model_a, opt_a, model_b, opt_b, exact):
    for a, b in zip([*model_a.parameters(), *(t for s in opt_a.state.values() for t in s.values())],
                    [*model_b.parameters(), *(t for s in opt_b.state.values() for t in s.values())]):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("options", MODES, ids=["checked", "aten", "without_host"])
def test_each_keyword_function_is_a_trace_of_its_own(options):
    (model_a, opt_a), (model_b, opt_b) = _pair()
    traced = tracejit.trace(_step, **options)
    functions = [F.mse_loss, F.l1_loss, functools.partial(F.huber_loss, delta=0.5), _Losses(0.5).huber,
                 _Absolute(), _Squared(), F.mse_loss]
    exact = options.get("backend") == "aten"
    for function in functions:
        for _ in range(3):
            x, y = torch.randn(6, 4), torch.randn(6, 2)
            want = _step(x, y, model=model_a, opt=opt_a, loss_fn=function)
            got = traced(x, y, model=model_b, opt=opt_b, loss_fn=function)
            assert torch.equal(want, got) if exact else torch.allclose(want, got, atol=1e-6, rtol=1e-5)
            _assert_same(model_a, opt_a, model_b, opt_b, exact)
    stats = traced.stats
    # one trace per function (Adam's first step records once more: its state is new), none for the return to mse
    assert stats.records + stats.rerecords <= len(functions)
    assert len(traced._entries()) >= len(functions) - 1
    replayed = stats.host_free_calls if options.get("without_host") else stats.checked_replays
    assert replayed >= len(functions)


@pytest.mark.parametrize("options", MODES, ids=["checked", "aten", "without_host"])
def test_a_closure_made_on_every_call_is_one_function(options):
    # the weight it captures changes on every call and reaches the ops as a number
    (model_a, opt_a), (model_b, opt_b) = _pair()
    traced = tracejit.trace(_step, **options)
    for call in range(8):
        weight = 1.0 + call
        loss_fn = (lambda w: lambda a, b: w * F.mse_loss(a, b))(weight)
        x, y = torch.randn(6, 4), torch.randn(6, 2)
        want = _step(x, y, model=model_a, opt=opt_a, loss_fn=loss_fn)
        got = traced(x, y, model=model_b, opt=opt_b, loss_fn=loss_fn)
        assert torch.allclose(want, got, atol=1e-6, rtol=1e-5), call
        _assert_same(model_a, opt_a, model_b, opt_b, exact=False)
    assert len(traced._entries()) <= 2 and traced.stats.checked_replays + traced.stats.host_free_calls >= 5


def test_keyword_functions_in_a_dict_are_told_apart():
    (model_a, opt_a), (model_b, opt_b) = _pair()

    def step(x, y, *, model, opt, losses):
        return _step(x, y, model=model, opt=opt, loss_fn=losses["main"])

    traced = tracejit.trace(step)
    for function in (F.mse_loss, F.l1_loss, F.mse_loss, F.l1_loss):
        for _ in range(2):
            x, y = torch.randn(6, 4), torch.randn(6, 2)
            want = step(x, y, model=model_a, opt=opt_a, losses={"main": function})
            got = traced(x, y, model=model_b, opt=opt_b, losses={"main": function})
            assert torch.allclose(want, got, atol=1e-6, rtol=1e-5)
    assert len(traced._entries()) == 2 + 1  # mse (before and after Adam's state), l1


def test_the_signature_names_the_keyword_function():
    text = describe_signature(signature((torch.ones(2),), {"loss_fn": F.mse_loss, "act": torch.tanh}), ["x"])
    assert "kw['loss_fn']: function mse_loss" in text and "kw['act']: builtin tanh" in text, text


def test_a_module_past_the_sixty_fourth_item_of_a_keyword_list_selects_a_trace():
    def through(x, *, mods):
        for m in mods:
            x = m(x)
        return x.detach()

    torch.manual_seed(0)
    mods = [nn.Identity() for _ in range(70)] + [nn.BatchNorm1d(3).eval()]
    traced = tracejit.trace(through)
    for i in range(6):
        if i == 3:
            mods[-1].train()
        x = torch.randn(4, 3)
        want = through(x, mods=copy.deepcopy(mods))
        assert torch.allclose(traced(x, mods=mods), want, atol=1e-6), i
