"""The physical limit of the bandwidth-bound workloads: memory bandwidth, measured in the same run.

Two streaming kernels on 64M float32 (256 MB per tensor, far beyond the caches), timed by the same
protocol as the workloads: `a.add_(b)` reads a and b and writes a; `torch.add(a, b, out=c)` reads
a and b and writes the preallocated c. Both move 3 x 256 MB per call.
"""

from __future__ import annotations

import torch

from . import protocol

NUMEL = 64 * 2**20
BYTES_PER_CALL = 3 * 4 * NUMEL


def measure(settings: protocol.Settings) -> dict:
    """{kernel: {median_s, min_s, gb_per_s}, "bound_gb_per_s": the best median bandwidth}."""
    a, b, c = (torch.rand(NUMEL) for _ in range(3))  # rand, not empty: every page is touched before timing
    calls = {"a.add_(b)": lambda: a.add_(b), "torch.add(a, b, out=c)": lambda: torch.add(a, b, out=c)}
    timings = protocol.measure(calls, settings)
    kernels = {name: {**t.to_dict(), "gb_per_s": BYTES_PER_CALL / t.median_s / 1e9} for name, t in timings.items()}
    return {"numel": NUMEL, "bytes_per_call": BYTES_PER_CALL, "kernels": kernels,
            "bound_gb_per_s": max(k["gb_per_s"] for k in kernels.values())}


def bound_seconds(ideal_bytes: int, bandwidth: dict) -> float:
    """How long moving `ideal_bytes` takes at the measured bandwidth: the workload's floor."""
    return ideal_bytes / (bandwidth["bound_gb_per_s"] * 1e9)
