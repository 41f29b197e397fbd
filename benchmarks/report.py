"""Markdown tables for the terminal and docs/performance.md, and the JSON results file."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess

import torch

from . import bandwidth as bandwidth_module
from .suite import OK, WorkloadResult
from .validate import OUTPUT_TOLERANCE, STATE_TOLERANCE, STEPS


def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _mb(value: float | None) -> str:
    return "" if value is None else f"{value:.1f} MB"


def workload_table(result: WorkloadResult) -> str:
    workload, bandwidth = result.workload, result.bandwidth
    bound = bandwidth_module.bound_seconds(workload.ideal_bytes, bandwidth) if bandwidth else None
    header = ["system", "median", "min", "× eager", "1st call", "2nd+3rd", "peak RSS 1-3", "peak RSS steady", "check"]
    if bound:
        header.insert(4, f"of bound ({fmt_time(bound)})")
    caption = workload.description
    if bound:
        caption += (f". Bound: {workload.ideal_bytes / 1e6:.0f} MB at {bandwidth['bound_gb_per_s']:.1f} GB/s, "
                    f"the bandwidth measured among these systems")
    lines = [f"### {workload.name}", "", caption, "",
             "| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 2) + "---|"]
    for system in result.systems:
        if system.status != OK:
            cells = [system.label, system.status] + [""] * (len(header) - 3) + [system.detail]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        timing, first = system.timing, system.first_call or {}
        ratio = result.ratio(system)
        calls = first.get("calls_s") or [None] * 3
        cells = [system.label, fmt_time(timing.median_s), fmt_time(timing.min_s), f"{ratio:.2f}×" if ratio else "",
                 fmt_time(calls[0]), fmt_time(sum(calls[1:]) if calls[1] is not None else None),
                 _mb(first.get("peak_first_calls_mb")), _mb(first.get("peak_steady_mb")),
                 system.detail if "error" not in first else f"{system.detail}; first call: {first['error']}"]
        if bound:
            cells.insert(4, f"{bound / timing.median_s:.0%}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def bandwidth_table(bandwidth: dict) -> str:
    lines = ["### memory bandwidth", "", (f"{bandwidth['numel'] // 2**20}M float32, "
             f"{bandwidth['bytes_per_call'] / 1e6:.0f} MB moved per call"), "",
             "| kernel | median | min | GB/s (median) |", "|---|---:|---:|---:|"]
    for name, kernel in bandwidth["kernels"].items():
        lines.append(f"| `{name}` | {fmt_time(kernel['median_s'])} | {fmt_time(kernel['min_s'])} | "
                     f"{kernel['gb_per_s']:.1f} |")
    lines.append("\nBandwidth-bound rows measure it again among their own systems, under the same load.")
    return "\n".join(lines) + "\n"


def warmup_table(results: list[WorkloadResult]) -> str:
    """One-time warm-up (tiny function, fresh process) per system, median over the rows."""
    by_label: dict[str, list[float]] = {}
    for result in results:
        for system in result.systems:
            if system.first_call and "warmup_s" in system.first_call:
                by_label.setdefault(system.label, []).append(system.first_call["warmup_s"])
    if not by_label:
        return ""
    lines = ["### one-time warm-up in a fresh process (3 calls of a tiny function, before each first call)", "",
             "| system | median | processes |", "|---|---:|---:|"]
    lines += [f"| {label} | {fmt_time(statistics.median(v))} | {len(v)} |" for label, v in by_label.items()]
    return "\n".join(lines) + "\n"


def recording_table(results: list[WorkloadResult]) -> str:
    """Issue 2: eager vs the recording call vs checked replay, ratios within this run."""
    rows = [r for r in results if r.workload.report_recording and r.get("tj-record") and r.get("tj-checked")]
    if not rows:
        return ""
    lines = ["### recording and checked replay vs eager (issue 2)", "",
             ("| workload | eager | recording call (warm) | ÷ eager | cold 1st call | ÷ eager 1st call | "
             "checked replay | ÷ eager |"), "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for result in rows:
        eager, record, checked = result.get("eager"), result.get("tj-record"), result.get("tj-checked")
        cells = [result.workload.name, fmt_time(eager.timing.median_s)]
        cells += _cost(record, eager) + _cold(checked, eager) + _cost(checked, eager)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cost(system, eager) -> list[str]:
    if system.timing is None:
        return [f"{system.status}: {system.detail}", ""]
    return [fmt_time(system.timing.median_s), f"{system.timing.median_s / eager.timing.median_s:.2f}"]


def _cold(system, eager) -> list[str]:
    first, eager_first = system.first_call or {}, eager.first_call or {}
    if "calls_s" not in first or "calls_s" not in eager_first:
        return ["", ""]
    return [fmt_time(first["calls_s"][0]), f"{first['calls_s'][0] / eager_first['calls_s'][0]:.2f}"]


def machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def _commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        # other work in progress in the tree (src/ is installed editable) is part of what was measured
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no", "src"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+uncommitted changes in src/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def header(settings, started: datetime.datetime) -> str:
    return (f"tracejit benchmarks — {started:%Y-%m-%d %H:%M}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, {machine()['cpu']}, commit {_commit()}, load average "
            f"{os.getloadavg()[0]:.1f} at start; sampling >= {settings.min_seconds:g} s per system, interleaved; "
            f"× eager = eager median / system median\n")


def write_json(path: str, settings, started: datetime.datetime, seconds: float, bandwidth: dict | None,
               results: list[WorkloadResult], load_at_start: float) -> None:
    document = {
        "date": started.isoformat(timespec="seconds"), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": machine(), "commit": _commit(), "run_seconds": seconds,
        "TRACEJIT_BACKEND": os.environ.get("TRACEJIT_BACKEND"),
        "load_average_1min": {"start": load_at_start, "end": os.getloadavg()[0]},
        "protocol": {**settings.__dict__, "validation_steps": STEPS, "output_tolerance": OUTPUT_TOLERANCE,
                     "state_tolerance_relative_norm": STATE_TOLERANCE,
                     "memory": "resident set size: Linux VmHWM reset via /proc/self/clear_refs, fresh subprocess"},
        "bandwidth": bandwidth,
        "workloads": [{"name": r.workload.name, "description": r.workload.description,
                       "ideal_bytes": r.workload.ideal_bytes, "bandwidth": r.bandwidth,
                       "systems": [{**s.to_dict(), "ratio_vs_eager": r.ratio(s)} for s in r.systems]}
                      for r in results],
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as out:
        json.dump(document, out, indent=1)
