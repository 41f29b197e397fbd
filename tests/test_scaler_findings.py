"""torch.amp.GradScaler configurations found by the DDP/AMP hunt (stop note of 2026-11-28).

Each test failed before its fix.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit


def _scaled_step(x, y, *, model, opt, scaler):
    loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    return loss.detach()


GLOBAL_SCALER = None


def _step_with_global_scaler(x, y, *, model, opt):
    return _scaled_step(x, y, model=model, opt=opt, scaler=GLOBAL_SCALER)


@pytest.mark.parametrize("how", ["keyword", "global"])
@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_a_disabled_grad_scaler_trains_like_eager(without_host, how):
    """`GradScaler("cpu", enabled=False)` (AMP switched off by a config flag) keeps no per-optimizer
    state: the second call raised AttributeError `_per_optimizer_states` (saving the scalers' stages)
    in both modes, and the host-free guard read settings a disabled scaler does not have."""
    global GLOBAL_SCALER
    torch.manual_seed(0)
    eager_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_scaler, scaler = (torch.amp.GradScaler("cpu", enabled=False) for _ in range(2))
    if how == "keyword":
        traced = tracejit.trace(_scaled_step, backend="aten", without_host=without_host)
        extra = {"scaler": scaler}
    else:
        traced = tracejit.trace(_step_with_global_scaler, backend="aten", without_host=without_host)
        GLOBAL_SCALER, extra = scaler, {}
    generator = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
        want = _scaled_step(x, y, model=eager_model, opt=eager_opt, scaler=eager_scaler)
        got = traced(x, y, model=model, opt=opt, **extra)
        assert torch.equal(got, want)
        assert all(map(torch.equal, model.parameters(), eager_model.parameters()))
    fast = traced.stats.host_free_calls if without_host else traced.stats.api_replays
    assert fast >= 3, traced.stats


def _optimizer_step(*, opt, scaler):
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def test_an_overflow_with_found_inf_made_outside_the_call_names_the_cause():
    """`scaler.unscale_(opt)` (and clipping) before the traced call, `scaler.step`/`update` inside:
    the inf check reads a found_inf from outside the trace, which the record cannot branch on. The
    overflow step raised TraceMismatchError naming only `_amp_update_scale_` against `mul_`; it now
    says which read decided it and what to do."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    traced = tracejit.trace(_optimizer_step, backend="aten")
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        x, y = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
        if step == 5:
            x[0, 0] = float("nan")
        scaler.scale(F.cross_entropy(model(x), y)).backward()
        scaler.unscale_(opt)
        if step < 5:
            traced(opt=opt, scaler=scaler)
    with pytest.raises(tracejit.TraceMismatchError, match=r"(?s)_amp_update_scale_.*found_inf made outside the "
                                                          r"traced call.*Call `scaler.unscale_` inside"):
        traced(opt=opt, scaler=scaler)
