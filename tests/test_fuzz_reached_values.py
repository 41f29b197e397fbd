"""Fuzzer: values a traced function reaches outside its tensor arguments, changed between calls in
random order: a number it makes a tensor of (`y[mask] = s`, `torch.tensor(s)`) passed as a
keyword, a number in a global and in a closure cell (`x * SCALE`), and the batch it takes from a
global list (the same tensor, a new one, or the caller's own input).

Every call must give eager's result, in checked replay and without the host; without the host a
batch that is another tensor on each call may be refused with HostDependencyError (tracejit
cannot know which tensor the function would read), and a batch that is the call's input is a
divergence (TraceMismatchError): never a stale read. The first run of this fuzzer found host-free
calls reading `BATCHES[-1]` where the record found it, at index 0, after the caller appended. Host-free and API-level
calls once kept the recorded number (`y[mask] = s` gave [0.5, -1, 0.5] for s = 7) or the first
batch.

CI runs a fixed sample (derandomize); TRACEJIT_FUZZ_EXAMPLES=n runs n programs."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracejit

EXAMPLES = int(os.environ.get("TRACEJIT_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, derandomize="TRACEJIT_FUZZ_EXAMPLES" not in os.environ, deadline=None,
                database=None, suppress_health_check=list(HealthCheck))

SCALE = 1.0
BATCHES: list = []
CHANGES = ("nothing", "s", "scale", "factor", "new batch", "input as batch")


def _program():
    """(step, the closure's cell setter): the step reads all four kinds of value."""
    factor = [1.0]

    def make(value):
        factor[0] = value

    def step(x, *, s):
        y = x.clone()
        y[y.gt(0)] = s
        batch = BATCHES[-1]
        return (y + torch.tensor(s)) * SCALE * factor[0] + batch

    return step, make


@FUZZ
@given(changes=st.lists(st.sampled_from(CHANGES), min_size=6, max_size=10),
       values=st.lists(st.sampled_from([0.5, 2.0, -3.0, 7.0]), min_size=10, max_size=10),
       without_host=st.booleans())
def test_values_reached_outside_the_arguments_follow_their_changes(changes, values, without_host):
    global SCALE
    SCALE = 1.0
    BATCHES[:] = [torch.ones(4)]
    step, set_factor = _program()
    traced = tracejit.trace(step, backend="aten", without_host=without_host)
    x = torch.tensor([1.0, -1.0, 2.0, -2.0])
    s = 0.5
    for call, (change, value) in enumerate(zip(["nothing"] * 3 + changes, values + [0.5] * 3)):
        if change == "s":
            s = value
        elif change == "scale":
            SCALE = value
        elif change == "factor":
            set_factor(value)
        elif change == "new batch":
            BATCHES.append(torch.full((4,), value))
        elif change == "input as batch":
            BATCHES.append(x)
        expected = step(x, s=s)
        try:
            got = traced(x, s=s)
        except tracejit.HostDependencyError as error:
            assert without_host and "two calls reached two different tensors" in str(error), (call, change)
            return
        except tracejit.TraceMismatchError as error:  # the recorded distinct tensors are one now: a divergence
            assert "comes from a different producer" in str(error) and any(b is x for b in BATCHES), (call, change)
            return
        assert torch.equal(got, expected), (call, change, got, expected)
    SCALE = 1.0


@pytest.mark.parametrize("without_host", [False, True])
def test_the_fuzzed_program_is_served_fast_when_nothing_changes(without_host):
    """The fuzzer's program runs without the function (or at the API level) while nothing changes."""
    global SCALE
    SCALE = 1.0
    BATCHES[:] = [torch.ones(4)]
    step, _ = _program()
    traced = tracejit.trace(step, backend="aten", without_host=without_host)
    x = torch.tensor([1.0, -1.0, 2.0, -2.0])
    for _ in range(6):
        assert torch.equal(traced(x, s=0.5), step(x, s=0.5))
    assert (traced.stats.host_free_calls if without_host else traced.stats.api_replays) >= 3
