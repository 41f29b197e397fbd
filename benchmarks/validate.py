"""Validation before timing: a system's results must equal eager's over several steps.

Both run STEPS calls from identical, seeded cases (the RNG reseeded too, so dropout draws the same
masks); then every returned tensor of every step and every tensor the steps changed (parameters,
gradients, buffers, optimizer state) is compared. Systems that run eager's aten ops unfused must
match bit for bit. For the others, returned tensors (losses, outputs) must be elementwise close
(OUTPUT_TOLERANCE, as in torch.allclose) at every step, and each state tensor close in norm:
|got - eager| / |eager| <= STATE_TOLERANCE. The state bound is loose because of Adam, not of the
compilers: Adam divides by sqrt(v), so a reordered float sum (fused BatchNorm, LayerNorm, softmax)
that flips the sign of a near-zero gradient moves that element by up to 2 * lr per step, and a
BatchNorm network carries the difference on: after five steps torch.compile's cnn_train state is
within a few percent of eager's in norm while its losses agree to 1e-5. A broken step (skipped or
wrong update) shows in the losses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .workloads import Case

STEPS = 5  # enough for tracejit to record, re-record lazy optimizer state, and replay host-free twice
RNG_SEED = 1234
OUTPUT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
STATE_TOLERANCE = 0.1


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
    worst_output, worst_state = 0.0, 0.0
    for name, a, b in pairs:
        if a.shape != b.shape or a.dtype != b.dtype:
            return Verdict(False, f"{name}: {b.dtype}{list(b.shape)}, eager {a.dtype}{list(a.shape)}")
        if torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and
                                 torch.equal(a.nan_to_num(), b.nan_to_num())):
            continue
        if exact:
            return Verdict(False, f"{name} not bitwise equal (max abs diff {_max_abs(a, b):.2g})")
        if name.startswith("output"):
            if not torch.allclose(b, a, equal_nan=True, **OUTPUT_TOLERANCE):
                return Verdict(False, f"{name}: max abs diff {_max_abs(a, b):.2g} beyond "
                                      f"rtol={OUTPUT_TOLERANCE['rtol']:g}, atol={OUTPUT_TOLERANCE['atol']:g}")
            worst_output = max(worst_output, _max_abs(a, b))
        else:
            relative = _relative(a, b)
            if not relative <= STATE_TOLERANCE:
                return Verdict(False, f"{name}: relative difference {relative:.2g} in norm, beyond {STATE_TOLERANCE:g}")
            worst_state = max(worst_state, relative)
    if worst_output == worst_state == 0:
        return Verdict(True, "bitwise")
    parts = [f"outputs max abs diff {worst_output:.1g}"] if worst_output else ["outputs bitwise"]
    if reference.state:
        parts.append(f"state {worst_state:.1g} in norm" if worst_state else "state bitwise")
    return Verdict(True, "; ".join(parts))


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise difference; NaN in both counts as equal, NaN in one as infinitely far."""
    diff = (a.double() - b.double()).abs()
    diff = torch.where(a.isnan() & b.isnan(), 0.0, diff) if a.is_floating_point() else diff
    return diff.nan_to_num(nan=float("inf")).max().item() if diff.numel() else 0.0


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / a.norm().clamp_min(1e-30)).nan_to_num(nan=float("inf")).item()


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
