"""Checked replay at the API level answers torch.optim's step() and zero_grad() as a whole when the
optimizer's state is the one recorded (runtime/stand_ins.py). Every test compares with eager after
each step, bit for bit (backend="aten"), and reads `stats.optimizer_stand_ins` to tell a stand-in
that answered from one that ran the real method."""

import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import assert_same_state, batch, make_model, train_step

import tracejit

step = train_step  # forward, backward, opt.step(), opt.zero_grad()


def run(traced, pairs, steps, between=None, start=0):
    (model_a, opt_a), (model_b, opt_b) = pairs
    for i in range(start, start + steps):
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), step(x, y, model=model_a, opt=opt_a)), i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
        if between is not None:
            between(i)


def run_beside(traced, function, pairs, calls):
    """`calls` calls of `function` traced and eager on the twins, exact after each one."""
    (model_a, opt_a), (model_b, opt_b) = pairs
    for i in range(calls):
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), function(x, y, model=model_a, opt=opt_a)), i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)


def stood_in(traced) -> int:
    return traced.stats.optimizer_stand_ins


OPTIMIZERS = {
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    # these read each step count with .item(): the stand-in computes their numbers (optimizer_numbers.py)
    "adam_loop": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True, weight_decay=0.01),
    "adamw_loop": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    "adamw_foreach_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True, amsgrad=True),
    "adam_loop_maximize": lambda p: torch.optim.Adam(p, lr=1e-2, maximize=True, weight_decay=0.1),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True, weight_decay=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, weight_decay=0.01),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
}


def twins(name):
    return tuple((model, OPTIMIZERS[name](model.parameters())) for model in pair_of_models())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_cycling_schedule_is_followed_by_the_stand_ins(name):
    # OneCycleLR changes lr and momentum (betas for Adam) on every step: the stand-in passes the
    # new values to the program as the optimizer would have passed them
    pairs = twins(name)
    schedules = [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=50) for _, opt in pairs]
    traced = tracejit.trace(step, backend="aten")
    run(traced, pairs, 10, between=lambda i: [s.step() for s in schedules])
    stats = traced.stats
    assert stats.records == 1 and stats.api_fallbacks == 0 and stats.api_replays >= 6, stats
    assert stood_in(traced) == 2 * stats.api_replays  # step() and zero_grad() of every API-level call


def test_the_stand_ins_are_gone_after_every_call_and_the_schedulers_wrapper_is_back():
    pairs = twins("adam_fused")
    schedules = [torch.optim.lr_scheduler.StepLR(opt, step_size=2) for _, opt in pairs]
    wrapper = pairs[1][1].__dict__["step"]
    traced = tracejit.trace(step, backend="aten")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        run(traced, pairs, 6, between=lambda i: [s.step() for s in schedules])
    opt = pairs[1][1]
    assert opt.__dict__["step"] is wrapper and "zero_grad" not in opt.__dict__
    assert stood_in(traced) > 0

    def failing(x, y, *, model, opt):
        loss = step(x, y, model=model, opt=opt)
        if loss.item() > -1:  # a host read, then the user's error inside the checked call
            raise ValueError("user error")
        return loss

    traced = tracejit.trace(failing, backend="aten")
    for i in range(4):
        with pytest.raises(ValueError, match="user error"):
            traced(*batch("mlp", i), model=pairs[1][0], opt=opt)
    assert opt.__dict__["step"] is wrapper and "zero_grad" not in opt.__dict__


def change(opt, how):
    if how == "maximize":
        opt.param_groups[0]["maximize"] = True
    elif how == "amsgrad":
        opt.param_groups[0]["amsgrad"] = True
    elif how == "add_param_group":
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "lr": 0.5})
    elif how == "reload_state":
        opt.load_state_dict(opt.state_dict())  # new state tensors with the same values
    elif how == "defaults":
        opt.defaults["differentiable"] = False
        opt.defaults["extra"] = 1
    elif how == "defaults_key_swapped":  # as many defaults, one None under another name
        assert opt.defaults["foreach"] is None
        del opt.defaults["foreach"]
        opt.defaults["for_each"] = None
    elif how == "state_key_swapped":  # as many state entries, one under another name
        state = opt.state[opt.param_groups[0]["params"][0]]
        state["exp_avg_renamed"] = state.pop("exp_avg")


def outcome(how, monkeypatch, replay):
    """What 4 calls after the change give: their losses, or the error they raise."""
    monkeypatch.setenv("TRACEJIT_REPLAY", replay)
    pairs = twins("adam_fused")
    traced = tracejit.trace(step, backend="aten")
    run(traced, pairs, 5)
    for _, opt in pairs:
        change(opt, how)
    losses = []
    try:
        for i in range(5, 9):
            losses.append(traced(*batch("mlp", i), model=pairs[1][0], opt=pairs[1][1]))
    except Exception as error:  # noqa: BLE001 - eager raises too (amsgrad turned on: no max_exp_avg_sq)
        return traced, f"{type(error).__name__}: {str(error).splitlines()[0]}"
    assert torch.is_grad_enabled()  # an exception inside step() left grad mode as it found it
    return traced, losses


@pytest.mark.parametrize("how", ["maximize", "amsgrad", "add_param_group", "reload_state", "defaults",
                                 "defaults_key_swapped", "state_key_swapped"])
def test_another_optimizer_state_runs_the_real_step(how, monkeypatch):
    # whatever the snapshot does not hold any more, the stand-in declines and the real step runs,
    # checked call by call: the calls end as checked calls without stand-ins end (another number
    # of a structural argument is a TraceMismatchError), never with a stale update
    traced, got = outcome(how, monkeypatch, "api")
    assert torch.is_grad_enabled()
    assert stood_in(traced) > 0
    _, expected = outcome(how, monkeypatch, "aten")
    if isinstance(expected, str):
        assert got == expected
    else:
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_settings_set_again_to_equal_values_are_still_answered():
    # the defaults are compared with the recorded objects first; new float objects of the same
    # values fail that and are then compared by type and value: the stand-in still answers
    pairs = twins("adam_fused")
    traced = tracejit.trace(step, backend="aten")
    run(traced, pairs, 4)
    before = stood_in(traced)
    for _, opt in pairs:
        opt.defaults["lr"] = float(str(opt.defaults["lr"]))
        opt.defaults["eps"] = float(str(opt.defaults["eps"]))
    run(traced, pairs, 3, start=4)
    assert stood_in(traced) == before + 2 * 3  # step() and zero_grad() on each of the 3 calls


def test_a_step_hook_runs_on_every_call():
    pairs = twins("sgd_momentum")
    seen = []
    pairs[1][1].register_step_pre_hook(lambda opt, args, kwargs: seen.append(len(seen)))
    pairs[0][1].register_step_pre_hook(lambda opt, args, kwargs: None)
    traced = tracejit.trace(step, backend="aten")
    run(traced, pairs, 6)
    assert len(seen) == 6
    # zero_grad() is still answered as a whole: only step() has hooks
    assert stood_in(traced) == traced.stats.api_replays > 0


def test_a_subclass_or_a_replaced_step_runs_as_written():
    class CountingSGD(torch.optim.SGD):
        steps = 0

        def step(self, closure=None):
            CountingSGD.steps += 1
            return super().step(closure)

    model = make_model("mlp")
    other = make_model("mlp")
    other.load_state_dict(model.state_dict())
    pairs = ((model, CountingSGD(model.parameters(), lr=0.1, momentum=0.9)),
             (other, CountingSGD(other.parameters(), lr=0.1, momentum=0.9)))
    traced = tracejit.trace(step, backend="aten")
    run(traced, pairs, 6)
    assert CountingSGD.steps == 12  # six eager steps and six traced ones
    assert stood_in(traced) == 0  # zero_grad() is torch's own, but CountingSGD is not torch.optim's class

    pairs = twins("adam_fused")
    calls = []
    real = pairs[1][1].step
    pairs[1][1].step = lambda: (calls.append(1), real())[1]
    traced = tracejit.trace(step, backend="aten")
    run(traced, pairs, 6)
    assert len(calls) == 6
    assert stood_in(traced) == traced.stats.api_replays > 0  # zero_grad() only


@pytest.mark.parametrize("foreach", [False, True])
def test_radam_keeps_its_real_step_and_records_again_when_its_rectification_switches_on(foreach):
    # RAdam reads its step count too, but tracejit does not compute its numbers: its step() runs.
    # At step 6 its rectification switches on, another branch of torch's own step(): the call
    # records again from there (replay.branching_step) and training goes on, bitwise with eager
    pairs = [(model, torch.optim.RAdam(model.parameters(), lr=0.1, foreach=foreach)) for model in pair_of_models()]
    traced = tracejit.trace(step, backend="aten")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracejit.ReplayLevelWarning)  # the API level diverges at the switch
        run(traced, pairs, 12)
    entry = traced._entries()[0]
    assert any("does not compute RAdam" in why for why in entry.api.stand_ins_refused.values())
    # the second call records again, having made the state; the for-loop step switches branches at
    # step 6 (the foreach one multiplies by a rectification of 0 before: the same ops)
    switched = 0 if foreach else 1
    assert traced.stats.rerecords == 1 + switched and traced.stats.api_fallbacks == switched, traced.stats
    assert traced.stats.api_replays >= 7
    assert stood_in(traced) == traced.stats.api_replays  # zero_grad() only


def test_an_optimizer_branching_again_and_again_raises_once_its_rerecords_are_spent(monkeypatch):
    monkeypatch.setattr(sys.modules["tracejit.trace"], "OPTIMIZER_BRANCHES", 0)
    pairs = [(model, torch.optim.RAdam(model.parameters(), lr=0.1)) for model in pair_of_models()]
    traced = tracejit.trace(step, backend="aten")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracejit.ReplayLevelWarning)
        run(traced, pairs, 5)
        x, y = batch("mlp", 5)
        with pytest.raises(tracejit.TraceMismatchError, match=r"inside RAdam.step\(\), whose ops changed"):
            traced(x, y, model=pairs[1][0], opt=pairs[1][1])


def test_a_closure_that_changes_its_ops_inside_step_still_raises():
    # the closure is the user's program running inside step(): not torch's branch
    models = pair_of_models()
    opt = torch.optim.SGD(models[1].parameters(), lr=0.1)
    scale = {"on": False}

    def closure_step(x, y):
        def closure():
            opt.zero_grad()
            out = models[1](x)
            loss = F.cross_entropy(out * 2 if scale["on"] else out, y)
            loss.backward()
            return loss
        return opt.step(closure)

    traced = tracejit.trace(closure_step, backend="aten")
    for i in range(3):
        traced(*batch("mlp", i))
    scale["on"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracejit.ReplayLevelWarning)
        with pytest.raises(tracejit.TraceMismatchError):
            traced(*batch("mlp", 3))


HOST_READING = {  # torch's CPU defaults read each step count with .item(): numbers computed by tracejit
    "adagrad_loop": lambda p: torch.optim.Adagrad(p, lr=0.1, foreach=False, lr_decay=0.01, weight_decay=0.01),
    "adagrad_foreach": lambda p: torch.optim.Adagrad(p, lr=0.1, foreach=True, lr_decay=0.01),
    "adagrad_foreach_maximize": lambda p: torch.optim.Adagrad(p, lr=0.1, foreach=True, maximize=True, weight_decay=0.1),
    "adamax_loop": lambda p: torch.optim.Adamax(p, lr=0.05, foreach=False, weight_decay=0.01),
    "adamax_foreach": lambda p: torch.optim.Adamax(p, lr=0.05, foreach=True, betas=(0.8, 0.99)),
    # NAdam's numbers also come from its float32 mu_product, as step() rounds it: 30 steps
    "nadam_loop": lambda p: torch.optim.NAdam(p, lr=0.05, foreach=False, weight_decay=0.01),
    "nadam_foreach": lambda p: torch.optim.NAdam(p, lr=0.05, foreach=True, momentum_decay=0.01),
    "nadam_foreach_decoupled": lambda p: torch.optim.NAdam(p, lr=0.05, foreach=True, weight_decay=0.1,
                                                           decoupled_weight_decay=True, betas=(0.8, 0.99)),
}


@pytest.mark.parametrize("name", list(HOST_READING))
def test_host_reading_steps_are_answered_with_their_numbers_under_a_schedule(name):
    pairs = [(model, HOST_READING[name](model.parameters())) for model in pair_of_models()]
    schedules = [torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1 / (1 + epoch)) for _, opt in pairs]
    traced = tracejit.trace(step, backend="aten")
    run(traced, pairs, 30 if name.startswith("nadam") else 10, between=lambda i: [s.step() for s in schedules])
    stats = traced.stats
    assert stats.api_fallbacks == 0 and stats.api_replays >= 6, stats
    assert stood_in(traced) == 2 * stats.api_replays  # step() and zero_grad() of every API-level call


def test_numbers_of_parameters_in_two_dtypes_are_not_guessed():
    # foreach Adam steps each dtype's parameters in a group of their own: not what the formula
    # computes, so the record's numbers are not reproduced and the real step runs
    models = pair_of_models()
    for model in models:
        model.net[0].double()
    pairs = [(model, torch.optim.Adam(model.parameters(), lr=0.1, foreach=True)) for model in models]

    def mixed(x, y, *, model, opt):
        loss = F.cross_entropy(model.net[1:](model.net[0](x.double()).float()), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    traced = tracejit.trace(mixed, backend="aten")
    run_beside(traced, mixed, pairs, 6)
    entry = traced._entries()[0]
    assert any("no formula" in why for why in entry.api.stand_ins_refused.values())


def pair_of_models():
    model = make_model("mlp")
    other = make_model("mlp")
    other.load_state_dict(model.state_dict())
    return model, other


def test_zero_grad_at_the_start_binds_the_gradients_where_they_are():
    def first(x, y, *, model, opt):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    (model_a, opt_a), (model_b, opt_b) = twins("adam_fused")
    traced = tracejit.trace(first, backend="aten")
    for i in range(7):
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), first(x, y, model=model_a, opt=opt_a))
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    assert traced.stats.api_fallbacks == 0 and stood_in(traced) == 2 * traced.stats.api_replays > 0


def test_a_profiler_sees_the_optimizers_own_ranges():
    pairs = twins("adam_fused")
    traced = tracejit.trace(step, backend="aten")
    run(traced, pairs, 5)
    before = stood_in(traced)
    with torch.profiler.profile() as profile:
        run(traced, pairs, 1, start=5)
    assert stood_in(traced) == before
    names = {event.name for event in profile.events()}
    assert "Optimizer.step#Adam.step" in names and "Optimizer.zero_grad#Adam.zero_grad" in names


def test_a_method_the_function_keeps_works_after_the_call():
    # the function holds on to opt.step / model.forward while they are the stand-ins, and the
    # caller uses them afterwards: they are the optimizer's and the module's own methods then
    kept = {}

    def keeping(x, y, *, model, opt):
        kept["step"], kept["forward"] = opt.step, model.net.forward  # the MLP's Sequential is answered whole
        return step(x, y, model=model, opt=opt)

    models = pair_of_models()
    (model_a, opt_a), (model_b, opt_b) = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in models]
    traced = tracejit.trace(keeping, backend="aten")
    for i in range(5):
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), step(x, y, model=model_a, opt=opt_a))
    assert stood_in(traced) > 0
    x, y = batch("mlp", 9)
    assert type(kept["step"]).__name__ == "_StandIn" and type(kept["forward"]).__name__ == "_ForwardStandIn"
    for model, opt, forward, do_step in ((model_a, opt_a, model_a.net.forward, opt_a.step),
                                         (model_b, opt_b, kept["forward"], kept["step"])):
        F.cross_entropy(forward(x), y).backward()
        do_step()
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)


@pytest.mark.parametrize("foreach", [False, True])
def test_nadam_numbers_round_mu_product_as_its_step_does(foreach):
    # float64 parameters take NAdam's step sizes at full precision, while mu_product stays a
    # float32 tensor: a product computed in Python instead of rounded as `mu_product *= mu` does
    # shows in the parameters
    models = pair_of_models()
    for model in models:
        model.double()
    pairs = [(model, torch.optim.NAdam(model.parameters(), lr=0.05, foreach=foreach)) for model in models]

    def double_step(x, y, *, model, opt):
        loss = F.cross_entropy(model(x.double()), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    traced = tracejit.trace(double_step, backend="aten")
    run_beside(traced, double_step, pairs, 30)
    opt_b = pairs[1][1]
    assert opt_b.state[next(iter(opt_b.state))]["mu_product"].dtype == torch.float32
    assert traced.stats.api_fallbacks == 0 and stood_in(traced) == 2 * traced.stats.api_replays > 40


@pytest.mark.parametrize("name", ["adam_loop", "adam_foreach", "adagrad_loop", "nadam_loop"])
def test_several_steps_of_one_optimizer_in_a_call_are_answered_with_their_own_counts(name):
    # an inner loop of steps inside one traced call (PPO's minibatch epochs): the k-th step's
    # numbers come from the counts after k + 1 increments; before, the first step's numbers
    # changed every call and every call ran at the aten level (0.2x eager). NAdam's mu_product
    # changes from one step to the next: its steps are not answered (the calls end up at the aten
    # level, as before), still exact
    make = {**OPTIMIZERS, **HOST_READING}[name]
    pairs = [(model, make(model.parameters())) for model in pair_of_models()]

    def inner_loop(x, y, *, model, opt):
        losses = []
        for k in range(2):
            opt.zero_grad()
            loss = F.cross_entropy(model(x[k::2]), y[k::2])
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    traced = tracejit.trace(inner_loop, backend="aten")
    run_beside(traced, inner_loop, pairs, 10)
    stats = traced.stats
    if name != "nadam_loop":
        assert stats.api_fallbacks == 0 and stats.api_replays >= 5, stats
        assert stood_in(traced) == 4 * stats.api_replays  # two steps and two zero_grads each


def test_a_call_that_raises_after_the_branch_re_record_leaves_the_gradients_cleared():
    # review 42 F04: the re-record at RAdam's switch dropped the `.grad = None` clears the call
    # made before it (opt.zero_grad() at the top), so a later call raising inside the program kept
    # the old gradients where eager had cleared them
    def top_cleared_step(x, y, *, model, opt):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    pairs = [(model, torch.optim.RAdam(model.parameters(), lr=0.01)) for model in pair_of_models()]
    traced = tracejit.trace(top_cleared_step, backend="aten")
    (model_a, opt_a), (model_b, opt_b) = pairs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracejit.ReplayLevelWarning)
        run_beside(traced, top_cleared_step, pairs, 9)
        x, y = batch("mlp", 9)
        y = y.clone()
        y[0] = 99  # a bad label: cross_entropy raises after zero_grad() cleared the gradients
        for function, model, opt in ((top_cleared_step, model_a, opt_a), (traced, model_b, opt_b)):
            with pytest.raises((IndexError, RuntimeError)):
                function(x, y, model=model, opt=opt)
    assert traced.stats.rerecords >= 1  # the switch at step 6 recorded the call again
    assert all(p.grad is None for p in model_a.parameters())
    assert all(p.grad is None for p in model_b.parameters())


def test_a_gradient_cleared_on_some_calls_inside_the_step_is_followed():
    # review 42 F01: a user's `p.grad = None` before step() on some calls changes the step's ops;
    # the re-record started while the API tracer noted the call, which crashed with IndexError
    drop = [False]

    def dropping_step(x, y, *, model, opt):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if drop[0]:
            model.net[-1].bias.grad = None
        opt.step()
        opt.zero_grad()
        return loss

    pairs = [(model, torch.optim.Adam(model.parameters(), lr=0.05)) for model in pair_of_models()]
    traced = tracejit.trace(dropping_step, backend="aten")
    (model_a, opt_a), (model_b, opt_b) = pairs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracejit.ReplayLevelWarning)
        for i in range(8):
            drop[0] = i % 3 == 1
            x, y = batch("mlp", i)
            want = dropping_step(x, y, model=model_a, opt=opt_a)
            try:
                got = traced(x, y, model=model_b, opt=opt_b)
            except tracejit.TraceMismatchError:  # the re-records spent: loud, never a crash
                assert i >= 4
                return
            assert torch.equal(got, want), i
            assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
