"""Fuzzer: sequences of changes a user makes between calls of a traced training step, applied to
an eager twin and to the traced model alike, in checked replay and `without_host`
(`backend="aten"`: every value is compared bit for bit).

A program draws how the step reaches its model and optimizer (keyword, closure, a helper
function), the mode, and a schedule: before some calls, one or two changes from a catalogue
(settings of modules and of the optimizer, train/eval, hooks added and removed, a parameterless
layer swapped for another, the first layer frozen or unfrozen). After every call the loss, parameters, gradients, buffers and
optimizer state must equal eager's, or the call raises `TraceMismatchError` /
`HostDependencyError` having updated no parameter; after such an error the program ends.

CI runs a fixed sample (derandomize); TRACEJIT_FUZZ_EXAMPLES=n runs n programs."""

from __future__ import annotations

import copy
import functools
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import assert_same_state, closure_mse_step, helper_mse_step, mse_step
from torch import nn

import tracejit
from tracejit.errors import HostDependencyError, TraceMismatchError

CALLS = 8
EXAMPLES = int(os.environ.get("TRACEJIT_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, derandomize="TRACEJIT_FUZZ_EXAMPLES" not in os.environ, deadline=None,
                database=None, suppress_health_check=list(HealthCheck))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(0.1), nn.BatchNorm1d(8), nn.Linear(8, 3))


def _scaled(factor):
    def hook(module, inputs, output):
        return output * factor
    return hook


def _add_hook(model, opt, handles, factor):
    handles.append(model[0].register_forward_hook(_scaled(factor)))


def _remove_hooks(model, opt, handles, _):
    while handles:
        handles.pop().remove()


def _swap_activation(model, opt, handles, kind):
    model[1] = {"tanh": nn.Tanh(), "relu": nn.ReLU(), "leaky": nn.LeakyReLU(0.1)}[kind]


def _set(target, name):
    def change(model, opt, handles, value):
        obj = target(model, opt)
        if isinstance(obj, dict):
            obj[name] = value
        else:
            setattr(obj, name, value)
    return change


def _train_mode(model, opt, handles, training):
    model.train(training)


def _freeze_first_layer(model, opt, handles, frozen):
    model[0].requires_grad_(not frozen)


# name -> (change(model, opt, hook handles, value), the values it draws from)
CHANGES = {
    "lr": (_set(lambda m, o: o.param_groups[0], "lr"), [0.1, 0.05, 0.0, 0.2]),
    "momentum": (_set(lambda m, o: o.param_groups[0], "momentum"), [0.9, 0.5, 0.0]),
    "weight_decay": (_set(lambda m, o: o.param_groups[0], "weight_decay"), [0.0, 1e-2]),
    "negative_slope": (_set(lambda m, o: m[1], "negative_slope"), [0.1, 0.3]),
    "bn_momentum": (_set(lambda m, o: m[2], "momentum"), [0.1, 0.5, None]),
    "train": (_train_mode, [True, False]),
    "hook": (_add_hook, [1.0, 2.0]),
    "remove_hooks": (_remove_hooks, [None]),
    "swap": (_swap_activation, ["tanh", "relu", "leaky"]),
    "freeze": (_freeze_first_layer, [True, False]),
}


@st.composite
def programs(draw) -> dict:
    schedule = {}
    for call in range(2, CALLS):
        if draw(st.booleans()):
            names = draw(st.lists(st.sampled_from(sorted(CHANGES)), min_size=1, max_size=2))
            schedule[call] = [(name, draw(st.sampled_from(CHANGES[name][1]))) for name in names]
    return {"reach": draw(st.sampled_from(["keyword", "closure", "helper"])),
            "without_host": draw(st.booleans()), "schedule": schedule}


@FUZZ
@given(programs())
def test_changes_between_calls_follow_eager_or_raise(program):
    eager_model = _model()
    traced_model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1, momentum=0.9)
    traced_opt = torch.optim.SGD(traced_model.parameters(), lr=0.1, momentum=0.9)
    options = {"backend": "aten", "without_host": program["without_host"]}
    if program["reach"] == "keyword":
        eager_step = functools.partial(mse_step, model=eager_model, opt=eager_opt)
        traced = tracejit.trace(mse_step, **options)
        traced_step = functools.partial(traced, model=traced_model, opt=traced_opt)
    else:
        make = closure_mse_step if program["reach"] == "closure" else helper_mse_step
        eager_step = make(eager_model, eager_opt)
        traced = traced_step = tracejit.trace(make(traced_model, traced_opt), **options)
    handles: dict[str, list] = {"eager": [], "traced": []}
    torch.manual_seed(1)
    data = [(torch.randn(5, 6), torch.randn(5, 3)) for _ in range(CALLS)]
    for call, (x, y) in enumerate(data):
        for name, value in program["schedule"].get(call, []):
            change = CHANGES[name][0]
            change(eager_model, eager_opt, handles["eager"], value)
            change(traced_model, traced_opt, handles["traced"], value)
        before = [p.detach().clone() for p in traced_model.parameters()]
        expected = eager_step(x, y)
        try:
            got = traced_step(x, y)
        except (TraceMismatchError, HostDependencyError):
            assert any(c <= call for c in program["schedule"]), "raised with nothing changed"
            assert all(torch.equal(a, b) for a, b in zip(before, traced_model.parameters())), "updated, then raised"
            return
        assert torch.equal(got, expected), call
        assert_same_state(eager_model, eager_opt, traced_model, traced_opt)
    stats = traced.stats
    assert stats.records >= 1 and stats.calls == CALLS
