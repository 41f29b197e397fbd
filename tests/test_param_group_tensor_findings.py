"""Tensor settings in `optimizer.param_groups` and LR schedulers without `last_epoch` (hunt F of
2026-12): each case trains an eager twin and a traced one side by side (backend aten) and compares
the losses, parameters, gradients, optimizer state and param-group settings bit for bit after
every call, and that the JIT ran (host-free calls without the host).

What failed before:

- F1: fused Adam with `lr=torch.tensor(0.01)` and `param_groups[0]["lr"] = 0.1` (a float) between
  calls, without the host: no guard saw it, the host-free calls kept reading the old tensor, and
  the parameters drifted from eager with no error. A tensor setting had neither a binding nor a
  guard (runtime/optimizer_settings.py `setting_guards` guarded numbers only).
- F2: a new tensor put in its place (`param_groups[0]["lr"] = torch.tensor(0.5)`, or
  `load_state_dict()` with an edited lr), fused Adam and fused SGD: not seen either. record/names.py
  located the tensors in `optimizer.state` but not those in `param_groups`, so the lr tensor was
  guarded only by its weak reference being alive, which the trace kept so.
- F5: `opt.load_state_dict(copy.deepcopy(saved))` with a tensor lr raised HostDependencyError
  ("a tensor tracejit cannot find again ... pass it as an argument") for the optimizer's own lr.
- F3: a `ChainedScheduler` (or a scheduler of the user's own that never calls
  `LRScheduler.__init__`) the function reaches: AttributeError (no `last_epoch`) on the first call
  without the host (runtime/python_state.py).

Now a tensor setting is found at `param_groups[i][key]` on every call (a new object makes the
call run the function, which binds it), a setting that switches between a tensor and a number is
a guard miss either way (a number that became a tensor was passed to the program as the number
before), and where the ops differ (the fused ops' `tensor_lr` overloads) the checked call that
follows raises TraceMismatchError saying which argument switched, as checked mode does; a
scheduler's step count is read where it has one, with its children's.
"""

import copy

import pytest
import torch
from models import train_step
from torch import nn

import tracejit

S = torch.optim.lr_scheduler
# name -> options of tracejit.trace (the suite's backend is aten: bit for bit with eager)
MODES = {"without_host": {"without_host": True, "backend": "aten"}, "checked": {"backend": "aten"}}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def adam_tensor_lr(params):
    return torch.optim.Adam(params, lr=torch.tensor(0.01), fused=True)


def sgd_tensor_lr(params):
    return torch.optim.SGD(params, lr=torch.tensor(0.1), momentum=0.9, fused=True)


def assert_same(model_e, opt_e, model_t, opt_t, where: str) -> None:
    for (name, a), b in zip(model_e.named_parameters(), model_t.parameters(), strict=True):
        assert torch.equal(a, b), f"{where}: {name}"
        assert (a.grad is None) == (b.grad is None), f"{where}: {name}.grad"
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), f"{where}: {name}.grad"
        state_e, state_t = opt_e.state.get(a, {}), opt_t.state.get(b, {})
        assert state_e.keys() == state_t.keys(), f"{where}: optimizer state keys of {name}"
        for key, value in state_e.items():
            same = torch.equal(value, state_t[key]) if isinstance(value, torch.Tensor) else value == state_t[key]
            assert same, f"{where}: optimizer state {name}.{key}"
    for group_e, group_t in zip(opt_e.param_groups, opt_t.param_groups, strict=True):
        for key, value in group_e.items():
            if key != "params":
                other = group_t[key]
                assert type(value) is type(other), f"{where}: {key}"
                assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, f"{where}: {key}"


def twins(make_optimizer):
    model_e = make_model()
    model_t = copy.deepcopy(model_e)
    return (model_e, make_optimizer(model_e.parameters())), (model_t, make_optimizer(model_t.parameters()))


def train(mode: str, make_optimizer, between, calls: int = 8, step=train_step, **extra):
    """Eager and traced twins side by side; `between(i, opt, twin)` changes each optimizer (the
    eager one first) before call i. Returns the traced function and host-free calls per call."""
    (model_e, opt_e), (model_t, opt_t) = twins(make_optimizer)
    traced = tracejit.trace(step, **MODES[mode])
    host_free = []
    for i in range(calls):
        between(i, opt_e, False)
        between(i, opt_t, True)
        x, y = batch(i)
        loss_e = step(x, y, model=model_e, opt=opt_e, **extra)
        loss_t = traced(x, y, model=model_t, opt=opt_t, **extra)
        assert torch.equal(loss_e, loss_t), f"{mode} call {i}: loss"
        assert_same(model_e, opt_e, model_t, opt_t, f"{mode} call {i}")
        host_free.append(traced.stats.host_free_calls)
    return traced, host_free


def assert_host_free_around(traced, host_free: list[int], change: int) -> None:
    """Host-free calls ran before call `change`, that call ran the function (a guard missed), and
    the calls after it ran without the host again."""
    assert host_free[change - 1] > 0, traced.stats
    assert host_free[change] == host_free[change - 1], f"call {change} ran without the function: {traced.stats}"
    assert traced.stats.host_free_misses >= 1, traced.stats
    assert host_free[-1] > host_free[change], f"no host-free call after the change: {traced.stats}"


# -- F2: a new tensor in param_groups -------------------------------------------------------------


@pytest.mark.parametrize("make_optimizer", [adam_tensor_lr, sgd_tensor_lr], ids=["adam_fused", "sgd_fused"])
def test_a_replaced_tensor_learning_rate_is_read_anew(make_optimizer):
    def replace(i, opt, twin):
        if i in (4, 6):  # a hand-written decay that makes a new tensor
            opt.param_groups[0]["lr"] = torch.tensor(0.5 if i == 4 else 0.02)

    for mode in MODES:
        traced, host_free = train(mode, make_optimizer, replace)
        if mode == "without_host":
            assert_host_free_around(traced, host_free, 4)
            assert host_free[6] == host_free[5], traced.stats  # the second new tensor is noticed too
        else:
            assert traced.stats.checked_replays + traced.stats.api_replays >= 5, traced.stats


def test_tensor_betas_replaced_and_switched_to_numbers_and_a_filled_lr_follow_eager():
    """The fused ops take betas as numbers, which torch reads from tensor betas: those are bound
    (read from `betas[i]` on every call), so a new tensor there needs no miss. Betas that become
    numbers are a guard miss, after which calls run without the host again; a tensor learning rate
    filled in place (what torch's schedulers do) keeps the fast path."""
    def make(params):
        return torch.optim.Adam(params, lr=torch.tensor(0.01), betas=(torch.tensor(0.9), torch.tensor(0.99)),
                                fused=True)

    def change(i, opt, twin):
        group = opt.param_groups[0]
        if i == 3:
            group["lr"].fill_(0.03)
        if i == 4:
            group["betas"] = (group["betas"][0], torch.tensor(0.9))
        if i == 6:
            group["betas"] = (0.8, 0.95)

    for mode in MODES:
        traced, host_free = train(mode, make, change, calls=9)
        if mode == "without_host":
            assert host_free[5] == host_free[2] + 3, f"a filled lr or new betas ran the function: {traced.stats}"
            assert_host_free_around(traced, host_free, 6)


def test_one_cycle_writing_a_float_beta1_beside_a_tensor_beta2_keeps_the_fast_path():
    """OneCycleLR writes `betas = (float, *betas[1:])`: a float beta1, bound and changed every step,
    beside the tensor beta2. The guard that keeps tensors tensors must compare the bound float by
    its kind only (a check by value missed on every call). Passes before the fix too: it keeps the
    new guards from costing this schedule its fast path."""
    def make(params):
        return torch.optim.Adam(params, lr=torch.tensor(0.01), betas=(torch.tensor(0.9), torch.tensor(0.99)),
                                fused=True)

    schedules = {}

    def cycle(i, opt, twin):
        if i:
            schedules.setdefault(twin, S.OneCycleLR(opt, max_lr=0.05, total_steps=20)).step()

    traced, host_free = train("without_host", make, cycle)
    assert traced.stats.host_free_misses == 0 and host_free[-1] >= 5, traced.stats


def test_load_state_dict_with_an_edited_tensor_learning_rate_follows_eager():
    """load_state_dict() makes new param-group dicts holding the saved lr: the state tensors stay
    the objects they were (no deepcopy), only the lr tensor is new."""
    def restore(i, opt, twin):
        if i == 4:
            saved = opt.state_dict()
            saved["param_groups"][0]["lr"] = torch.tensor(0.2)
            opt.load_state_dict(saved)

    for mode in MODES:
        traced, host_free = train(mode, adam_tensor_lr, restore)
        if mode == "without_host":
            assert_host_free_around(traced, host_free, 4)


# -- F5: a checkpoint restored ------------------------------------------------------------------


@pytest.mark.parametrize("make_optimizer", [adam_tensor_lr, sgd_tensor_lr], ids=["adam_fused", "sgd_fused"])
def test_a_restored_checkpoint_with_a_tensor_learning_rate_runs_without_the_host(make_optimizer):
    saved = {}

    def checkpoint(i, opt, twin):
        if i == 2:
            saved[twin] = copy.deepcopy(opt.state_dict())
        if i == 4:  # back to call 2's state: new lr and state tensors
            opt.load_state_dict(copy.deepcopy(saved[twin]))

    for mode in MODES:
        traced, host_free = train(mode, make_optimizer, checkpoint)
        if mode == "without_host":
            assert_host_free_around(traced, host_free, 4)


# -- F1: a setting that switches between a tensor and a number -----------------------------------


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("was, now", [("tensor", "number"), ("number", "tensor")])
def test_a_learning_rate_that_switches_between_tensor_and_number_is_followed(mode, was, now):
    """The fused ops take a tensor lr in another overload (`_fused_adam_.tensor_lr`): a trace of
    the one cannot run the other. Without the host the switch is a guard miss (before: a float put
    where the recorded tensor was went unseen, the program kept the old tensor lr). The other op
    comes from torch's own step(), so the call records again from there (replay.branching_step;
    it raised TraceMismatchError before) and later calls replay the new trace, as eager runs."""
    first = torch.tensor(0.01) if was == "tensor" else 0.01
    second = 0.1 if now == "number" else torch.tensor(0.1)
    (model_e, opt_e), (model_t, opt_t) = twins(lambda params: torch.optim.Adam(params, lr=first, fused=True))
    traced = tracejit.trace(train_step, **MODES[mode])
    for i in range(8):
        if i == 4:
            opt_e.param_groups[0]["lr"] = second
            opt_t.param_groups[0]["lr"] = second if now == "number" else second.clone()
            rerecords = traced.stats.rerecords
        x, y = batch(i)
        assert torch.equal(train_step(x, y, model=model_e, opt=opt_e), traced(x, y, model=model_t, opt=opt_t))
        assert_same(model_e, opt_e, model_t, opt_t, f"call {i}")
        if i == 3 and mode == "without_host":
            assert traced.stats.host_free_calls > 0, traced.stats
    assert traced.stats.rerecords == rerecords + 1, traced.stats


def test_a_learning_rate_that_keeps_switching_kind_raises_naming_the_setting():
    """A step whose ops change on every call is not followed past three re-records: the error
    names the argument that switched kind."""
    (model_e, opt_e), (model_t, opt_t) = twins(lambda params: torch.optim.Adam(params, lr=0.01, fused=True))
    traced = tracejit.trace(train_step, backend="aten")
    with pytest.raises(tracejit.TraceMismatchError, match="`lr` was a (tensor|number) when recorded and is a "):
        for i in range(12):
            lr = torch.tensor(0.01) if i >= 2 and i % 2 else 0.01
            opt_e.param_groups[0]["lr"] = opt_t.param_groups[0]["lr"] = lr
            x, y = batch(i)
            assert torch.equal(train_step(x, y, model=model_e, opt=opt_e), traced(x, y, model=model_t, opt=opt_t))
            assert_same(model_e, opt_e, model_t, opt_t, f"call {i}")


def test_a_tuple_setting_that_switches_to_a_tensor_is_a_guard_miss():
    """An unbound setting compared by value: a tensor in its place is a miss, not a comparison that
    a tensor answers (`(tensor(0.9), tensor(0.999)) != (0.9, 0.999)` is False)."""
    from tracejit.runtime.optimizer_settings import _unbound_guards

    def fail(condition, message):
        return condition

    class Source:
        namespace = {}

        def constant(self, value, prefix):
            name = f"{prefix}{len(self.namespace)}"
            self.namespace[name] = value
            return name

    src = Source()
    lines = _unbound_guards("g['betas']", (0.9, 0.999), src, fail, "betas")
    check = eval(f"lambda g: [(v := g['betas']), {lines[1]}][1]", {"TENSOR": torch.Tensor, **src.namespace})
    assert not check({"betas": (0.9, 0.999)})
    assert check({"betas": (torch.tensor(0.9), torch.tensor(0.999))})
    assert check({"betas": (0.9, 0.99)}) and check({"betas": [0.9, 0.999]})
    # a bound float element (OneCycleLR's beta1) beside a tensor: its kind, not its value
    mixed = _unbound_guards("g['betas']", (0.9, torch.tensor(0.99)), src, fail, "betas", {0})
    check = eval(f"lambda g: [(v := g['betas']), {mixed[1]}][1]", {"TENSOR": torch.Tensor, **src.namespace})
    assert not check({"betas": (0.85, torch.tensor(0.5))})
    assert check({"betas": (0.85, 0.5)}) and check({"betas": (torch.tensor(0.85), torch.tensor(0.5))})
    tensor = _unbound_guards("g['lr']", torch.tensor(0.1), src, fail, "lr")[0]
    assert eval(f"lambda g: {tensor}", {"TENSOR": torch.Tensor})({"lr": 0.1})
    number = _unbound_guards("g['eps']", 1e-8, src, fail, "eps")[0]
    assert eval(f"lambda g: {number}", {"TENSOR": torch.Tensor, **src.namespace})({"eps": torch.tensor(1e-8)})


# -- F3: schedulers without last_epoch -------------------------------------------------------------


def sched_step(x, y, *, model, opt, sched):
    return train_step(x, y, model=model, opt=opt)


class HalvingSchedule(S.LRScheduler):
    """A scheduler of the user's own that never calls LRScheduler.__init__ (no `last_epoch`)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.steps = 0

    def step(self):
        self.steps += 1
        for group in self.optimizer.param_groups:
            group["lr"] *= 0.5


SCHEDULERS = {
    "chained": lambda opt: S.ChainedScheduler([S.ConstantLR(opt, factor=0.5, total_iters=3),
                                               S.ExponentialLR(opt, gamma=0.9)]),
    "own_without_last_epoch": HalvingSchedule,
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_a_scheduler_without_last_epoch_stepped_outside_matches_eager(name):
    for mode in MODES:
        (model_e, opt_e), (model_t, opt_t) = twins(lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
        sched_e, sched_t = SCHEDULERS[name](opt_e), SCHEDULERS[name](opt_t)
        traced = tracejit.trace(sched_step, **MODES[mode])
        for i in range(7):
            x, y = batch(i)
            loss_e = sched_step(x, y, model=model_e, opt=opt_e, sched=sched_e)
            loss_t = traced(x, y, model=model_t, opt=opt_t, sched=sched_t)
            assert torch.equal(loss_e, loss_t), f"{mode} call {i}"
            assert_same(model_e, opt_e, model_t, opt_t, f"{mode} call {i}")
            sched_e.step()
            sched_t.step()
        assert opt_t.param_groups[0]["lr"] < 0.05
        if mode == "without_host":
            assert traced.stats.host_free_calls >= 4, traced.stats


def test_a_chained_scheduler_stepped_inside_is_refused_without_the_host_naming_its_children():
    def step_inside(x, y, *, model, opt, sched):
        loss = train_step(x, y, model=model, opt=opt)
        sched.step()
        return loss

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), momentum=0.9, fused=True)
    sched = SCHEDULERS["chained"](opt)
    traced = tracejit.trace(step_inside, **MODES["without_host"])
    with pytest.raises(tracejit.HostDependencyError, match=r"last_epoch of sched\._schedulers\[1\]: \d+ -> \d+"):
        for i in range(4):
            traced(*batch(i), model=model, opt=opt, sched=sched)
