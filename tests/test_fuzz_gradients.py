"""Fuzzer: training steps that leave gradients in different ways, traced in checked replay and
with `without_host` (`backend="aten"`, so everything is compared bit for bit) against eager over
several calls.

A step draws where `zero_grad()` runs (at the start, at the end, never, or only on calls that
step, chosen by a bool keyword as in gradient accumulation), whether it sets the gradients to
None, whether the model and optimizer are keyword arguments or in the step's closure, and the
optimizer. After every call the loss, every parameter, gradient and optimizer state must equal
eager's; at the end, every gradient tensor the caller kept from an earlier call must still hold
what eager's held (a gradient a call made is a new tensor, as eager's backward makes one).

CI runs a fixed sample (derandomize); TRACEJIT_FUZZ_EXAMPLES=n runs n programs."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import assert_same_state, make_optimizer

import tracejit

CALLS = 6
EXAMPLES = int(os.environ.get("TRACEJIT_FUZZ_EXAMPLES", "30"))
FUZZ = settings(max_examples=EXAMPLES, derandomize="TRACEJIT_FUZZ_EXAMPLES" not in os.environ, deadline=None,
                database=None, suppress_health_check=list(HealthCheck))


@st.composite
def steps(draw) -> dict:
    return {"zero": draw(st.sampled_from(["start", "end", "never", "when_stepping"])),
            "set_to_none": draw(st.booleans()),
            "reached": draw(st.sampled_from(["keyword", "closure"])),
            "optimizer": draw(st.sampled_from(["sgd_momentum", "adam_fused"])),
            "without_host": draw(st.booleans()),
            "width": draw(st.sampled_from([3, 5]))}


def make_step(program: dict):
    zero, set_to_none = program["zero"], program["set_to_none"]

    def step(x, y, model, opt, do_step):
        if zero == "start" or (zero == "when_stepping" and do_step):
            opt.zero_grad(set_to_none=set_to_none)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if do_step:
            opt.step()
        if zero == "end":
            opt.zero_grad(set_to_none=set_to_none)
        return loss
    return step


def pair(program: dict):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, program["width"]), nn.ReLU(), nn.Linear(program["width"], 2))
    twin = nn.Sequential(nn.Linear(4, program["width"]), nn.ReLU(), nn.Linear(program["width"], 2))
    twin.load_state_dict(model.state_dict())
    return ((model, make_optimizer(program["optimizer"], model.parameters())),
            (twin, make_optimizer(program["optimizer"], twin.parameters())))


@FUZZ
@given(program=steps())
def test_gradients_left_by_a_step_match_eager(program):
    step = make_step(program)
    (model_a, opt_a), (model_b, opt_b) = pair(program)
    options = {"backend": "aten", "without_host": program["without_host"]}
    if program["reached"] == "keyword":
        traced = tracejit.trace(lambda x, y, *, model, opt, do_step: step(x, y, model, opt, do_step), **options)
        call = lambda x, y, do_step: traced(x, y, model=model_b, opt=opt_b, do_step=do_step)  # noqa: E731
    else:
        traced = tracejit.trace(lambda x, y, *, do_step: step(x, y, model_b, opt_b, do_step), **options)
        call = lambda x, y, do_step: traced(x, y, do_step=do_step)  # noqa: E731
    kept_a, kept_b = [], []
    generator = torch.Generator().manual_seed(1)
    for i in range(CALLS):
        x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)
        do_step = program["zero"] != "when_stepping" or i % 2 == 1
        want = step(x, y, model_a, opt_a, do_step)
        got = call(x, y, do_step)
        assert torch.equal(got, want), (program, i)
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
        kept_a.append([p.grad for p in model_a.parameters()])
        kept_b.append([p.grad for p in model_b.parameters()])
    for i, (grads_a, grads_b) in enumerate(zip(kept_a, kept_b)):
        for a, b in zip(grads_a, grads_b, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (program, i)
    stats = traced.stats
    assert stats.checked_replays + stats.host_free_calls >= 2, (program, stats)  # the JIT ran later calls
