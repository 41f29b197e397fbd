"""Mixed precision (issue 12.5): torch.autocast("cpu", bfloat16) inside the traced step with
torch.amp.GradScaler, against eager step by step, with overflow steps injected through an input.

GradScaler.step() reads found_inf on the host and skips optimizer.step() on an overflow, unless the
optimizer takes the scaler on the device (Adam(fused=True)). Checked replay follows that branch
(a variant per side, runtime/variants.py); without_host runs the fused case and refuses the other.
"""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import assert_same_state

import tracejit

STEPS = 12
OVERFLOWS = (4, 9)  # the second overflow finds the variant the first one recorded
OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam_foreach": lambda params: torch.optim.Adam(params, lr=0.01, foreach=True),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=0.01, fused=True),
    "sgd_fused": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True),
}


def step(x, y, overflow, *, model, opt, scaler, clip=False):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    assert logits.dtype == torch.bfloat16  # autocast is on inside the traced step
    loss = F.cross_entropy(logits.float(), y) * overflow  # overflow: 1, or inf on an injected step
    scaler.scale(loss).backward()
    if clip:  # the documented pattern for clipping: unscale first, then clip the true gradients
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return loss


def _scaler_state(scaler) -> tuple:
    return scaler.get_scale(), scaler._get_growth_tracker()


def _train(opt_name: str, monkeypatch, replay: str = "api", clip: bool = False, **options):
    """Eager and traced twins; every step compares params, .grad, optimizer and scaler state bitwise.
    Returns the traced function and the eager scales after each step."""
    if replay == "aten":
        monkeypatch.setenv("TRACEJIT_REPLAY", "aten")
    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = OPTIMIZERS[opt_name](model_a.parameters()), OPTIMIZERS[opt_name](model_b.parameters())
    # growth_interval=2: the scale grows every other clean step, so growth and backoff both happen
    scaler_a, scaler_b = (torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) for _ in range(2))
    traced = tracejit.trace(step, backend="aten", **options)
    g = torch.Generator().manual_seed(0)
    scales = []
    for i in range(STEPS):
        x, y = torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)
        overflow = torch.tensor(float("inf") if i in OVERFLOWS else 1.0)
        want = step(x, y, overflow, model=model_a, opt=opt_a, scaler=scaler_a, clip=clip)
        got = traced(x, y, overflow.clone(), model=model_b, opt=opt_b, scaler=scaler_b, clip=clip)
        assert torch.equal(got, want), f"step {i}"
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
        assert _scaler_state(scaler_b) == _scaler_state(scaler_a), f"step {i}"
        scales.append(scaler_a.get_scale())
    # the injected steps did overflow: eager halved the scale there (and skipped the update)
    assert all(scales[i] == scales[i - 1] / 2 for i in OVERFLOWS)
    return traced


@pytest.mark.parametrize("replay", ["api", "aten"])
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_foreach"])
def test_an_overflow_skips_the_step_as_eager_does(opt_name, replay, monkeypatch):
    # the overflow used to raise TraceMismatchError (the scaler's update came where the optimizer's
    # ops were recorded); now the first overflow records the other branch once, later calls move
    # between the two variants at the inf check
    expected = "GradScaler checks for inf on the host"
    with pytest.warns(tracejit.ReplayLevelWarning, match=expected) if replay == "api" else contextlib.nullcontext():
        traced = _train(opt_name, monkeypatch, replay)
    stats = traced.stats
    assert stats.records == 1 and stats.rerecords == 1 and stats.branch_variants == 1, stats
    assert stats.checked_replays == STEPS - 3 and stats.api_replays == 0, stats
    assert len(traced._entries()[0].variants) == 2


@pytest.mark.parametrize("mode", ["checked", "checked_aten", "symbolic", "without_host"])
def test_fused_adam_takes_the_scaler_on_the_device(mode, monkeypatch):
    # no host read: the overflow is an input like any other, the same program serves every step
    options = {"symbolic": {"symbolic": True}, "without_host": {"without_host": True}}.get(mode, {})
    traced = _train("adam_fused", monkeypatch, "aten" if mode == "checked_aten" else "api", **options)
    stats = traced.stats
    assert stats.records == 1 and stats.branch_variants == 0 and not traced.records[0].host_reads, stats
    if mode == "without_host":
        assert stats.host_free_calls == STEPS - 2 and stats.host_free_misses == 0, stats
    elif mode == "checked_aten":
        assert stats.checked_replays == STEPS - 2 and stats.api_replays == 0, stats
    else:
        assert stats.api_replays >= STEPS - 3 and stats.api_fallbacks == 0, stats


@pytest.mark.parametrize("opt_name, mode", [("sgd_fused", "without_host"), ("sgd_momentum", "checked_aten")])
def test_unscale_and_clip_before_the_step(opt_name, mode, monkeypatch):
    options = {"without_host": True} if mode == "without_host" else {}
    traced = _train(opt_name, monkeypatch, "aten" if mode == "checked_aten" else "api", clip=True, **options)
    stats = traced.stats
    if mode == "without_host":
        assert stats.host_free_calls == STEPS - 2 and stats.host_free_misses == 0, stats
    else:
        assert stats.branch_variants == 1 and stats.checked_replays == STEPS - 3, stats


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_foreach"])
def test_without_host_refuses_the_inf_check_and_says_what_to_use(opt_name, monkeypatch):
    with pytest.raises(tracejit.HostDependencyError) as info:
        _train(opt_name, monkeypatch, without_host=True)
    message = str(info.value)
    assert "(GradScaler's inf check)" in message and "scaler.step(opt)" in message
    assert "Adam/AdamW(fused=True) get grad_scale and found_inf" in message


def test_overflows_need_room_for_a_second_trace(monkeypatch):
    monkeypatch.setenv("TRACEJIT_REPLAY", "aten")
    with pytest.raises(tracejit.TraceCacheFullError, match=r"GradScaler's inf check at .* took a branch no trace "
                                                           r"has recorded .* max_traces=1"):
        _train("sgd_momentum", monkeypatch, max_traces=1)


def test_reading_the_scale_is_not_the_inf_check():
    # only the read that decides whether the optimizer steps is a branch point; get_scale() is an
    # ordinary host read (a mismatch if code branches on it, a refusal without the host)
    def logged_step(x, y, overflow, *, model, opt, scaler):
        loss = step(x, y, overflow, model=model, opt=opt, scaler=scaler)
        return loss * scaler.get_scale()

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = OPTIMIZERS["adam_fused"](model.parameters())
    traced = tracejit.trace(logged_step, without_host=True)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(tracejit.HostDependencyError) as info:
        for _ in range(3):
            traced(torch.randn(5, 8), torch.randint(0, 4, (5,)), torch.tensor(1.0), model=model, opt=opt, scaler=scaler)
    assert "item() of t" in str(info.value) and "inf check" not in str(info.value)


def _train_under(outer, train, make_opt, without_host):
    """Train twin MLPs eagerly and traced, each call under a fresh `outer()` context, comparing
    every step; the traced calls must take the fast path."""
    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = make_opt(model_a.parameters()), make_opt(model_b.parameters())
    traced = tracejit.trace(train, without_host=without_host, backend="aten")
    for i in range(6):
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        with outer():
            want = train(x, y, model=model_a, opt=opt_a)
        with outer():
            got = traced(x, y, model=model_b, opt=opt_b)
        assert got.dtype == want.dtype and torch.equal(got, want), i
        assert_same_state(model_a, opt_a, model_b, opt_b)
    stats = traced.stats
    if without_host:
        assert stats.host_free_calls >= 4 and stats.host_free_misses == 0, stats
    else:
        assert stats.api_replays >= 3 and stats.api_fallbacks == 0, stats


@pytest.mark.parametrize("without_host", [True, False], ids=["without_host", "checked"])
def test_autocast_entered_around_each_step(without_host):
    # the guide recommends autocast inside the step; around it, autocast caches its casts of the
    # weights per context: traced calls run without that cache, so each call's casts are ops of
    # the trace (a cached cast held as an external made every later call miss)
    def train(x, y, *, model, opt):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    _train_under(lambda: torch.autocast("cpu", dtype=torch.bfloat16), train,
                 lambda params: torch.optim.Adam(params, lr=1e-2, fused=True), without_host)


@pytest.mark.parametrize("without_host", [True, False], ids=["without_host", "checked"])
def test_autocast_inside_the_step_under_the_callers_disabled_autocast(without_host):
    # Under an outer region, torch keeps the weight casts an inner region made until the outer one
    # ends: they counted as tensors each call keeps, and every call missed the fast path.
    def train(x, y, *, model, opt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    _train_under(lambda: torch.autocast("cpu", enabled=False), train,
                 lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), without_host)


_SETTINGS_CHANGES = {
    "growth_factor": lambda scaler: scaler.set_growth_factor(4.0),
    "backoff_factor": lambda scaler: scaler.set_backoff_factor(0.25),
    "growth_interval": lambda scaler: scaler.set_growth_interval(3),
    "load_state_dict": lambda scaler: scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 1,
                                                             "growth_factor": 3.0}),
}


@pytest.mark.parametrize("mode", ["checked", "without_host"])
@pytest.mark.parametrize("change", list(_SETTINGS_CHANGES))
def test_scaler_settings_changed_between_calls_are_followed(change, mode):
    # the growth and backoff factors and the interval reach aten._amp_update_scale_ as numbers: they
    # were structural (a checked call at the API level then ran the function twice and left the
    # scaler between step() and update(), refusing every later call), and frozen without the host
    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = (OPTIMIZERS["adam_fused"](m.parameters()) for m in (model_a, model_b))
    scaler_a, scaler_b = (torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1) for _ in range(2))
    traced = tracejit.trace(step, backend="aten", without_host=mode == "without_host")
    generator = torch.Generator().manual_seed(1)
    for i in range(10):
        if i == 5:
            _SETTINGS_CHANGES[change](scaler_a)
            _SETTINGS_CHANGES[change](scaler_b)
        x, y = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
        overflow = torch.tensor(float("inf") if i == 7 else 1.0)
        want = step(x, y, overflow, model=model_a, opt=opt_a, scaler=scaler_a)
        got = traced(x, y, overflow, model=model_b, opt=opt_b, scaler=scaler_b)
        assert torch.equal(got, want), i
        assert _scaler_state(scaler_b) == _scaler_state(scaler_a), i
        assert_same_state(model_a, opt_a, model_b, opt_b)
    stats = traced.stats
    if mode == "checked":
        assert stats.api_replays >= 6 and stats.api_fallbacks == 0, stats
    else:
        assert stats.host_free_calls >= 6, stats


def test_a_mismatch_between_the_scalers_step_and_update_leaves_the_scaler_usable():
    # the call raises TraceMismatchError after scaler.step(): the scaler's stage goes back to what
    # it was when the call began (was: torch's "step() has already been called since the last
    # update()" on every later call)
    def logged_step(x, y, overflow, *, model, opt, scaler, log):
        loss = F.cross_entropy(model(x), y) * overflow
        scaler.scale(loss).backward()
        scaler.step(opt)
        if log == "extra":
            loss = loss * 1.0
        scaler.update()
        opt.zero_grad()
        return loss.detach()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = OPTIMIZERS["adam_fused"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    traced = tracejit.trace(logged_step, backend="aten")
    x, y, one = torch.randn(6, 8), torch.randint(0, 4, (6,)), torch.tensor(1.0)
    for _ in range(5):
        traced(x, y, one, model=model, opt=opt, scaler=scaler, log="plain")
    served = traced.stats.api_replays
    assert served >= 1
    with pytest.raises(tracejit.TraceMismatchError, match="a different op ran"):
        traced(x, y, one, model=model, opt=opt, scaler=scaler, log="extra")
    for _ in range(3):
        traced(x, y, one, model=model, opt=opt, scaler=scaler, log="plain")
    assert traced.stats.api_replays > served


@pytest.mark.parametrize("held_by", ["trainer", "dict"])
def test_a_mismatch_after_unscale_leaves_a_scaler_held_by_an_object_usable(held_by):
    # hunt R F1: the stages were saved for scalers reached directly only; a trainer's
    # `self.scaler` (or a dict of training objects) was left unscaled by the diverged API-level
    # attempt, so the aten-level run raised torch's "unscale_() has already been called" on that
    # call and on every later one
    def clipped_step(x, y, *, state, norm_type):
        trainer = state if held_by == "trainer" else None
        model, opt, scaler = (trainer.model, trainer.opt, trainer.scaler) if trainer else (
            state["model"], state["opt"], state["scaler"])
        loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=norm_type)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return loss.detach()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    parts = {"model": model, "opt": OPTIMIZERS["adam_fused"](model.parameters()),
             "scaler": torch.amp.GradScaler("cpu", init_scale=2.0**8)}
    state = type("Trainer", (), {})() if held_by == "trainer" else parts
    if held_by == "trainer":
        state.__dict__.update(parts)
    traced = tracejit.trace(clipped_step, backend="aten")
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    for _ in range(5):
        traced(x, y, state=state, norm_type=2.0)
    assert traced.stats.api_replays >= 1
    with pytest.raises(tracejit.TraceMismatchError):  # another norm: other ops, loud
        traced(x, y, state=state, norm_type=float("inf"))
    assert all(s["stage"].name == "READY" for s in parts["scaler"]._per_optimizer_states.values())
    parts["opt"].zero_grad()
    for _ in range(3):
        traced(x, y, state=state, norm_type=2.0)


def test_a_scaler_reached_through_a_helper_object_is_guarded_without_the_host():
    # the guard covered scalers the function reaches directly; one reached through a trainer
    # object kept its recorded growth factor (scale 262144 against eager's 8388608 after ten steps)
    class Trainer:
        def __init__(self, model):
            self.opt = OPTIMIZERS["adam_fused"](model.parameters())
            self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)

        def update(self, loss):
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad()

    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model_b = copy.deepcopy(model_a)
    trainers = {id(model_a): Trainer(model_a), id(model_b): Trainer(model_b)}

    def train(x, y, *, model):
        loss = F.cross_entropy(model(x), y)
        trainers[id(model)].update(loss)
        return loss.detach()

    traced = tracejit.trace(train, backend="aten", without_host=True)
    generator = torch.Generator().manual_seed(1)
    for i in range(10):
        if i == 5:
            for trainer in trainers.values():
                trainer.scaler.set_growth_factor(4.0)
        x, y = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
        assert torch.equal(traced(x, y, model=model_b), train(x, y, model=model_a)), i
        a, b = trainers[id(model_a)], trainers[id(model_b)]
        assert _scaler_state(b.scaler) == _scaler_state(a.scaler), i
        assert_same_state(model_a, a.opt, model_b, b.opt)
    assert traced.stats.host_free_calls >= 6, traced.stats


_AMP = {"dtype": torch.bfloat16, "enabled": True, "grad": False}
_LINEAR = nn.Linear(8, 4)


def _autocast_inside(x):
    with torch.autocast("cpu", dtype=_AMP["dtype"], enabled=_AMP["enabled"]):
        return _LINEAR(x) * 2


def _grad_mode_inside(x):
    with torch.set_grad_enabled(_AMP["grad"]):
        return _LINEAR(x) * 2


@pytest.mark.parametrize("change", [{"dtype": torch.float16}, {"enabled": False}])
def test_autocast_the_function_enters_itself_is_checked_at_every_call(change):
    """`torch.autocast` entered inside the function never reaches the torch-function mode: calls
    at the API level answered from a program recorded under bfloat16 after the function switched
    to float16 or off (the result was the recorded dtype's, counted as a good replay). Each call
    is checked against the autocast state it was recorded under now; a different one runs at the
    aten level, which raises TraceMismatchError for the other casts."""
    _AMP.update(dtype=torch.bfloat16, enabled=True)
    traced = tracejit.trace(_autocast_inside)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(traced(x), _autocast_inside(x))
        assert traced.stats.api_replays >= 1
        _AMP.update(change)
        try:
            with pytest.raises(tracejit.TraceMismatchError, match="_to_copy|dtype"):
                traced(x)
        finally:
            _AMP.update(dtype=torch.bfloat16, enabled=True)


def test_grad_mode_the_function_sets_itself_is_compared_at_the_api_level():
    """`torch.set_grad_enabled(flag)` inside the function with another flag than recorded was
    accepted at the API level by the function alone: the result came back without the autograd
    graph eager gives it."""
    _AMP["grad"] = False
    traced = tracejit.trace(_grad_mode_inside)
    x = torch.randn(3, 8)
    with torch.no_grad():
        for _ in range(4):
            assert not traced(x).requires_grad
        assert traced.stats.api_replays >= 1
        _AMP["grad"] = True
        try:
            got, want = traced(x), _grad_mode_inside(x)
        finally:
            _AMP["grad"] = False
    assert got.requires_grad and want.requires_grad and torch.equal(got, want)


def _scaled_step(x, y, *, model, opt, scaler):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float(), y)
    scaled = scaler.scale(loss)
    scaled.backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return scaled.detach()


@pytest.mark.parametrize("without_host", [False, True])
def test_a_scaler_resumed_from_a_checkpoint_replaces_the_old_one(without_host):
    """A new GradScaler loaded from a checkpoint, passed from the fifth call on. Without the host,
    the program kept scaling with and updating the old scaler's tensors (the new one stayed at
    1024 while eager's grew); in checked replay its lazily made scale raised TraceMismatchError.
    Its scale is located through the keyword now, and a scaler without one records again."""
    torch.manual_seed(0)
    models = [nn.Linear(8, 4)]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.Adam(m.parameters(), lr=0.01, fused=True) for m in models]
    scalers = [torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=2) for _ in models]
    traced = tracejit.trace(_scaled_step, without_host=without_host)
    for i in range(9):
        x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
        if i == 4:
            state = {**scalers[0].state_dict(), "scale": 1024.0, "_growth_tracker": 0}
            scalers = [torch.amp.GradScaler("cpu") for _ in models]
            for scaler in scalers:
                scaler.load_state_dict(dict(state))
        losses = [step(x, y, model=m, opt=o, scaler=s)
                  for step, m, o, s in zip((_scaled_step, traced), models, opts, scalers)]
        assert torch.equal(*losses), i
        assert scalers[0].get_scale() == scalers[1].get_scale(), i
        assert_same_state(models[0], opts[0], models[1], opts[1])
    assert traced.stats.host_free_calls >= 2 if without_host else traced.stats.checked_replays >= 2


def _overflowing_step(x, y, mult, *, model, opt, scaler):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x).float(), y) * mult
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("overflows", [(0,), (0, 1)])
@pytest.mark.parametrize("foreach", [True, False])
def test_an_overflow_on_the_first_calls_before_the_optimizer_has_state(overflows, foreach):
    """fp16 training often overflows on its first steps, so the recorded step skipped Adam's step
    and Adam made no state. The first clean call records again (or records the other branch of
    the inf check) with the state's creation; the next call, which has the state, raised
    TraceMismatchError ("_foreach_add_ instead of zeros_like"). Both now record once more."""
    torch.manual_seed(0)
    models = [nn.Linear(8, 4)]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.Adam(m.parameters(), lr=0.01, foreach=foreach) for m in models]
    scalers = [torch.amp.GradScaler("cpu") for _ in models]
    traced = tracejit.trace(_overflowing_step)
    for i in range(7):
        x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
        mult = torch.tensor(float("inf") if i in overflows else 1.0)
        losses = [step(x, y, mult.clone(), model=m, opt=o, scaler=s)
                  for step, m, o, s in zip((_overflowing_step, traced), models, opts, scalers)]
        assert torch.equal(losses[0], losses[1]) or (losses[0].isnan() and losses[1].isnan()), i
        assert scalers[0].get_scale() == scalers[1].get_scale(), i
        assert_same_state(models[0], opts[0], models[1], opts[1])
    assert traced.stats.checked_replays >= 3
