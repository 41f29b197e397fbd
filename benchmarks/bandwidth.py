"""The physical limit of the bandwidth-bound workloads: memory bandwidth, measured in the same run.

Two streaming kernels on 64M float32 (256 MB per tensor, far beyond the caches), timed by the same
protocol as the workloads: `a.add_(b)` reads a and b and writes a; `torch.add(a, b, out=c)` reads
a and b and writes the preallocated c. Both move 3 x 256 MB per call. The suite measures them once
at the start and again inside each bandwidth-bound row, interleaved with that row's systems, so a
row's bound is measured under the same load as its systems.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import protocol

NUMEL = 64 * 2**20
BYTES_PER_CALL = 3 * 4 * NUMEL
PREFIX = "bandwidth: "  # names of the kernels among a row's timed calls


def kernels() -> dict[str, Callable[[], object]]:
    a, b, c = (torch.rand(NUMEL) for _ in range(3))  # rand, not empty: every page is touched before timing
    return {PREFIX + "a.add_(b)": lambda: a.add_(b), PREFIX + "torch.add(a, b, out=c)": lambda: torch.add(a, b, out=c)}


def summarize(timings: dict[str, protocol.Timing]) -> dict:
    """{kernels: {name: timing and gb_per_s}, bound_gb_per_s: the best median bandwidth}."""
    found = {name.removeprefix(PREFIX): {**t.to_dict(), "gb_per_s": BYTES_PER_CALL / t.median_s / 1e9}
             for name, t in timings.items() if name.startswith(PREFIX)}
    return {"numel": NUMEL, "bytes_per_call": BYTES_PER_CALL, "kernels": found,
            "bound_gb_per_s": max(k["gb_per_s"] for k in found.values())}


def measure(settings: protocol.Settings) -> dict:
    return summarize(protocol.measure(kernels(), settings))


def bound_seconds(ideal_bytes: int, bandwidth: dict) -> float:
    """How long moving `ideal_bytes` takes at the measured bandwidth: the workload's floor."""
    return ideal_bytes / (bandwidth["bound_gb_per_s"] * 1e9)
