"""The batched layout check of a host-free call's externals (runtime/meta_guard.py): once learned
it must never let a changed tensor through, and a call in another dispatch state only costs the
precise checks."""

import pytest
import torch
import torch.nn as nn

import tracejit
from tracejit.runtime.meta_guard import MetaGuard


def test_a_learned_guard_passes_only_the_learned_layouts():
    a, b = torch.randn(4, 3, requires_grad=True), torch.tensor(2.0)
    guard = MetaGuard()
    assert not guard.check(a, b)  # nothing learned: the precise checks run
    guard.learn(a, b)
    assert guard.check(a, b)
    assert guard.check(torch.randn(4, 3, requires_grad=True), torch.tensor(5.0))  # other values, same facts
    assert not guard.check(torch.randn(3, 4, requires_grad=True), b)
    assert not guard.check(a, b.double())
    # the same shape in another layout: the program (and the gradient layout it gives) was built for the learned one
    assert not guard.check(torch.randn(3, 4, requires_grad=True).t(), b)
    assert not guard.check(a, None)
    with torch.inference_mode():  # another dispatch state: not vouched for
        assert not guard.check(a, b)


def make():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.Adam(model.parameters(), lr=0.1, fused=True)


def step(x, *, model, opt):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def apply(change, model, opt):
    with torch.no_grad():
        if change == "parameter_shape":  # same object, another shape: it broadcasts in forward
            model.bias.data = model.bias[:1].clone()
            opt.state[model.bias]["exp_avg"] = opt.state[model.bias]["exp_avg"][:1].clone()
            opt.state[model.bias]["exp_avg_sq"] = opt.state[model.bias]["exp_avg_sq"][:1].clone()
        else:  # an optimizer state of another dtype
            state = opt.state[model.weight]
            state["exp_avg"] = state["exp_avg"].double()


def outcome(call, model, opt, x):
    try:
        return call(x, model=model, opt=opt), [p.detach().clone() for p in model.parameters()]
    except Exception as error:  # noqa: BLE001 - compared with eager's
        return type(error), None


@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("change", ["parameter_shape", "state_dtype"])
def test_an_external_whose_layout_changes_after_the_guard_learned_is_not_bound(without_host, change):
    # after several calls the batched check holds the layouts; a parameter given another shape in
    # place (same object) or an optimizer state of another dtype must fail it: the call then
    # computes what eager does, or raises (eager's error, or TraceMismatchError naming the change)
    model_a, opt_a = make()
    model_b, opt_b = make()
    traced = tracejit.trace(step, without_host=without_host, backend="aten")
    x = torch.randn(5, 4)
    for _ in range(6):
        assert torch.equal(traced(x, model=model_b, opt=opt_b), step(x, model=model_a, opt=opt_a))
    stats = traced.stats
    assert (stats.host_free_calls if without_host else stats.api_replays) >= 3, stats
    apply(change, model_a, opt_a)
    apply(change, model_b, opt_b)
    for _ in range(2):
        want, want_params = outcome(step, model_a, opt_a, x)
        got, got_params = outcome(traced, model_b, opt_b, x)
        if got_params is None:  # loud: eager's error, or the mismatch naming the changed tensor
            assert got in (want, tracejit.TraceMismatchError)
            break
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_params, want_params, strict=True))


def _changed_input(change):
    x = torch.randn(5, 4)
    if change == "requires_grad":
        return x.requires_grad_()
    if change == "layout":  # same shape, transposed strides
        return torch.randn(4, 5).t()
    if change == "dtype":
        return x.double()
    if change == "inference":
        with torch.inference_mode():
            return torch.randn(5, 4)
    if change == "negative_view":
        return torch.randn(5, 4)._neg_view()
    return x.as_subclass(_Marked)


class _Marked(torch.Tensor):
    pass


@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("change", ["requires_grad", "layout", "dtype", "inference", "negative_view", "subclass"])
def test_an_input_of_another_signature_after_the_guard_learned_is_not_admitted(without_host, change):
    # the input signature checks of host-free and checked calls run in one C++ call once learned:
    # an input differing in any recorded fact must still select another trace (or raise eager's error)
    model_a, opt_a = make()
    model_b, opt_b = make()
    traced = tracejit.trace(step, without_host=without_host, backend="aten")
    x = torch.randn(5, 4)
    for _ in range(5):
        assert torch.equal(traced(x, model=model_b, opt=opt_b), step(x, model=model_a, opt=opt_a))
    stats = traced.stats
    assert (stats.host_free_calls if without_host else stats.api_replays) >= 2, stats
    records = stats.records + stats.rerecords
    other = _changed_input(change)
    want, want_params = outcome(step, model_a, opt_a, other.detach().clone() if change == "requires_grad" else other)
    got, got_params = outcome(traced, model_b, opt_b, other)
    if want_params is None:
        assert got is want
        return
    assert torch.equal(got.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor))
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params, strict=True))
    assert stats.records + stats.rerecords > records or stats.eager_calls, stats  # not the learned trace
