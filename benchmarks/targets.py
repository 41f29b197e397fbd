"""The speed targets of issues 4, 5, 10 and 13, checked against a results document (suite.json).

    python -m benchmarks.targets [benchmarks/results/suite.json]

Every target is a ratio within one run (or a first-call time), so it can be read from any full
run's JSON; a target whose systems did not run says why.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "suite.json")


class Missing(Exception):
    """A system the target needs was not measured; the message says why."""


@dataclass(frozen=True)
class Target:
    issue: int
    text: str
    measure: Callable[[dict], float]
    threshold: float
    unit: str = "×"
    at_most: bool = False  # the measured value must not exceed the threshold

    def met(self, value: float) -> bool:
        return value <= self.threshold if self.at_most else value >= self.threshold


def _workload(document: dict, row: str) -> dict:
    workload = next((w for w in document["workloads"] if w["name"] == row), None)
    if workload is None:
        raise Missing(f"{row} not in this run")
    return workload


def _system(document: dict, row: str, key: str) -> dict:
    workload = _workload(document, row)
    system = next((s for s in workload["systems"] if s["key"] == key), None)
    if system is None:
        raise Missing(f"{key} not run on {row}")
    if system["timing"] is None:
        raise Missing(f"{system['label']}: {system['status']} ({system['detail']})")
    return system


def speedup(row: str, key: str, over: str = "eager") -> Callable[[dict], float]:
    """How many times faster `key` is than `over` on `row` (ratio of medians)."""
    def measure(document: dict) -> float:
        return _system(document, row, over)["timing"]["median_s"] / _system(document, row, key)["timing"]["median_s"]
    return measure


def first_call_s(row: str, key: str) -> Callable[[dict], float]:
    def measure(document: dict) -> float:
        first = _system(document, row, key).get("first_call") or {}
        if "calls_s" not in first:
            raise Missing(first.get("error", "first call not measured"))
        return first["calls_s"][0]
    return measure


def peak_steady_mb(row: str, key: str) -> Callable[[dict], float]:
    """Peak resident memory of three steady calls above the resident set before them (fresh process)."""
    def measure(document: dict) -> float:
        first = _system(document, row, key).get("first_call") or {}
        if "peak_steady_mb" not in first:
            raise Missing(first.get("error", "peak memory not measured"))
        return first["peak_steady_mb"]
    return measure


def excess_over(row: str, key: str, over: str = "eager") -> Callable[[dict], float]:
    """How much more steady peak memory `key` takes than `over` (MB; at most 0 means no more)."""
    def measure(document: dict) -> float:
        return peak_steady_mb(row, key)(document) - peak_steady_mb(row, over)(document)
    return measure


def bound_fraction(row: str, key: str) -> Callable[[dict], float]:
    def measure(document: dict) -> float:
        workload = _workload(document, row)
        if not workload.get("bandwidth"):
            raise Missing("bandwidth not measured")
        bound_s = workload["ideal_bytes"] / (workload["bandwidth"]["bound_gb_per_s"] * 1e9)
        return bound_s / _system(document, row, key)["timing"]["median_s"]
    return measure


SMALL, INFER = "mlp_train_small[fused=True]", "mlp_infer_small"
TARGETS = [
    Target(4, f"{INFER}: without_host >= 2x eager", speedup(INFER, "tj-host-free"), 2.0),
    Target(4, f"{INFER}: without_host faster than jit.trace+freeze+optimize_for_inference",
           speedup(INFER, "tj-host-free", over="jit-trace"), 1.0),
    Target(4, f"{SMALL}: without_host, no fusion (backend=aten) >= 1.3x eager", speedup(SMALL, "tj-aten"), 1.3),
    Target(4, f"{SMALL}: without_host, no fusion, faster than torch.compile",
           speedup(SMALL, "tj-aten", over="compile"), 1.0),
    Target(5, f"{SMALL}: without_host with fused kernels (backend=c) >= 2x eager", speedup(SMALL, "tj-c"), 2.0),
    Target(4, "mlp_train_medium: checked replay no slower than eager", speedup("mlp_train_medium", "tj-checked"), 1.0),
    Target(4, f"{SMALL}: cold record + compile + first call <= 0.5 s (checked replay)",
           first_call_s(SMALL, "tj-checked"), 0.5, unit=" s", at_most=True),
    Target(4, f"{SMALL}: cold record + compile + first call <= 0.5 s (without_host)",
           first_call_s(SMALL, "tj-host-free"), 0.5, unit=" s", at_most=True),
    Target(5, "elementwise_chain: backend=c >= 5x eager", speedup("elementwise_chain", "tj-c"), 5.0),
    Target(5, "elementwise_chain: backend=c >= 3x torch.compile",
           speedup("elementwise_chain", "tj-c", over="compile"), 3.0),
    Target(5, "elementwise_chain: backend=c >= 50% of the bandwidth bound",
           bound_fraction("elementwise_chain", "tj-c"), 0.5, unit=""),
    Target(5, "adam_only_large[foreach=True]: checked replay, backend=c >= 4x eager foreach",
           speedup("adam_only_large[foreach=True]", "tj-c-checked"), 4.0),
    Target(5, "adam_only_large[fused=True]: backend=c at least as fast as eager fused Adam",
           speedup("adam_only_large[fused=True]", "tj-c"), 1.0),
    # issue 10: checked replay (the default mode, default backend) faster than eager
    *(Target(10, f"mlp_train_small[{variant}]: checked replay >= 1.3x eager",
             speedup(f"mlp_train_small[{variant}]", "tj-checked"), 1.3)
      for variant in ("foreach=False", "foreach=True", "fused=True")),
    Target(10, f"{INFER}: checked replay >= 1.0x eager", speedup(INFER, "tj-checked"), 1.0),
    *(target for row in ("mlp_train_medium", "cnn_train", "transformer_train") for target in (
        Target(10, f"{row}: checked replay >= 1.1x eager", speedup(row, "tj-checked"), 1.1),
        Target(10, f"{row}: checked replay within 10% of without_host", speedup(row, "tj-checked", over="tj-host-free"), 0.9),
        Target(10, f"{row}: steady peak RSS of checked replay <= eager's (MB more)", excess_over(row, "tj-checked"), 0.0,
               unit=" MB", at_most=True))),
    # issue 13: graph_opt_config (both fields) without the host
    *(Target(13, f"{row}: without_host with graph_opt_config >= 1.5x eager", speedup(row, "tj-c-graph-opt"), 1.5)
      for row in ("transformer_train", "cnn_train")),
]


def table(document: dict) -> str:
    lines = ["### targets of issues 4, 5, 10 and 13 (this run)", "", "| issue | target | measured | met |", "|---|---|---:|---|"]
    for target in TARGETS:
        try:
            value = target.measure(document)
        except Missing as why:
            lines.append(f"| {target.issue} | {target.text} | n/a | {why} |")
            continue
        shown = f"{value:.0%}" if target.unit == "" else f"{value:.2f}{target.unit}"
        lines.append(f"| {target.issue} | {target.text} | {shown} | {'yes' if target.met(value) else 'no'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else DEFAULT) as source:
        print(table(json.load(source)))
