"""Python values a call without the host must not take for granted: which module a keyword
names, functions held as settings (`self.act = torch.tanh`, a global, a closure cell, a helper
defined again), and numpy scalars. Another one computes something else: the call runs the
function, which follows it (a new trace) or says where it diverged, never the recorded program."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import tracejit


def _loss_step(x, y, *, model, opt, loss_fn):
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _pair():
    torch.manual_seed(0)
    eager = nn.Linear(4, 3)
    traced = nn.Linear(4, 3)
    traced.load_state_dict(eager.state_dict())
    return (eager, torch.optim.SGD(eager.parameters(), lr=0.1)), (traced, torch.optim.SGD(traced.parameters(), lr=0.1))


@pytest.mark.parametrize("without_host", [False, True])
def test_a_keyword_criterion_of_another_class_records_a_trace_of_its_own(without_host):
    # without the host, the L1Loss calls computed MSE (weights 0.1 off after two calls)
    (model_a, opt_a), (model_b, opt_b) = _pair()
    traced = tracejit.trace(_loss_step, without_host=without_host)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    for criterion in [nn.MSELoss()] * 3 + [nn.L1Loss()] * 3 + [nn.MSELoss()] * 2:
        want = _loss_step(x, y, model=model_a, opt=opt_a, loss_fn=criterion)
        got = traced(x, y, model=model_b, opt=opt_b, loss_fn=criterion)
        assert torch.allclose(want, got, atol=1e-6), (type(criterion).__name__, want, got)
        assert torch.allclose(model_a.weight, model_b.weight, atol=1e-6)
    assert traced.stats.records == 2
    assert (traced.stats.host_free_calls if without_host else traced.stats.api_replays) >= 4


def test_a_keyword_model_rebuilt_around_the_same_layers_is_not_taken_for_the_recorded_one():
    torch.manual_seed(0)
    first, second = nn.Linear(4, 8), nn.Linear(8, 3)
    traced = tracejit.trace(_loss_step, without_host=True)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    model = nn.Sequential(first, nn.ReLU(), second)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        traced(x, y, model=model, opt=opt, loss_fn=nn.MSELoss())
    rebuilt = nn.Sequential(first, nn.Tanh(), second)  # the same parameters: the same signature
    with pytest.raises(tracejit.TraceMismatchError, match="aten.tanh"):
        traced(x, y, model=rebuilt, opt=opt, loss_fn=nn.MSELoss())


class _Activated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = torch.tanh

    def forward(self, x):
        return self.act(self.fc(x))


MODEL = _Activated()
ACT = torch.tanh


def _by_attribute(x):
    with torch.no_grad():
        return MODEL(x)


def _by_global(x):
    with torch.no_grad():
        return ACT(MODEL.fc(x))


def _helper(h):
    return torch.tanh(h)


def _by_helper(x):
    with torch.no_grad():
        return _helper(MODEL.fc(x))


def _closure():
    def function(x):
        with torch.no_grad():
            return activation(MODEL.fc(x))

    activation = torch.tanh

    def change():
        nonlocal activation
        activation = torch.sigmoid
    return function, change


def _set_attribute():
    MODEL.act = torch.sigmoid


def _set_global():
    global ACT
    ACT = torch.sigmoid


def _redefine_helper():  # a notebook cell run again with an edited helper
    global _helper

    def _helper(h):
        return torch.sigmoid(h)


@pytest.mark.parametrize("case", ["attribute", "global", "closure", "helper"])
def test_a_function_held_as_a_setting_that_changes_makes_the_call_run_the_function(case):
    # the calls without the host went on computing tanh
    global ACT, _helper
    saved_helper = _helper
    MODEL.act, ACT = torch.tanh, torch.tanh
    function, change = {"attribute": (_by_attribute, _set_attribute), "global": (_by_global, _set_global),
                        "closure": _closure(), "helper": (_by_helper, _redefine_helper)}[case]
    try:
        traced = tracejit.trace(function, without_host=True)
        x = torch.randn(2, 4)
        for _ in range(3):
            assert torch.equal(traced(x), function(x))
        assert traced.stats.host_free_calls >= 1
        change()
        with pytest.raises(tracejit.TraceMismatchError, match="aten.sigmoid.default instead of aten.tanh.default"):
            traced(x)
    finally:
        MODEL.act, ACT, _helper = torch.tanh, torch.tanh, saved_helper


class _Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.tau = 1.0

    def forward(self, x):
        return torch.softmax(self.fc(x) / self.tau, dim=-1)


def _infer(x, *, model):
    with torch.no_grad():
        return model(x)


def _scaled(x, *, model, s):
    with torch.no_grad():
        return model.fc(x) * s


@pytest.mark.parametrize("without_host", [False, True])
def test_numpy_scalars_annealed_between_calls_are_followed(without_host):
    # without the host a numpy float64 temperature or a numpy float32 keyword stayed the recorded one
    torch.manual_seed(0)
    model = _Tempered()
    x = torch.randn(2, 4)
    tempered = tracejit.trace(_infer, without_host=without_host)
    scaled = tracejit.trace(_scaled, without_host=without_host)
    for t in range(8):
        if t % 2 == 0:  # a numpy.float64, changed every other call
            model.tau = np.maximum(0.5, np.exp(-0.3 * t))
        assert torch.allclose(tempered(x, model=model), _infer(x, model=model), atol=1e-6)
        s = np.float32(1.0 if t < 4 else 3.0)
        assert torch.allclose(scaled(x, model=model, s=s), _scaled(x, model=model, s=s), atol=1e-6)
    if without_host:
        assert tempered.stats.host_free_calls >= 2 and scaled.stats.host_free_calls >= 2


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam_loop"])
def test_a_numpy_learning_rate_changing_every_call_stays_at_the_api_level(optimizer):
    # a numpy.float64 lr diverged at the API level on every change and left it after three calls
    from models import assert_same_state, batch, make_model, train_step, twin

    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), optimizer)
    traced = tracejit.trace(train_step, backend="aten")
    for call in range(8):
        lr = 0.01 * 0.5 * (1 + np.cos(np.pi * call / 8))  # a numpy.float64
        for opt in (opt_a, opt_b):
            opt.param_groups[0]["lr"] = lr
        x, y = batch("mlp", call)
        assert torch.equal(train_step(x, y, model=model_a, opt=opt_a), traced(x, y, model=model_b, opt=opt_b))
        assert_same_state(model_a, opt_a, model_b, opt_b)
    assert traced.stats.api_replays == 5 and traced.stats.api_fallbacks == 0  # after the record and re-record (lazy state)


class _Trainer:
    def __init__(self, model, opt):
        self.model, self.opt = model, opt


def _trainer_step(x, y, *, trainer):
    loss = torch.nn.functional.mse_loss(trainer.model(x), y)
    loss.backward()
    trainer.opt.step()
    trainer.opt.zero_grad()
    return loss.detach()


def _optimizers_step(x, y, *, model, opts):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("how", ["attribute", "new trainer", "keyword list"])
def test_a_new_optimizer_where_the_function_finds_one_is_followed_without_the_host(how):
    # a new SGD with another lr (no state to tell it apart) kept the old lr without the host
    torch.manual_seed(0)
    models = [nn.Linear(4, 3), nn.Linear(4, 3)]
    models[1].load_state_dict(models[0].state_dict())
    trainers = [_Trainer(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in models]
    traced = tracejit.trace(_optimizers_step if how == "keyword list" else _trainer_step, without_host=True)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    for call in range(8):
        if call == 3:  # the next stage: a new optimizer with a larger learning rate
            for i, m in enumerate(models):
                opt = torch.optim.SGD(m.parameters(), lr=0.5)
                if how == "attribute":
                    trainers[i].opt = opt
                else:
                    trainers[i] = _Trainer(m, opt)
        results = []
        for t, run in zip(trainers, (_optimizers_step if how == "keyword list" else _trainer_step, traced)):
            results.append(run(x, y, model=t.model, opts=[t.opt]) if how == "keyword list" else run(x, y, trainer=t))
        assert torch.equal(results[0], results[1])
        assert torch.allclose(models[0].weight, models[1].weight, atol=1e-6)
    assert traced.stats.host_free_calls >= 4


def _criterion_step(x, y, *, model, opt, losses, weight):
    loss = losses["main"](model(x), y) * weight
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_keyword_functions_partials_and_containers_of_criteria_are_the_bound_ones_without_the_host():
    import functools

    import torch.nn.functional as F

    (model_a, opt_a), (model_b, opt_b) = _pair()
    traced = tracejit.trace(_criterion_step, without_host=True)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    huber = functools.partial(F.huber_loss, delta=0.5)
    for call in range(5):
        if call == 3:  # another delta: a partial of its own, with the number passed on
            huber = functools.partial(F.huber_loss, delta=2.0)
        want = _criterion_step(x, y, model=model_a, opt=opt_a, losses={"main": huber}, weight=1.0)
        got = traced(x, y, model=model_b, opt=opt_b, losses={"main": huber}, weight=1.0)
        assert torch.allclose(want, got, atol=1e-6)
    assert traced.stats.host_free_calls >= 2
    # a module of its own there (the gradient state counts a keyword container's modules): a new trace
    want = _criterion_step(x, y, model=model_a, opt=opt_a, losses={"main": nn.L1Loss()}, weight=1.0)
    got = traced(x, y, model=model_b, opt=opt_b, losses={"main": nn.L1Loss()}, weight=1.0)
    assert torch.allclose(want, got, atol=1e-6) and traced.stats.records == 2
    # another function there: a trace of its own as well (signature.callable_key)
    for _ in range(3):
        want = _criterion_step(x, y, model=model_a, opt=opt_a, losses={"main": F.mse_loss}, weight=1.0)
        got = traced(x, y, model=model_b, opt=opt_b, losses={"main": F.mse_loss}, weight=1.0)
        assert torch.allclose(want, got, atol=1e-6)
    assert traced.stats.records == 3
    assert torch.allclose(model_a.weight, model_b.weight, atol=1e-6)


class _Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", None)  # an optional mask the caller sets later

    def forward(self, x):
        h = self.fc(x)
        return h * self.mask if self.mask is not None else h


def test_a_buffer_that_was_none_when_bound_and_is_set_since_is_noticed_without_the_host():
    # the mask set after binding was ignored: the program kept the unmasked path
    torch.manual_seed(0)
    model = _Masked()
    traced = tracejit.trace(_infer, without_host=True)
    x = torch.randn(2, 4)
    for _ in range(3):
        assert torch.equal(traced(x, model=model), _infer(x, model=model))
    model.mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    with pytest.raises(tracejit.TraceMismatchError, match="aten.mul"):
        traced(x, model=model)


class _Losses:
    def __init__(self, power):
        self.power = power

    def loss(self, out, y):
        return ((out - y).abs() ** self.power).mean()


def _sliced_step(x, y, *, model, opt, loss_fn, cols):
    loss = loss_fn(model(x)[:, cols], y[:, cols])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_bound_methods_and_slices_given_anew_on_every_call_stand_for_the_same_value():
    # a bound method is a new object on every attribute access, a slice a new one on every call:
    # compared by identity they would make every call run the function
    (model_a, opt_a), (model_b, opt_b) = _pair()
    traced = tracejit.trace(_sliced_step, without_host=True)
    squares, cubes = _Losses(2), _Losses(3)
    for call in range(10):
        x, y = torch.randn(5, 4), torch.randn(5, 3)
        losses, cols = (squares if call < 5 else cubes), slice(0, 2)  # a new slice object each call
        want = _sliced_step(x, y, model=model_a, opt=opt_a, loss_fn=losses.loss, cols=cols)
        got = traced(x, y, model=model_b, opt=opt_b, loss_fn=losses.loss, cols=cols)
        assert torch.allclose(want, got, atol=1e-6), call
        assert torch.allclose(model_a.weight, model_b.weight, atol=1e-6)
    stats = traced.stats
    assert stats.records == 1 and stats.host_free_calls >= 6, stats


def _train_or_evaluate(x, y, *, st):
    loss = torch.nn.functional.cross_entropy(st["model"](x), y)
    if st["model"].training:
        loss.backward()
        st["opt"].step()
        st["opt"].zero_grad()
    return loss.detach()


@pytest.mark.parametrize("options", [{}, {"without_host": True}])
def test_a_model_held_in_a_keyword_dict_switching_to_eval_selects_a_trace_of_its_own(options):
    # used to raise TraceMismatchError: only keyword modules' training flags were in the signature
    import copy

    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.Linear(8, 3))
    model_b = copy.deepcopy(model_a)
    st_a = {"model": model_a, "opt": torch.optim.SGD(model_a.parameters(), lr=0.1)}
    st_b = {"model": model_b, "opt": torch.optim.SGD(model_b.parameters(), lr=0.1)}
    traced = tracejit.trace(_train_or_evaluate, **options)
    for call in range(10):
        for model in (model_a, model_b):
            model.train(call % 3 != 2)
        x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
        torch.manual_seed(call)
        want = _train_or_evaluate(x, y, st=st_a)
        torch.manual_seed(call)
        assert torch.allclose(want, traced(x, y, st=st_b), atol=1e-6), call
    assert traced.stats.records == 2
    assert (traced.stats.host_free_calls if options else traced.stats.api_replays) >= 5
