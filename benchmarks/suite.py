"""One workload row: validate every system against eager, then time the validated ones together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import tracejit

from . import bandwidth, firstcall, protocol
from .systems import NotApplicable, System
from .validate import compare, run_steps
from .workloads import Workload

OK, NOT_APPLICABLE, FAILED = "ok", "n/a", "FAILED"


@dataclass
class SystemResult:
    key: str
    label: str
    status: str  # OK, NOT_APPLICABLE or FAILED
    detail: str  # the validation verdict, or why the system is n/a or failed
    timing: protocol.Timing | None = None
    first_call: dict | None = None

    def to_dict(self) -> dict:
        return {**{k: v for k, v in self.__dict__.items() if k != "timing"},
                "timing": self.timing.to_dict() if self.timing else None}


@dataclass
class WorkloadResult:
    workload: Workload
    systems: list[SystemResult] = field(default_factory=list)
    bandwidth: dict | None = None  # bandwidth-bound rows: the bound measured among their systems

    def get(self, key: str) -> SystemResult | None:
        return next((s for s in self.systems if s.key == key), None)

    def ratio(self, result: SystemResult) -> float | None:
        """How many times faster than eager (eager median / system median)."""
        eager = self.get("eager")
        if result.timing is None or eager is None or eager.timing is None:
            return None
        return eager.timing.median_s / result.timing.median_s


def run_workload(workload: Workload, systems: list[System], settings: protocol.Settings,
                 measure_bandwidth: bool = True) -> WorkloadResult:
    torch._dynamo.reset()  # earlier rows' compiled code must not count against dynamo's recompile limit
    result = WorkloadResult(workload)
    calls: dict[str, Callable[[], Any]] = {}
    reference_case = workload.build()
    eager_call = systems[0].prepare(workload, reference_case)
    reference = run_steps(eager_call, reference_case)
    for system in (s for s in systems if s.applies(workload)):
        if system.key == "eager":
            result.systems.append(SystemResult("eager", system.label, OK, "reference"))
            calls["eager"] = eager_call
            continue
        outcome, call = _validate(system, workload, reference)
        result.systems.append(outcome)
        if call is not None:
            calls[system.key] = call
    if workload.ideal_bytes and measure_bandwidth:
        calls.update(bandwidth.kernels())
    timings = protocol.measure(calls, settings)
    for system_result in result.systems:
        system_result.timing = timings.get(system_result.key)
    if workload.ideal_bytes and measure_bandwidth:
        result.bandwidth = bandwidth.summarize(timings)
    return result


def _validate(system: System, workload: Workload, reference) -> tuple[SystemResult, Callable | None]:
    def result(status: str, detail: str) -> SystemResult:
        return SystemResult(system.key, system.label, status, detail)

    case = workload.build()
    try:
        call = system.prepare(workload, case)
        outcome = run_steps(call, case)
    except NotApplicable as error:
        return result(NOT_APPLICABLE, str(error)), None
    except (NotImplementedError, tracejit.HostDependencyError) as error:  # a combination tracejit refuses
        return result(NOT_APPLICABLE, f"{type(error).__name__}: {_first_line(error)}"), None
    except Exception as error:  # noqa: BLE001 - any other failure is reported in the table, not raised
        return result(FAILED, f"{type(error).__name__}: {_first_line(error)}"), None
    verdict = compare(reference, outcome, system.exact)
    if not verdict.ok:
        return result(FAILED, verdict.text), None
    return result(OK, verdict.text), call


def add_first_calls(result: WorkloadResult, systems: list[System]) -> None:
    """Cold first-call cost and peak memory of every validated system, each in a fresh process."""
    wanted = {s.key for s in systems if s.first_call}
    for system_result in result.systems:
        if system_result.status == OK and system_result.key in wanted:
            system_result.first_call = firstcall.measure_in_subprocess(result.workload.name, system_result.key)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
