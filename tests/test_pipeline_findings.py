"""Findings of a hunt over realistic training pipelines (many steps, compared with eager step by
step): gradient accumulation whose stepping trace never reached the torch API level, a scheduler
created after some steps that turned the optimizer stand-ins off for good, a mismatch message
that named the wrong argument, and a tensor lr with StepLR stepped inside the step."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from models import assert_same_state, batch, make_model, train_step

import tracejit
from tracejit import ReplayLevelWarning, TraceMismatchError

# -- a mismatch names the argument that changed -------------------------------------------------


@pytest.mark.parametrize("first, then, said", [
    # the dispatcher drops trailing defaults together: huber_loss(x, y, 1, 0.7) against
    # huber_loss(x, y), where reduction (1, its default) is only passed to reach delta
    (0.7, 1.0, r"delta left at its default 1.0 where the recorded call passed 0.7"),
    (1.0, 0.7, r"delta=0.7 where the recorded call left it at its default 1.0"),
])
def test_a_mismatch_names_the_argument_that_left_its_default(first, then, said, monkeypatch):
    monkeypatch.setenv("TRACEJIT_REPLAY", "aten")  # the API level binds the number (a call of its own)
    w = torch.randn(4, requires_grad=True)
    x, y = torch.randn(4) * 3, torch.randn(4)

    @tracejit.trace
    def step(x, y, *, delta):
        loss = F.huber_loss(x * w, y, delta=delta)
        loss.backward()
        return loss

    for _ in range(3):
        step(x, y, delta=first)
    with pytest.raises(TraceMismatchError, match=rf"aten.huber_loss.default got different non-tensor arguments \({said}"):
        step(x, y, delta=then)


# -- gradient accumulation: the stepping trace runs at the API level ----------------------------


def accumulating_step(x, y, *, model, opt, do_step):
    loss = F.cross_entropy(model(x), y) / 2
    loss.backward()
    if do_step:
        opt.step()
        opt.zero_grad()
    return loss


ACCUMULATING_OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_nesterov_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True, weight_decay=0.1),
}


@pytest.mark.parametrize("name", list(ACCUMULATING_OPTIMIZERS))
def test_the_stepping_call_of_gradient_accumulation_runs_at_the_api_level(trace, name):
    # The stepping call accumulates into the gradients the accumulating call made and frees them
    # with zero_grad(): binding the API-level program found them gone, on every stepping call,
    # silently. They are read where they are now, in `p.grad` of the parameters the call matched.
    model_a = make_model("mlp")
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = (ACCUMULATING_OPTIMIZERS[name](m.parameters()) for m in (model_a, model_b))
    traced = trace(accumulating_step)
    api_steps = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayLevelWarning)
        for i in range(12):
            x, y = batch("mlp", i)
            do_step = i % 2 == 1
            before = traced.stats.api_replays
            got = traced(x, y, model=model_b, opt=opt_b, do_step=do_step)
            assert torch.equal(got, accumulating_step(x, y, model=model_a, opt=opt_a, do_step=do_step)), i
            assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
            if do_step:
                api_steps.append(traced.stats.api_replays - before)
    assert api_steps[-3:] == [1, 1, 1], (api_steps, traced.stats)
    assert traced.stats.optimizer_stand_ins > 0 and traced.stats.api_fallbacks == 0, traced.stats


def test_a_gradient_kept_by_the_user_is_accumulated_in_place_as_eager_does(trace):
    # the stepping call writes into the gradient the accumulating call made, where eager's backward
    # accumulates it: a reference the user keeps sees the accumulated value, then zero_grad() frees it
    model_a = make_model("mlp")
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model_a, model_b))
    traced = trace(accumulating_step)
    api_calls = []
    for i in range(12):
        x, y = batch("mlp", i)
        do_step = i % 2 == 1
        held_a, held_b = model_a.net[0].weight.grad, model_b.net[0].weight.grad
        before = traced.stats.api_replays
        traced(x, y, model=model_b, opt=opt_b, do_step=do_step)
        api_calls.append(traced.stats.api_replays - before)
        accumulating_step(x, y, model=model_a, opt=opt_a, do_step=do_step)
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
        if held_a is not None:
            assert torch.equal(held_a, held_b), i
    assert api_calls[-4:] == [1, 1, 1, 1], (api_calls, traced.stats)


def test_an_api_level_never_bound_says_so_once():
    # a tensor the function frees itself on every call (`queue.pop()`): the API-level program cannot
    # be bound to it, which used to be retried on every call without a word
    queue = []

    @tracejit.trace
    def f(x):
        return x + queue.pop()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            queue.append(torch.randn(4))
            x = torch.randn(4)
            expected = x + queue[-1]
            assert torch.equal(f(x), expected)
    said = [str(w.message) for w in caught if issubclass(w.category, ReplayLevelWarning)]
    assert len(said) == 1 and "could not be bound after 3 calls in a row" in said[0], said
    assert "is no longer alive" in said[0], said


# -- a scheduler created after some steps keeps the optimizer stand-ins -------------------------


def twin_models_and_optimizers(make_optimizer):
    model_a = make_model("mlp")
    model_b = copy.deepcopy(model_a)
    return (model_a, make_optimizer(model_a.parameters())), (model_b, make_optimizer(model_b.parameters()))


SCHEDULERS = {
    # SWA: the averaging schedule starts after some epochs (adds initial_lr and swa_lr)
    "swalr": lambda opt: torch.optim.swa_utils.SWALR(opt, swa_lr=0.05, anneal_epochs=2),
    "steplr": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=40),
}


def _stand_ins_of_one_step(traced, i: int, eager: tuple, twin: tuple, schedules: list) -> int:
    """One training step eager and traced, compared exactly, then the schedulers' step; returns
    how many optimizer methods the stand-ins answered in the traced call."""
    (model_a, opt_a), (model_b, opt_b) = eager, twin
    x, y = batch("mlp", i)
    before = traced.stats.optimizer_stand_ins
    assert torch.equal(traced(x, y, model=model_b, opt=opt_b), train_step(x, y, model=model_a, opt=opt_a)), i
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    for schedule in schedules:
        schedule.step()
    return traced.stats.optimizer_stand_ins - before


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam_fused"])
def test_a_scheduler_created_after_some_steps_keeps_the_stand_ins(trace, scheduler, optimizer):
    # every LRScheduler adds `initial_lr` to the param groups when created (and others their own
    # keys): no optimizer reads them, and the stand-ins used to decline on every later call
    make = {"sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True)}[optimizer]
    (model_a, opt_a), (model_b, opt_b) = twin_models_and_optimizers(make)
    traced = trace(train_step)
    schedules = []
    answered = []
    for i in range(12):
        if i == 4:
            schedules = [SCHEDULERS[scheduler](opt) for opt in (opt_a, opt_b)]
        answered.append(_stand_ins_of_one_step(traced, i, (model_a, opt_a), (model_b, opt_b), schedules))
    assert answered[-4:] == [2, 2, 2, 2], (answered, traced.stats)  # step() and zero_grad() on each call


@pytest.mark.filterwarnings("ignore::tracejit.ReplayLevelWarning")  # the real step with foreach=False diverges
def test_a_setting_step_reads_is_still_checked_beside_a_schedulers_keys(trace):
    # the keys no optimizer reads are left out of the check; those step() reads are not: a changed
    # one makes the stand-in decline and the real step run (here with the ops it ran before)
    (model_a, opt_a), (model_b, opt_b) = twin_models_and_optimizers(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    traced = trace(train_step)
    schedules = [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) for opt in (opt_a, opt_b)]
    answered = []
    for i in range(10):
        if i == 6:
            for opt in (opt_a, opt_b):
                opt.param_groups[0]["foreach"] = False  # was None: the same loop on CPU tensors
                opt.param_groups[0]["name"] = "all"  # the user's own key
        answered.append(_stand_ins_of_one_step(traced, i, (model_a, opt_a), (model_b, opt_b), schedules))
    assert answered[3:6] == [2, 2, 2] and answered[6] == 0, (answered, traced.stats)
    assert answered[-1] == 2, (answered, traced.stats)  # noted again with the new setting


# -- a tensor lr with a milestone scheduler stepped inside: documented as a mismatch ------------


def tensor_lr_twins():
    return twin_models_and_optimizers(lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01), fused=True))


def scheduled_step(x, y, *, model, opt, schedule):
    loss = train_step(x, y, model=model, opt=opt)
    schedule.step()
    return loss


@pytest.mark.skip_mode("symbolic", reason="aten._fused_adam_.tensor_lr has no fake implementation")
@pytest.mark.parametrize("make_schedule", [
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 5], gamma=0.5),
], ids=["steplr", "multisteplr"])
def test_a_milestone_schedule_of_a_tensor_lr_stepped_inside_is_a_mismatch(trace, make_schedule):
    # docs/guide.md ("Step the scheduler outside"): with a tensor lr the scheduler computes the
    # rate with tensor ops, and StepLR's branch on the epoch dispatches other ops at a milestone
    # (`lr * gamma`) than between two (the lr copied): the Python branch is not in the trace
    (model_a, opt_a), (model_b, opt_b) = tensor_lr_twins()
    schedule_a, schedule_b = make_schedule(opt_a), make_schedule(opt_b)
    traced = trace(scheduled_step)
    for i in range(2):
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b, schedule=schedule_b),
                           scheduled_step(x, y, model=model_a, opt=opt_a, schedule=schedule_a))
    with pytest.raises(TraceMismatchError, match="a different op ran"):
        traced(*batch("mlp", 2), model=model_b, opt=opt_b, schedule=schedule_b)


@pytest.mark.skip_mode("symbolic", reason="aten._fused_adam_.tensor_lr has no fake implementation")
def test_a_milestone_schedule_of_a_tensor_lr_stepped_outside_follows_eager(trace):
    # the advice of docs/guide.md: the scheduler fills the lr tensor in place between calls
    (model_a, opt_a), (model_b, opt_b) = tensor_lr_twins()
    schedules = [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) for opt in (opt_a, opt_b)]
    traced = trace(train_step)
    for i in range(8):
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), train_step(x, y, model=model_a, opt=opt_a)), i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
        for schedule in schedules:
            schedule.step()
    assert torch.equal(opt_b.param_groups[0]["lr"], torch.tensor(0.01 * 0.5**4))
    assert traced.stats.api_replays > 0, traced.stats
