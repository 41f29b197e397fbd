"""Known bugs of without_host=True (runtime/hostfree.py, runtime/replay.py), found by the adversarial
programs of test_adversarial.py. Strict xfails: each starts failing the day its bug is fixed; then
drop the marker.
"""

import copy

import pytest
import torch
import torch.nn as nn
from side_by_side import mse, seeded, side_by_side, step_of

import tracejit


@pytest.mark.xfail(strict=True, reason="hostfree.find_lr_bindings matches the record's scalars against the current "
                   "lr when it rebinds; once a scheduler has changed lr, a rebind (after any guard failure) loses the "
                   "binding and later host-free calls use the recorded lr")
def test_without_host_lr_survives_a_rebind():
    model = nn.Linear(4, 2)
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    step = step_of(lambda model, x, flag: mse(model, x))
    traced = tracejit.trace(step, without_host=True)
    for i in range(6):
        x = torch.randn(3, 4)
        flag = i != 3  # another keyword value: the guard fails, the function runs and rebinds
        assert torch.equal(step(x, model=model, opt=opts[0], flag=flag), traced(x, model=twin, opt=opts[1], flag=flag))
        for opt in opts:
            opt.param_groups[0]["lr"] *= 0.5
    assert torch.equal(model.weight, twin.weight)


@pytest.mark.xfail(strict=True, reason="after a re-record (lazy momentum state), the matched prefix keeps the first "
                   "call's scalars, so hostfree.find_lr_bindings misses the lr of a group changed since then")
def test_without_host_lr_of_a_group_changed_before_the_re_record():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": model[2].parameters(), "lr": 0.01, "momentum": 0.5}])

    def between(i, objects):
        objects["opt"].param_groups[0]["lr"] = 0.1 / (i + 1)

    step = step_of(mse)
    side_by_side(tracejit.trace(step, without_host=True), step, {"model": model, "opt": opt}, seeded(5, 4), 5, between)
