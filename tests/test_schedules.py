"""Learning-rate schedules and gradient accumulation (issue 12.6): OneCycleLR (which cycles SGD's
momentum or Adam's beta1), CosineAnnealingWarmRestarts, a LambdaLR warm-up from 0, and a
`do_step` flag, each against eager over 12+ steps: parameters, gradients and optimizer state
bitwise equal after every step, in checked replay (API and aten level), symbolic=True and
without_host=True."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import assert_same_state
from side_by_side import assert_replayed

import tracejit

STEPS = 12
SCHEDULES = {
    "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 4),
    "cosine_warm_restarts": lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        opt, T_0=3, T_mult=2, eta_min=1e-4),
    "lambda_warm_up_from_0": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 4)),
}
OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-3),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=0.01, fused=True),
    "adam_foreach": lambda params: torch.optim.Adam(params, lr=0.01, foreach=True),  # step.item(): checked only
    "rmsprop_momentum": lambda params: torch.optim.RMSprop(params, lr=0.01, momentum=0.5, foreach=True),
}
MODES = {"checked": {}, "checked_aten": {}, "symbolic": {"symbolic": True}, "without_host": {"without_host": True}}


def step(x, y, *, model, opt, do_step=True, set_to_none=True):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if do_step:
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return loss


def _setting(opt) -> tuple:
    group = opt.param_groups[0]
    return group["lr"], group.get("momentum"), group.get("betas")


def _train(schedule: str, opt_name: str, mode: str, monkeypatch, accumulate: int = 1, **step_options):
    """Eager and traced twins trained side by side; every `accumulate`-th call steps the optimizer
    and the scheduler. Returns the traced function and the settings seen at each step."""
    if mode == "checked_aten":
        monkeypatch.setenv("TRACEJIT_REPLAY", "aten")
    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = OPTIMIZERS[opt_name](model_a.parameters()), OPTIMIZERS[opt_name](model_b.parameters())
    schedulers = [SCHEDULES[schedule](opt) for opt in (opt_a, opt_b)]
    traced = tracejit.trace(step, backend="aten", **MODES[mode])
    g = torch.Generator().manual_seed(0)
    settings = []
    for i in range(STEPS):
        x, y = torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)
        flag = {"do_step": i % accumulate == accumulate - 1, **step_options} if accumulate > 1 else {}
        want = step(x, y, model=model_a, opt=opt_a, **flag)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b, **flag), want), f"step {i}"
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)  # params, .grad, optimizer state
        if flag.get("do_step", True):
            for scheduler in schedulers:
                scheduler.step()
            assert _setting(opt_a) == _setting(opt_b)
            settings.append(_setting(opt_a))
    return traced, settings


def _assert_mode_ran(traced, mode: str, calls: int) -> None:
    stats = traced.stats
    if mode == "without_host":
        assert stats.host_free_calls >= calls and stats.host_free_misses == 0, stats
    elif mode == "checked_aten":
        assert stats.api_replays == 0 and stats.checked_replays >= calls, stats
    else:
        assert stats.api_replays >= calls - 1 and stats.api_fallbacks == 0, stats


# foreach Adam reads step.item() on the host: checked replay only; the aten-level replay
# (TRACEJIT_REPLAY=aten) for the schedule that changes the most settings (lr and momentum or beta1)
CASES = [(schedule, opt_name, mode) for schedule in SCHEDULES for opt_name in ("sgd_momentum", "adam_fused")
         for mode in ("checked", "symbolic", "without_host")]
CASES += [("one_cycle", "adam_foreach", "checked"), ("lambda_warm_up_from_0", "adam_foreach", "checked")]
CASES += [("one_cycle", opt_name, "checked_aten") for opt_name in ("sgd_momentum", "adam_fused")]
# OneCycleLR cycles RMSprop's momentum, which its `buf.mul_(momentum)` takes: without the host too
CASES += [("one_cycle", "rmsprop_momentum", mode) for mode in ("checked", "without_host")]


@pytest.mark.parametrize("schedule, opt_name, mode", CASES)
def test_schedule_matches_eager(schedule, opt_name, mode, monkeypatch):
    traced, settings = _train(schedule, opt_name, mode, monkeypatch)
    assert_replayed(traced, STEPS)
    _assert_mode_ran(traced, mode, STEPS - 2)  # the first call records, the second re-records (lazy state)
    assert len({lr for lr, _, _ in settings}) > 3  # the schedule moved the learning rate...
    if schedule == "lambda_warm_up_from_0":
        assert traced.records[0].ops and settings[0][0] > 0  # ...from 0 on the recorded call
    if schedule == "one_cycle":  # ...and cycled momentum or beta1 with it
        assert len({momentum if betas is None else betas[0] for _, momentum, betas in settings}) > 3


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused"])
def test_gradient_accumulation_with_a_do_step_flag(opt_name, mode, monkeypatch):
    # The flag decides whether the optimizer ops run: it used to be a TraceMismatchError ("more ops
    # than recorded") whenever a call with the other value had the same gradient state; now each
    # value selects a trace of its own. Without the host, the accumulating calls (no step) used to
    # miss on every call because the scheduler had changed lr, a setting they never read.
    traced, settings = _train("one_cycle", opt_name, mode, monkeypatch, accumulate=3)
    # traces: first backward (no .grad yet), accumulating backward, stepping call
    assert_replayed(traced, STEPS, records=3)
    assert len(traced.records) == 3 and len(settings) == STEPS // 3
    if mode == "without_host":
        # the stepping call frees the .grad it read (zero_grad), so each of its calls runs the
        # function (guide: "An external that the call reads and then frees"); the others do not
        assert traced.stats.host_free_calls >= 5 and traced.stats.host_free_misses == 0, traced.stats
    elif mode == "checked_aten":
        _assert_mode_ran(traced, mode, STEPS - 4)
    else:  # the stepping trace, which frees what it read, stays at the aten level, as without_host
        assert traced.stats.api_replays >= 3 and traced.stats.api_fallbacks == 0, traced.stats


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused"])
def test_accumulation_that_keeps_zeroed_gradients_is_host_free_on_every_step(opt_name, monkeypatch):
    # zero_grad(set_to_none=False) leaves the .grad tensors in place: the stepping call has nothing
    # it frees, so it runs without the host too (the guide's advice)
    traced, _ = _train("one_cycle", opt_name, "without_host", monkeypatch, accumulate=3, set_to_none=False)
    assert_replayed(traced, STEPS, records=3)
    assert traced.stats.host_free_calls == STEPS - 4 and traced.stats.checked_replays == 0, traced.stats


def test_a_bool_keyword_selects_a_trace_and_is_named_when_the_cache_is_full():
    traced = tracejit.trace(lambda x, *, double: x * 2 if double else x + 1, max_traces=2)
    x = torch.randn(3)
    for double in (True, False, True, False):
        assert torch.equal(traced(x, double=double), x * 2 if double else x + 1)
    assert traced.stats.records == 2 and traced.stats.checked_replays == 2
    with pytest.raises(tracejit.TraceCacheFullError, match=r"double=True"):
        traced(torch.randn(4), double=True)


def test_a_loss_scale_keyword_that_changes_every_call_reaches_backward():
    # gradient accumulation divides the loss by the number of micro-batches, which changes for a
    # last, shorter accumulation; here it changes every call
    def scaled_step(x, y, *, model, opt, scale):
        loss = F.cross_entropy(model(x), y) * scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    torch.manual_seed(0)
    model_a = nn.Linear(8, 4)
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = OPTIMIZERS["adam_fused"](model_a.parameters()), OPTIMIZERS["adam_fused"](model_b.parameters())
    traced = tracejit.trace(scaled_step, backend="aten")
    g = torch.Generator().manual_seed(0)
    for i in range(6):
        x, y = torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)
        want = scaled_step(x, y, model=model_a, opt=opt_a, scale=1.0 / (i + 1))
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b, scale=1.0 / (i + 1)), want), i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    # backward multiplies by the scale autograd saved, which the API level does not see (once,
    # backward kept the traced scale, silently; then a new scale ran the call at the aten level):
    # the scale changed between the recorded call and the one the API level was built from, and
    # so did MulBackward's copy of it, so the API level passes the new scale to both
    stats = traced.stats
    assert stats.api_replays == 3 and stats.api_fallbacks == 0, stats


def test_a_scheduler_stepped_inside_the_function_is_refused_without_the_host(monkeypatch):
    # a host-free call never ran scheduler.step(): the learning rate froze at the recorded step
    # and the parameters went wrong silently
    def step_and_schedule(x, y, *, model, opt, scheduler):
        loss = step(x, y, model=model, opt=opt)
        scheduler.step()
        return loss

    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = OPTIMIZERS["adam_fused"](model_a.parameters()), OPTIMIZERS["adam_fused"](model_b.parameters())
    sched_a, sched_b = (SCHEDULES["one_cycle"](opt) for opt in (opt_a, opt_b))
    checked = tracejit.trace(step_and_schedule, backend="aten")  # runs the function: follows the schedule
    refused = tracejit.trace(step_and_schedule, backend="aten", without_host=True)
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        x, y = torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)
        want = step_and_schedule(x, y, model=model_a, opt=opt_a, scheduler=sched_a)
        assert torch.equal(checked(x, y, model=model_b, opt=opt_b, scheduler=sched_b), want)
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    assert checked.stats.api_replays >= 1
    model_c = copy.deepcopy(model_a)
    opt_c = OPTIMIZERS["adam_fused"](model_c.parameters())
    sched_c = SCHEDULES["one_cycle"](opt_c)
    with pytest.raises(tracejit.HostDependencyError, match=r"(?s)lr of param group 0 of opt: .* -> .*last_epoch of "
                                                           r"scheduler: 1 -> 2.*Call scheduler.step\(\) after the traced"):
        for _ in range(3):
            refused(x, y, model=model_c, opt=opt_c, scheduler=sched_c)
    assert refused.stats.host_free_calls == 0


class _Trainer:
    """Holds the optimizer and its schedule: the traced function reaches neither directly."""

    def __init__(self, model, when):
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.opt, 1, gamma=0.5)
        self.when = when

    def update(self):
        if self.when == "scheduler_before":
            self.scheduler.step()
        self.opt.step()
        self.opt.zero_grad()
        if self.when == "scheduler_after":
            self.scheduler.step()
        if self.when == "by_hand":
            for group in self.opt.param_groups:
                group["lr"] *= 0.5


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("when", ["scheduler_before", "scheduler_after", "by_hand"])
def test_a_schedule_a_helper_object_steps_is_refused_without_the_host(when):
    # the function reached neither optimizer nor scheduler: the learning rate froze at the
    # recorded step in every later call, silently (0.05 instead of 0.00625 after four calls)
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    trainer = _Trainer(model, when)

    def train(x, *, model):
        loss = model(x).pow(2).mean()
        loss.backward()
        trainer.update()
        return loss.detach()

    traced = tracejit.trace(train, backend="aten", without_host=True)
    expected = {"scheduler_before": r"StepLR\.step\(\) at .*test_schedules.py:\d+ in update",
                "scheduler_after": r"StepLR\.step\(\) at .*in update",
                "by_hand": r"lr of param group 0 of SGD: [\d.]+ -> [\d.]+, written after its step\(\)"}[when]
    with pytest.raises(tracejit.HostDependencyError, match=f"(?s)changes Python state.*{expected}"):
        for _ in range(3):
            traced(torch.randn(5, 8), model=model)
    assert traced.stats.host_free_calls == 0
    for cls in (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.StepLR):
        if "step" in vars(cls):  # wrapped once for good, to tell the recording call's watch
            assert not getattr(vars(cls)["step"].__wrapped__, "__tracejit_notes__", False)


def test_schedulers_stepped_while_two_threads_record_are_told_apart():
    # the wrappers of scheduler.step tell the call the stepping thread runs: a thread recording
    # without the host is not refused for another thread's scheduler, and the wrappers never nest
    import threading

    torch.manual_seed(0)
    barrier = threading.Barrier(2)
    errors, refused = [], []

    started: set = set()

    def plain(x, *, model):
        if threading.get_ident() not in started:  # the two recordings overlap; later runs need not
            started.add(threading.get_ident())
            barrier.wait(timeout=30)
        return model(x).pow(2).mean().detach()

    def run(traced, stepping):
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
        try:
            for _ in range(3):
                traced(torch.randn(3, 4), model=model)
                if stepping:
                    scheduler.step()  # outside the traced call: never refused
        except tracejit.HostDependencyError as error:
            refused.append(error)
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    tracers = [tracejit.trace(plain, without_host=True) for _ in range(2)]
    threads = [threading.Thread(target=run, args=(t, i == 0)) for i, t in enumerate(tracers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors and not refused, (errors, refused)
    step = vars(torch.optim.lr_scheduler.LRScheduler)["step"]
    assert not getattr(step.__wrapped__, "__tracejit_notes__", False)


class _Lion(torch.optim.Optimizer):
    """An optimizer of the user's own: decoupled weight decay computes `1 - lr * weight_decay`."""

    def __init__(self, params, lr=1e-3, weight_decay=0.0):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                avg = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - lr * wd)
                p.add_((avg * 0.9 + p.grad * 0.1).sign_(), alpha=-lr)
                avg.mul_(0.99).add_(p.grad, alpha=0.01)


@pytest.mark.parametrize("mode", ["checked", "without_host"])
def test_a_schedule_of_an_optimizer_of_the_users_own_matches_eager(mode):
    """Its learning rate was bound where the update takes `alpha=-lr`, as torch's optimizers', and no
    longer guarded, so the `1 - lr * wd` it also computes stayed the recorded number without the
    host (parameters 4e-2 off after 10 steps). Its lr is guarded now: a scheduled call runs the
    function."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))]
    models.append(copy.deepcopy(models[0]))
    opts = [_Lion(m.parameters(), lr=0.01, weight_decay=5.0) for m in models]
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)) for o in opts]
    traced = tracejit.trace(step, **({"without_host": True} if mode == "without_host" else {}))
    for i in range(10):
        x, y = torch.randn(10, 8), torch.randint(0, 4, (10,))
        for function, model, opt, schedule in zip((step, traced), models, opts, schedules):
            function(x, y, model=model, opt=opt)
            schedule.step()
        for a, b in zip(*(m.parameters() for m in models)):
            assert torch.equal(a, b), f"step {i}"
    assert traced.stats.checked_replays + traced.stats.host_free_misses >= 8


TENSOR_LR_OPTIMIZERS = {
    "SGD": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
    "SGD_foreach": lambda p, lr: torch.optim.SGD(p, lr=lr, foreach=True),
    "Adam": lambda p, lr: torch.optim.Adam(p, lr=lr),
    "NAdam": lambda p, lr: torch.optim.NAdam(p, lr=lr),
    "Adamax": lambda p, lr: torch.optim.Adamax(p, lr=lr),
    "RMSprop": lambda p, lr: torch.optim.RMSprop(p, lr=lr),
    "Adam_fused": lambda p, lr: torch.optim.Adam(p, lr=lr, fused=True),
}


@pytest.mark.parametrize("opt_name", sorted(TENSOR_LR_OPTIMIZERS))
def test_a_tensor_learning_rate_filled_by_a_schedule_matches_eager(opt_name):
    """`lr=torch.tensor(...)`, which torch's schedulers fill in place. The optimizers without
    fused kernels turn it into numbers inside their torch calls (`p.add_(g, alpha=-lr)`), which the
    API level answered with the recorded numbers: Adam was 0.24 off after 7 calls with nothing
    changed, SGD went on at lr 0.1 after the schedule set 100. Such calls stay at the aten level;
    fused Adam reads the tensor in its kernel and stays at the API level."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))]
    models.append(copy.deepcopy(models[0]))
    opts = [TENSOR_LR_OPTIMIZERS[opt_name](m.parameters(), torch.tensor(0.01)) for m in models]
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=10.0) for o in opts]
    traced = tracejit.trace(step, backend="aten")
    for i in range(9):
        x, y = torch.randn(10, 8), torch.randint(0, 4, (10,))
        for function, model, opt, schedule in zip((step, traced), models, opts, schedules):
            function(x, y, model=model, opt=opt)
            schedule.step()
        assert_same_state(models[0], opts[0], models[1], opts[1])
    assert float(opts[1].param_groups[0]["lr"]) == pytest.approx(10.0)
    assert traced.stats.checked_replays >= 7
    if opt_name == "Adam_fused":
        assert traced.stats.api_replays >= 5


@pytest.mark.parametrize("schedule", ["one_cycle", "sequential"])
def test_a_scheduler_stepped_inside_a_call_that_runs_twice_steps_once(schedule):
    """Hunt R F4: a checked call that diverges at the API level runs the function again at the aten
    level; a scheduler stepped inside it was stepped twice, and the schedule ran ahead of eager for
    good. Its state and the settings it writes are put back before the second run
    (record/schedulers.py). Here a leaky_relu slope that changes on every call (a number before
    backward the API level matches exactly) makes the first calls diverge after the scheduler's
    step."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if schedule == "one_cycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=50)
        else:
            sched = torch.optim.lr_scheduler.SequentialLR(opt, [
                torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3),
                torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)], milestones=[3])
        return model, opt, sched

    def annealed_step(x, y, *, slope, model, opt, sched):
        sched.step()  # at the start of the iteration: before the call diverges
        loss = F.cross_entropy(F.leaky_relu(model[0](x), slope) @ model[1].weight.T, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    eager, mine = make(), make()
    traced = tracejit.trace(annealed_step, backend="aten")
    for i in range(10):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        slope = 0.01 * (i + 1)
        want = annealed_step(x, y, slope=slope, model=eager[0], opt=eager[1], sched=eager[2])
        got = traced(x, y, slope=slope, model=mine[0], opt=mine[1], sched=mine[2])
        assert torch.equal(got, want), i
        assert mine[2].last_epoch == eager[2].last_epoch, i
        assert mine[1].param_groups[0]["lr"] == eager[1].param_groups[0]["lr"], i
        assert_same_state(eager[0], eager[1], mine[0], mine[1])
    assert traced.stats.api_fallbacks >= 1, traced.stats
