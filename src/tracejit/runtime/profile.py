"""profiling=True: time every node of the compiled program, report where a step spends its time.

Generated code calls `Profiler.stop(row, start)` after each node; rows describe what a node
covers (its recorded ops and their source lines). Timing is wall clock on the CPU; a row on a
CUDA device synchronizes the stream before reading the clock, so the time is the kernel's and
not the launch's. Nothing about the results changes.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

CLOCK = time.perf_counter
_MAX_TRACE_EVENTS = 20000  # the Chrome trace keeps the most recent events


@dataclass
class Row:
    name: str  # node or kernel name
    ops: tuple[str, ...]  # the recorded ops it covers
    sources: tuple[str, ...]  # their user source lines
    program: str  # "checked replay" or "without_host"
    cuda: bool = False
    calls: int = 0
    total: float = 0.0


@dataclass
class Profiler:
    function_name: str
    rows: list[Row] = field(default_factory=list)
    calls: int = 0
    call_time: float = 0.0
    recording_calls: int = 0  # calls that recorded (eager run + compile), reported apart
    recording_time: float = 0.0
    compile_time: float = 0.0  # compiling done inside replayed calls (the host-free program), reported apart
    _compiling_in_call: float = 0.0
    _timed_in_call: list = field(default_factory=list)  # (row, seconds) of the current call's nodes
    memory: dict[str, Any] = field(default_factory=dict)  # dtr_config's plan (ir.graph.RecomputePlan.as_dict)
    events: deque = field(default_factory=lambda: deque(maxlen=_MAX_TRACE_EVENTS))
    _origin: float = field(default_factory=CLOCK)

    def add_row(self, row: Row) -> int:
        self.rows.append(row)
        return len(self.rows) - 1

    def stop(self, index: int, start: float) -> None:
        """Close the timing of row `index`, started at `start` (called by generated code)."""
        row = self.rows[index]
        if row.cuda:
            torch.cuda.synchronize()
        end = CLOCK()
        row.calls += 1
        row.total += end - start
        self._timed_in_call.append((row, end - start))
        self.events.append((index, start, end))

    def compiled(self, seconds: float) -> None:
        """A compilation ran inside the current call; its time is not the call's."""
        self._compiling_in_call += seconds

    def call_done(self, start: float, recorded: bool) -> None:
        elapsed = CLOCK() - start
        if recorded:
            self.recording_calls += 1
            self.recording_time += elapsed
            # a replay that diverged and recorded afresh ran nodes first: part of the recording, so
            # the rows (like the summary) describe replayed calls only
            for row, seconds in self._timed_in_call:
                row.calls -= 1
                row.total -= seconds
        else:
            self.calls += 1
            self.call_time += elapsed - self._compiling_in_call
            self.compile_time += self._compiling_in_call
        self._compiling_in_call = 0.0
        self._timed_in_call.clear()

    def label(self, index: int) -> str:
        row = self.rows[index]
        return f"tracejit/{self.function_name}/{row.name}"

    def report(self) -> dict[str, Any]:
        measured = [r for r in self.rows if r.calls]
        # rows of the recording calls' own ops are not timed; every timed node ran in a replay
        nodes_total = sum(r.total for r in measured)
        rows = [
            {
                "node": r.name,
                "program": r.program,
                "ops": list(r.ops),
                "sources": list(r.sources),
                "calls": r.calls,
                "total_ms": r.total * 1e3,
                "mean_us": r.total / r.calls * 1e6,
                "share": r.total / nodes_total if nodes_total else 0.0,
            }
            for r in sorted(measured, key=lambda r: -r.total)
        ]
        return {
            "function": self.function_name,
            "summary": {
                "calls": self.calls,
                "recording_calls": self.recording_calls,
                "recording_ms": self.recording_time * 1e3,
                "compile_ms": self.compile_time * 1e3,
                "call_total_ms": self.call_time * 1e3,
                "call_mean_us": self.call_time / self.calls * 1e6 if self.calls else 0.0,
                "nodes_total_ms": nodes_total * 1e3,
                # what the nodes do not account for: Python, matching, guards, binding
                "outside_nodes_ms": max(self.call_time - nodes_total, 0.0) * 1e3,
            },
            "rows": rows,
            **({"memory": dict(self.memory)} if self.memory else {}),
        }

    def chrome_trace(self) -> dict[str, Any]:
        events = []
        for index, start, end in self.events:
            row = self.rows[index]
            events.append({
                "name": row.name, "cat": row.program, "ph": "X", "pid": os.getpid(), "tid": 0,
                "ts": (start - self._origin) * 1e6, "dur": (end - start) * 1e6,
                "args": {"ops": list(row.ops), "sources": list(row.sources)},
            })
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def format_table(report: dict[str, Any], limit: int = 15) -> str:
    """The profile as a text table, most expensive rows first."""
    summary = report["summary"]
    lines = [
        f"profile of {report['function']}: {summary['calls']} calls, "
        f"{summary['call_mean_us']:.1f} us per call, {summary['outside_nodes_ms']:.2f} ms outside nodes",
        f"{'node':<34} {'calls':>6} {'total ms':>9} {'mean us':>9} {'share':>6}  source",
    ]
    for row in report["rows"][:limit]:
        source = row["sources"][0] if row["sources"] else ""
        lines.append(f"{row['node'][:34]:<34} {row['calls']:>6} {row['total_ms']:>9.3f} {row['mean_us']:>9.1f} "
                     f"{row['share']:>6.1%}  {source}")
    return "\n".join(lines)


def write_chrome_trace(profiler: Profiler, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(profiler.chrome_trace(), f)


class ProfileAccess:
    """`get_profile()` and `export_chrome_trace()` for an object that holds `_profiler` (None when
    it was made without profiling; `_no_profile_message()` then says how to turn it on)."""

    _profiler: Profiler | None

    def get_profile(self) -> dict:
        """Per-node timings of the compiled program as a JSON-compatible dict (profiling=True)."""
        return self._require_profiler().report()

    def export_chrome_trace(self, path: str) -> None:
        """Write the recent node timings as a Chrome trace (opens in Perfetto and chrome://tracing)."""
        write_chrome_trace(self._require_profiler(), path)

    def _require_profiler(self) -> Profiler:
        if self._profiler is None:
            raise RuntimeError(self._no_profile_message())
        return self._profiler

    def _no_profile_message(self) -> str:
        return "profiling is off; pass profiling=True to collect a profile"
