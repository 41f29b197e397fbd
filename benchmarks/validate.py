"""Validation before timing: a system's results must equal eager's over several steps.

Both run STEPS calls from identical, seeded cases (the RNG reseeded too, so dropout draws the same
masks); then every returned tensor of every step and every tensor the steps changed (parameters,
gradients, buffers, optimizer state) is compared. Systems that run eager's aten ops unfused must
match bit for bit; compiled ones within TOLERANCE, elementwise as in torch.allclose. The tolerance
is set by Adam, not by the compilers: Adam divides by sqrt(v), so where a gradient is near zero a
reordered float sum (a fused BatchNorm, LayerNorm or softmax) moves that element's update by up to
lr = 1e-3 per step; five steps of torch.compile differ from eager by up to ~3e-5 in parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .workloads import Case

STEPS = 5  # enough for tracejit to record, re-record lazy optimizer state, and replay host-free twice
RNG_SEED = 1234
TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}


@dataclass(frozen=True)
class Outcome:
    outputs: list[torch.Tensor]  # every tensor returned, step by step
    state: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Verdict:
    ok: bool
    text: str  # "bitwise", "max abs diff 3.1e-07", or what failed


def run_steps(call: Callable[[], Any], case: Case) -> Outcome:
    torch.manual_seed(RNG_SEED)
    outputs = []
    for _ in range(STEPS):
        outputs += [t.detach().clone() for t in _tensors(call())]
    return Outcome(outputs, {name: t.detach().clone() for name, t in case.state().items()})


def compare(reference: Outcome, got: Outcome, exact: bool) -> Verdict:
    if len(reference.outputs) != len(got.outputs):
        return Verdict(False, f"returned {len(got.outputs)} tensors over {STEPS} steps, eager {len(reference.outputs)}")
    if reference.state.keys() != got.state.keys():
        return Verdict(False, f"changed state {sorted(got.state)}, eager {sorted(reference.state)}")
    pairs = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(reference.outputs, got.outputs))]
    pairs += [(name, reference.state[name], got.state[name]) for name in reference.state]
    worst = 0.0
    for name, a, b in pairs:
        if a.shape != b.shape or a.dtype != b.dtype:
            return Verdict(False, f"{name}: {b.dtype}{list(b.shape)}, eager {a.dtype}{list(a.shape)}")
        if torch.equal(a, b):
            continue
        diff = (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item()
        if exact:
            return Verdict(False, f"{name} not bitwise equal (max abs diff {diff:.2g})")
        if not torch.allclose(b, a, equal_nan=True, **TOLERANCE):
            return Verdict(False, f"{name}: max abs diff {diff:.2g} beyond rtol={TOLERANCE['rtol']:g}, "
                                  f"atol={TOLERANCE['atol']:g}")
        worst = max(worst, diff)
    return Verdict(True, "bitwise" if worst == 0 else f"max abs diff {worst:.1g}")


def _tensors(result: Any) -> list[torch.Tensor]:
    if result is None:
        return []
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for item in result for t in _tensors(item)]
    if isinstance(result, dict):
        return [t for key in sorted(result) for t in _tensors(result[key])]
    raise TypeError(f"a step returned {type(result).__name__}; expected tensors, containers of them, or None")
