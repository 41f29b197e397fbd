"""Fuzzer: Python numbers that change between calls and feed the computation before `backward()`,
in checked replay (`backend="aten"`: every value is compared bit for bit with an eager twin).

The API level passes a number of a forward `mul` or `div` to the program together with its
MulBackward0/DivBackward0 copies once it has seen them change together (runtime/api_replay.py
`_backward_links`); every other number before backward is matched exactly. An adversarial review
found schedules under which a transformed backward number (PowBackward's `k - 1`, LerpBackward's
`1 - w`) moved exactly as a loss weight did and was taken for it: silently wrong gradients. This
draws programs of such terms and schedules built to make such coincidences likely (milestones of
round values, one number defined from another on the first calls).

CI runs a fixed sample (derandomize); TRACEJIT_FUZZ_EXAMPLES=n runs n programs."""

from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from models import assert_same_state
from torch import nn

import tracejit

CALLS = 8
EXAMPLES = int(os.environ.get("TRACEJIT_FUZZ_EXAMPLES", "20"))
FUZZ = settings(max_examples=EXAMPLES, derandomize="TRACEJIT_FUZZ_EXAMPLES" not in os.environ, deadline=None,
                database=None, suppress_health_check=list(HealthCheck))

# term name -> the loss term, given the model output and the term's number
TERMS = {
    "weight": lambda out, k: out.pow(2).mean() * k,
    "divided": lambda out, k: out.abs().mean() / (k + 2.0),
    "power": lambda out, k: (out.abs() + 1).pow(k + 1.0).mean(),
    "lerp": lambda out, k: torch.lerp(out, out.tanh(), k / 4).pow(2).mean(),
    "slope": lambda out, k: F.leaky_relu(out, k / 8).mean(),
    "clamped": lambda out, k: out.clamp(min=-k - 0.5, max=k + 0.5).pow(2).mean(),
    "added": lambda out, k: out.add(out.tanh(), alpha=k + 0.3137).pow(2).mean(),  # never 1: no multiply there
}
# how a number moves over the calls (call index -> value): round values make coincidences likely
SCHEDULES = {
    "constant": lambda i, seed: 1.0,
    "every_call": lambda i, seed: 0.5 + 0.25 * i,
    "milestones": lambda i, seed: 1.0 if i < 3 else 2.0 if i < 6 else 3.0,
    "late_milestone": lambda i, seed: 2.0 if i < 5 else 3.0,
    "warm_up": lambda i, seed: min(1.0, i / 4),
    "halving": lambda i, seed: 2.0 ** -(i // 2),
    "random": lambda i, seed: round(((seed * 7919 + i * 104729) % 1000) / 250, 2),
}


def _step(x, *, model, opt, numbers, terms):
    out = model(x)
    loss = out.sum() * 0.0
    for term, k in zip(terms, numbers):
        loss = loss + TERMS[term](out, k)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@FUZZ
# the coincidences the review found: a power's `k - 1` and a lerp's `1 - w` moving as a loss weight did
@example(terms=["weight", "power"], schedules=["every_call", "milestones", "random"], seed=3, tied=True)
@example(terms=["lerp", "weight"], schedules=["milestones", "every_call", "halving"], seed=5, tied=True)
@example(terms=["power", "divided", "weight"], schedules=["warm_up", "halving", "late_milestone"], seed=7, tied=True)
@given(terms=st.lists(st.sampled_from(list(TERMS)), min_size=1, max_size=3),
       schedules=st.lists(st.sampled_from(list(SCHEDULES)), min_size=3, max_size=3),
       seed=st.integers(0, 1000), tied=st.booleans())
def test_changing_numbers_before_backward_train_as_eager(terms, schedules, seed, tied):
    torch.manual_seed(seed)
    model_a = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model_b = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model_b.load_state_dict(model_a.state_dict())
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (model_a, model_b))
    traced = tracejit.trace(_step, backend="aten")
    generator = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracejit.ReplayLevelWarning)
        for i in range(CALLS):
            numbers = [SCHEDULES[name](i, seed) for name in schedules[:len(terms)]]
            if tied and i < 3:  # every term's number equal to the first's on the calls the program is built from
                numbers = [numbers[0]] * len(numbers)
            x = torch.randn(5, 6, generator=generator)
            want = _step(x, model=model_a, opt=opt_a, numbers=numbers, terms=terms)
            got = traced(x, model=model_b, opt=opt_b, numbers=numbers, terms=terms)
            assert torch.equal(got, want), (i, terms, numbers)
            assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    assert traced.stats.checked_replays + traced.stats.rerecords >= CALLS - 2
