"""The timing protocol of BENCHMARKS.md, and the process-memory readings the suite reports.

Timing: warm each callable up (>= 0.3 s and >= 5 calls), calibrate how many calls make one sample
(~5 ms), then collect samples with the garbage collector disabled until each callable has >= 2 s of
samples. Several callables are sampled round-robin in short bursts, so a noisy neighbour on the
shared machine slows every system of a table alike and the ratios within one run stay meaningful.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

THREADS = 2


@dataclass(frozen=True)
class Settings:
    warmup_seconds: float = 0.3
    warmup_calls: int = 5
    sample_seconds: float = 0.005  # one sample: this long, in whole calls
    min_seconds: float = 2.0  # of samples per callable
    burst_seconds: float = 0.1  # one callable's turn in the round-robin


QUICK = Settings(warmup_seconds=0.05, min_seconds=0.2, burst_seconds=0.05)


@dataclass(frozen=True)
class Timing:
    median_s: float  # per call
    min_s: float  # per call, best sample
    samples: int
    calls_per_sample: int
    sampled_s: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Plan:
    call: Callable[[], object]
    calls_per_sample: int
    per_call: list[float] = field(default_factory=list)
    sampled_s: float = 0.0


def configure_threads() -> None:
    torch.set_num_threads(THREADS)


def warm_up(call: Callable[[], object], settings: Settings) -> float:
    """Call until the warm-up budget is spent; the median of the later calls estimates one call."""
    durations = []
    start = time.perf_counter()
    while len(durations) < settings.warmup_calls or time.perf_counter() - start < settings.warmup_seconds:
        begin = time.perf_counter()
        call()
        durations.append(time.perf_counter() - begin)
    return statistics.median(durations[len(durations) // 2:])


def _one_sample(call: Callable[[], object], calls: int) -> float:
    begin = time.perf_counter()
    for _ in range(calls):
        call()
    return time.perf_counter() - begin


def measure(calls: dict[str, Callable[[], object]], settings: Settings) -> dict[str, Timing]:
    """Time every callable by the protocol, interleaved; name -> per-call timing."""
    plans = {}
    for name, call in calls.items():
        per_call = warm_up(call, settings)
        plans[name] = _Plan(call, max(1, round(settings.sample_seconds / max(per_call, 1e-9))))
    gc.collect()
    gc.disable()
    try:
        while pending := [p for p in plans.values() if p.sampled_s < settings.min_seconds]:
            for plan in pending:
                burst_start = time.perf_counter()
                while time.perf_counter() - burst_start < settings.burst_seconds:
                    seconds = _one_sample(plan.call, plan.calls_per_sample)
                    plan.per_call.append(seconds / plan.calls_per_sample)
                    plan.sampled_s += seconds
    finally:
        gc.enable()
    return {name: Timing(statistics.median(p.per_call), min(p.per_call), len(p.per_call), p.calls_per_sample,
                         p.sampled_s) for name, p in plans.items()}


# -- memory: Linux resident set size ------------------------------------------------------------------

def status_kb(key: str) -> int:
    """A `/proc/self/status` field in kB (VmRSS: resident now, VmHWM: resident high-water mark)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status (the memory readings need Linux)")


def reset_peak_rss() -> int:
    """Give freed heap back to the OS, make VmHWM equal VmRSS, and return VmRSS in kB."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory reused by the measured call would hide its growth
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the high-water mark to the current resident size
    return status_kb("VmRSS")
