"""Fuzzer: where a traced function leaves a tensor it made (a global dict entry, a global module's
attribute, a keyword object's attribute, a list it appends to, an attribute five objects deep, a
closure's dict) and what that tensor is (a view of the input, a view of the returned tensor, a new
tensor, a detached copy of the returned one), with or without the caller keeping each call's
value, in checked replay and without the host.

After every call the place holds this call's value, every value the caller kept holds its own
call's, and no earlier input or returned tensor has changed: eager makes a new tensor on every
call. Host-free calls once wrote the new value into the tensor the last call left.

CI runs a fixed sample (derandomize); TRACEJIT_FUZZ_EXAMPLES=n runs n programs."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import tracejit

CALLS = 6
EXAMPLES = int(os.environ.get("TRACEJIT_FUZZ_EXAMPLES", "30"))
FUZZ = settings(max_examples=EXAMPLES, derandomize="TRACEJIT_FUZZ_EXAMPLES" not in os.environ, deadline=None,
                database=None, suppress_health_check=list(HealthCheck))

_DICT: dict = {}
_MODULE = nn.Module()
_LIST: list = []
VALUES = ("view of input", "view of output", "new", "detached output")


def _value(x: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "view of input":
        return x[1:]
    if kind == "view of output":
        return y[1:]
    return x.sum() * 2 if kind == "new" else y.detach()


def _deep(depth: int) -> SimpleNamespace:
    return SimpleNamespace(inner=_deep(depth - 1) if depth > 1 else None, last=None)


def _program(holder: str, kind: str):
    """(the step, what it reads the place with, its keywords): the place is named in the step
    itself, as users write it (globals and closures are found through the step's own code)."""
    store: dict = {}
    box = _deep(5)
    if holder == "global dict":
        def step(x):
            y = x * 2
            _DICT["last"] = _value(x, y, kind)
            return y
        return step, lambda: _DICT["last"], {}
    if holder == "global module":
        def step(x):
            y = x * 2
            _MODULE.last = _value(x, y, kind)
            return y
        return step, lambda: _MODULE.last, {}
    if holder == "keyword object":
        def step(x, *, box):
            y = x * 2
            box.last = _value(x, y, kind)
            return y
        return step, lambda: box.last, {"box": box}
    if holder == "list":
        def step(x):
            y = x * 2
            _LIST.append(_value(x, y, kind))
            return y
        return step, lambda: _LIST[-1], {}
    if holder == "deep":
        def step(x, *, box):
            y = x * 2
            box.inner.inner.inner.inner.last = _value(x, y, kind)
            return y
        return step, lambda: box.inner.inner.inner.inner.last, {"box": box}

    def step(x):
        y = x * 2
        store["last"] = _value(x, y, kind)
        return y
    return step, lambda: store["last"], {}


@FUZZ
@given(holder=st.sampled_from(["global dict", "global module", "keyword object", "list", "deep", "closure dict"]),
       kind=st.sampled_from(VALUES), without_host=st.booleans(), keep=st.booleans())
def test_a_tensor_left_in_python_state_is_new_on_every_call(holder, kind, without_host, keep):
    _DICT.clear()
    _LIST.clear()
    step, read, kwargs = _program(holder, kind)
    traced = tracejit.trace(step, without_host=without_host)
    inputs, outputs, kept = [], [], []
    for i in range(CALLS):
        x = torch.arange(4.0) + 10 * i
        inputs.append(x)
        outputs.append(traced(x, **kwargs))
        want = _value(x.clone(), x.clone() * 2, kind)
        assert torch.equal(read(), want), (i, read(), want)
        if keep:
            kept.append((read(), want))
    for i, (x, y) in enumerate(zip(inputs, outputs)):
        assert torch.equal(x, torch.arange(4.0) + 10 * i), f"input {i} changed: {x}"
        assert torch.equal(y, x * 2), f"output {i} changed: {y}"
    for i, (held, want) in enumerate(kept):
        assert torch.equal(held, want), f"the value kept from call {i} changed: {held} against {want}"
    if holder == "list":
        assert len(_LIST) == CALLS
    stats = traced.stats
    assert stats.records + stats.rerecords < stats.calls  # replayed, with or without the function
