"""without_host=True and gradients that exist when the call starts (put there by the caller, or by
another step's backward) and that the step frees itself with zero_grad(). The binding call saw
them freed: the program reads each where the function would, in `p.grad`, with either backend."""

from __future__ import annotations

import pytest
import torch
from models import assert_same_state, batch, make_model, train_step, twin

import tracejit


def _put_gradients(model, call: int) -> None:
    for index, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 0.01 * (call + 1) * (index + 1))


@pytest.mark.parametrize("backend", ["aten", "c"])
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused"])
def test_gradients_the_caller_puts_and_the_step_frees_run_without_the_host(backend, opt_name):
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), opt_name)
    traced = tracejit.trace(train_step, without_host=True, backend=backend)
    for call in range(6):
        x, y = batch("mlp", call)
        _put_gradients(model_a, call)
        _put_gradients(model_b, call)
        want = train_step(x, y, model=model_a, opt=opt_a)
        got = traced(x, y, model=model_b, opt=opt_b)
        assert torch.equal(want, got) if backend == "aten" else torch.allclose(want, got, atol=1e-6)
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=backend == "aten")
        assert all(p.grad is None for p in model_b.parameters())
    assert traced.stats.host_free_calls >= 3


def test_a_gradient_given_as_a_view_makes_the_call_run_the_function():
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "sgd_momentum")
    traced = tracejit.trace(train_step, without_host=True, backend="aten")
    for call in range(6):
        x, y = batch("mlp", call)
        for model in (model_a, model_b):
            _put_gradients(model, call)
            if call == 4:  # the last bias's gradient a view into a larger buffer
                bias = list(model.parameters())[-1]
                bias.grad = torch.full((2 * bias.numel(),), 0.5)[bias.numel():]
        want = train_step(x, y, model=model_a, opt=opt_a)
        got = traced(x, y, model=model_b, opt=opt_b)
        assert torch.equal(want, got)
        assert_same_state(model_a, opt_a, model_b, opt_b)
    assert traced.stats.host_free_calls >= 2
    assert traced.stats.host_free_misses >= 1


def _accumulating_step(x, y, *, model, opt, do_step):
    loss = torch.nn.functional.cross_entropy(model(x), y) / 4
    loss.backward()
    if do_step:
        opt.step()
        opt.zero_grad()
    return loss


@pytest.mark.parametrize("backend", ["aten", "c"])
def test_the_stepping_call_of_gradient_accumulation_runs_without_the_host(backend):
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "adam_fused")
    traced = tracejit.trace(_accumulating_step, without_host=True, backend=backend)
    for call in range(24):
        x, y = batch("mlp", call)
        do_step = call % 4 == 3
        want = _accumulating_step(x, y, model=model_a, opt=opt_a, do_step=do_step)
        got = traced(x, y, model=model_b, opt=opt_b, do_step=do_step)
        assert torch.allclose(want, got, atol=1e-6)
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=backend == "aten")
    # 3 recordings (no gradients yet, accumulating, stepping), one checked call binding; the rest without the host
    assert traced.stats.host_free_calls == 19


def _optimizer_step(*, opt):
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("without_host, opt_name", [(False, "sgd_momentum"), (False, "adam_foreach"), (False, "adam_fused"),
                                                    (True, "sgd_momentum"), (True, "adam_fused")])  # foreach reads step
def test_a_step_function_given_only_the_optimizer_reads_the_gradients_backward_made(without_host, opt_name):
    # the backward outside, the step traced: its parameters are found through the optimizer's
    # param groups (they stayed unnamed, and a checked call never bound at the API level)
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), opt_name)
    traced = tracejit.trace(_optimizer_step, without_host=without_host)
    for call in range(8):
        x, y = batch("mlp", call)
        for model in (model_a, model_b):
            torch.nn.functional.cross_entropy(model(x), y).backward()
        _optimizer_step(opt=opt_a)
        traced(opt=opt_b)
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=False)
    if without_host:
        assert traced.stats.host_free_calls >= 4
    else:
        assert traced.stats.api_replays >= 4 and traced.stats.api_fallbacks == 0
    assert "opt.param_groups[0]['params'][0].grad" in traced.listing()
