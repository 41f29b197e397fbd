"""Fuzzer: random elementwise programs (tests/fuzz_programs.py) over every dtype, with broadcasting,
strided and expanded inputs, casts, true and rounding division, rounding, `clamp` with tensor
bounds, in-place updates and special values, traced with the fused C backend (checked replay and
`without_host`) and the Triton backend (in Triton's interpreter), against eager on this machine
over several calls: every output and every input updated in place, exactly for exact ops, within a
per-dtype tolerance for transcendental functions.

CI runs a fixed sample (derandomize); TRACEJIT_FUZZ_EXAMPLES=n runs n programs."""

from __future__ import annotations

import os

import torch
import triton_support as ts
from fuzz_programs import Program, make_inputs, mismatch, programs
from hypothesis import HealthCheck, event, given, settings
from torch.utils._python_dispatch import TorchDispatchMode

import tracejit
from tracejit.ir import Op

CALLS = 3
EXAMPLES = int(os.environ.get("TRACEJIT_FUZZ_EXAMPLES", "30"))
FUZZ = settings(max_examples=EXAMPLES, derandomize="TRACEJIT_FUZZ_EXAMPLES" not in os.environ, deadline=None,
                database=None, suppress_health_check=list(HealthCheck))
MODES = {
    "c": dict(backend="c"),
    "c_without_host": dict(backend="c", without_host=True),
    # nothing fused: every op through the program's out= bindings (clamp with tensor bounds crashed there)
    "aten_without_host": dict(backend="aten", without_host=True),
    "triton": dict(backend="triton"),
    "triton_without_host": dict(backend="triton", without_host=True),
}
# the Triton kernels of this many fuzzed programs are also built for sm_80 and sm_90 (~1 s each)
AOT_SAMPLE = max(4, EXAMPLES // 20)
_built: list[str] = []  # sources of the kernels built so far

class SecondOnTies(TorchDispatchMode):
    """Eager with `maximum`, `minimum` and tensor-bound `clamp` giving the second operand for equal
    operands (+0.0 and -0.0) everywhere, as eager's vectorized loops and the fused kernels do;
    eager's scalar loops (a strided operand, a row's tail) give the first."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func in (aten.maximum.default, aten.minimum.default):
            return _pick(func is aten.maximum.default, *args)
        bounds = {aten.clamp.Tensor: ("min", "max"), aten.clamp_.Tensor: ("min", "max"),
                  aten.clamp_min.Tensor: ("min",), aten.clamp_min_.Tensor: ("min",),
                  aten.clamp_max.Tensor: ("max",), aten.clamp_max_.Tensor: ("max",)}.get(func)
        if bounds is None:
            return func(*args, **kwargs)
        named = dict(zip(bounds, args[1:]), **kwargs)
        result = args[0]
        for name in ("min", "max"):
            if named.get(name) is not None:
                result = _pick(name == "min", result, named[name])
        if func._schema.name.endswith("_"):  # in place
            return args[0].copy_(result)
        return result.to(func(*args, **kwargs).dtype)


def _pick(larger: bool, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dtype = torch.result_type(a, b)
    a, b = a.to(dtype), b.to(dtype)
    chosen = torch.where(a > b if larger else a < b, a, b)
    return torch.where(a.isnan(), a, torch.where(b.isnan(), b, chosen)) if dtype.is_floating_point else chosen


def run_eager(program: Program, call: int, fixed_k: bool = False) -> list[torch.Tensor]:
    *inputs, k = make_inputs(program, call)
    outputs = program.function(*inputs, k=make_inputs(program, 0)[-1] if fixed_k else k)
    return [*outputs, *(inputs[i] for i in program.mutated)]


def run_traced(traced, program: Program, call: int, fixed_k: bool = False) -> list[torch.Tensor]:
    *inputs, k = make_inputs(program, call)
    outputs = traced(*inputs, k=make_inputs(program, 0)[-1] if fixed_k else k)
    return [*outputs, *(inputs[i] for i in program.mutated)]


def check_mode(program: Program, mode: str) -> None:
    traced = tracejit.trace(program.function, **MODES[mode])
    names = [*program.outputs, *(f"v{i} (updated in place)" for i in program.mutated)]
    # Without the host a keyword number is guarded by value (a new one runs the function): it stays
    # the first call's, so that the later calls are served by the host-free program itself.
    host_free = MODES[mode].get("without_host", False)
    returned = []  # (call, what it returned, a copy of eager's): nothing returned may change afterwards
    for call in range(CALLS):
        got, want = run_traced(traced, program, call, host_free), run_eager(program, call, host_free)
        if program.has_ties:
            with SecondOnTies():
                other = run_eager(program, call, host_free)
        for k, (name, g, w) in enumerate(zip(names, got, want, strict=True)):
            problem = mismatch(g, w, exact=name not in program.inexact,
                               other=other[k] if program.has_ties else None)
            assert problem is None, f"{mode}, call {call + 1}, {name}: {problem}\n{program!r}"
        returned += [(call, name, g, g.clone()) for name, g in zip(program.outputs, got)]
    for call, name, g, copy in returned:
        assert torch.equal(g, copy) or (g.is_floating_point() and torch.allclose(g, copy, equal_nan=True, rtol=0, atol=0)), (
            f"{mode}: {name} returned by call {call + 1} changed later\n{program!r}")
    stats = traced.stats
    assert stats.records == 1 and stats.replays == CALLS - 1, f"{mode}: the JIT did not replay: {stats}"
    if host_free:
        assert stats.host_free_calls == CALLS - 1, f"{mode}: the host-free program did not serve the calls: {stats}"
    fused = sum(n.op is Op.FUSED for e in traced._entries() for n in e.serving_program.graph.nodes)
    event(f"{mode}: {'fused' if fused else 'no fused kernel'}")
    if mode == "triton" and len(_built) < AOT_SAMPLE:
        build_for_cuda(traced)


def build_for_cuda(traced) -> None:
    """Build the trace's Triton kernels offline for sm_80 and sm_90 (no approximate division or
    square root in the PTX); see tests/test_triton_aot.py."""
    kernels = [launcher.kernel for _, launcher in ts.fused_kernels(traced) if hasattr(launcher, "kernel")]
    for kernel in kernels:
        if kernel.source not in _built:
            problems = ts.compile_for_targets(kernel)
            assert not problems, "\n\n".join(problems)
            _built.append(kernel.source)


@FUZZ
@given(program=programs())
def test_fuzzed_programs_match_eager(program):
    for mode in ("c", "c_without_host", "aten_without_host"):
        check_mode(program, mode)
    with ts.interpreter():
        check_mode(program, "triton")
        check_mode(program, "triton_without_host")
