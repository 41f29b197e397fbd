"""The systems compared in every table: how each one turns a Case into a zero-argument call.

`prepare` raises NotApplicable, with the reason the table prints, when a system cannot run a
workload on this machine at all. A tracejit combination refused later, on a call (a
HostDependencyError, or a backend that is not implemented yet), is reported as n/a by the suite.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import tracejit

from .workloads import Case, Workload

Call = Callable[[], Any]


class NotApplicable(Exception):
    """The system does not apply to this workload here; the message says why."""


@dataclass(frozen=True)
class System:
    key: str  # the name --systems takes
    label: str  # the name tables print
    exact: bool  # expected bitwise equal to eager; otherwise within the suite's tolerance
    prepare: Callable[[Workload, Case], Call]
    first_call: bool = True  # measure its cold first call in a fresh subprocess
    applies: Callable[[Workload], bool] = lambda workload: True  # False: not even a row in its table


def configure_compile() -> None:
    """Inductor draws random numbers through aten's generator, as eager does, so the dropout masks
    of cnn_train match and torch.compile can be validated; only random ops are affected."""
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True


def _eager(workload: Workload, case: Case) -> Call:
    return lambda: case.function(*case.args, **case.kwargs)


def _compile(workload: Workload, case: Case) -> Call:
    compiled = torch.compile(case.function)
    return lambda: compiled(*case.args, **case.kwargs)


def _compile_reduce_overhead(workload: Workload, case: Case) -> Call:
    if not torch.cuda.is_available():
        raise NotApplicable("mode='reduce-overhead' adds CUDA graphs; inductor skips them for CPU tensors, "
                            "so on CPU it is the default mode")
    compiled = torch.compile(case.function, mode="reduce-overhead")
    return lambda: compiled(*case.args, **case.kwargs)


def _jit_trace(workload: Workload, case: Case) -> Call:
    if case.module is None:
        raise NotApplicable("torch.jit.trace captures a forward pass: no backward, no optimizer step")
    with torch.no_grad():
        traced = torch.jit.trace(case.module.eval(), case.args)
    # freeze inlines the parameters as constants, so calls need no torch.no_grad()
    frozen = torch.jit.optimize_for_inference(torch.jit.freeze(traced))
    return lambda: frozen(*case.args)


def _tracejit(replay: str = "api", **options: Any) -> Callable[[Workload, Case], Call]:
    def prepare(workload: Workload, case: Case) -> Call:
        if options.get("backend") == "triton" and not torch.cuda.is_available():
            raise NotApplicable("backend='triton' fuses CUDA tensors; no GPU here")
        previous = os.environ.get("TRACEJIT_REPLAY")
        os.environ["TRACEJIT_REPLAY"] = replay  # read when the trace is made
        try:
            traced = tracejit.trace(case.function, **options)
        except NotImplementedError as error:
            raise NotApplicable(f"NotImplementedError: {str(error).splitlines()[0]}") from error
        finally:
            if previous is None:
                del os.environ["TRACEJIT_REPLAY"]
            else:
                os.environ["TRACEJIT_REPLAY"] = previous
        return lambda: traced(*case.args, **case.kwargs)
    return prepare


def _tracejit_recording(workload: Workload, case: Case) -> Call:
    """Every call records afresh: what a first call costs once the process is warm (issue 2)."""
    return lambda: tracejit.trace(case.function)(*case.args, **case.kwargs)


SYSTEMS: dict[str, System] = {s.key: s for s in [
    System("eager", "eager", True, _eager),
    System("compile", "torch.compile (inductor)", False, _compile),
    System("compile-ro", "torch.compile reduce-overhead", False, _compile_reduce_overhead),
    System("jit-trace", "jit.trace+freeze+optimize_for_inference", False, _jit_trace),
    # backend "auto" fuses once a fused-kernel backend exists, so only backend=aten is held to bitwise
    System("tj-checked", "tracejit checked replay", False, _tracejit()),
    System("tj-checked-aten", "tracejit checked replay at the aten level", False, _tracejit(replay="aten")),
    System("tj-host-free", "tracejit without_host", False, _tracejit(without_host=True)),
    System("tj-aten", "tracejit without_host, backend=aten", True, _tracejit(without_host=True, backend="aten")),
    System("tj-c", "tracejit without_host, backend=c", False, _tracejit(without_host=True, backend="c")),
    System("tj-c-reduce", "tracejit without_host, backend=c, jit_fuse_reduce", False,
           _tracejit(without_host=True, backend="c",
                     graph_opt_config=tracejit.GraphOptimizationConfig(jit_fuse_reduce=True))),
    System("tj-c-graph-opt", "tracejit without_host, backend=c, jit_fuse_reduce + jit_fuse_dimshuffle", False,
           _tracejit(without_host=True, backend="c",
                     graph_opt_config=tracejit.GraphOptimizationConfig(jit_fuse_reduce=True,
                                                                       jit_fuse_dimshuffle=True))),
    System("tj-c-checked", "tracejit checked replay, backend=c", False, _tracejit(backend="c")),
    System("tj-triton", "tracejit without_host, backend=triton", False, _tracejit(without_host=True, backend="triton")),
    System("tj-record", "tracejit recording call (warm process)", True, _tracejit_recording, first_call=False,
           applies=lambda workload: workload.report_recording),
]}


def select(keys: str | None) -> list[System]:
    """Systems named by --systems (comma list of keys); eager is always included, as the reference."""
    if not keys:
        return list(SYSTEMS.values())
    names = [key.strip() for key in keys.split(",") if key.strip()]
    unknown = [name for name in names if name not in SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    return [SYSTEMS["eager"]] + [SYSTEMS[name] for name in names if name != "eager"]
