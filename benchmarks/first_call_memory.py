"""First-call peak memory and time: eager, tracejit recording, tracejit symbolic=True recording.

    PYTHONPATH=src python benchmarks/first_call_memory.py [--repeats 3] [--quick]

Every measurement runs in a fresh process, so one system's allocations cannot lend memory to the
next. Each process warms up with the same system on a tiny model of the same layers (one-time
initialisation is not the first call's cost), builds the model, optimizer and batch, returns freed
heap memory to the OS, then measures one call: its peak resident memory above the resident memory just before
it (Linux VmHWM, reset through /proc/self/clear_refs) and its wall time. A "3rd call" row shows
the steady state for comparison. Before timing, the parent process checks that a symbolic first
call leaves loss, parameters, gradients and optimizer state bitwise equal to an eager step.

Prints a markdown table and writes benchmarks/results/first_call_memory.json (not with --quick).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import tracejit

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import models, protocol
from benchmarks.workloads import train_step as step

WORKLOADS = {
    # name: (layer sizes, batch size)
    "mlp_train_medium": ((784, 512, 512, 10), 128),
    "mlp_train_wide": ((1024, 4096, 4096, 10), 1024),
}
SYSTEMS = ["eager", "tracejit record", "tracejit symbolic", "eager 3rd call", "tracejit 3rd call"]


def build(workload: str, seed: int = 0, tiny: bool = False):
    sizes, batch_size = WORKLOADS[workload]
    if tiny:  # same layers and ops, a few kilobytes: for warming up kernels and tracejit's machinery
        sizes, batch_size = tuple(min(n, 16) for n in sizes), 4
    torch.manual_seed(seed)
    model = models.mlp(sizes)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, sizes[0], generator=g)
    y = torch.randint(0, sizes[-1], (batch_size,), generator=g)
    return model, opt, x, y


def measure(workload: str, system: str) -> dict:
    """One measurement (runs in a child process)."""
    protocol.configure_threads()
    # Warm up on a tiny copy with the same system: one-time initialisation (kernels, thread pools,
    # fake-tensor machinery) is not the first call's cost, and a tiny model leaves no freed memory
    # behind for the measured call to reuse.
    warm_model, warm_opt, warm_x, warm_y = build(workload, seed=1, tiny=True)
    _function(system)(warm_x, warm_y, model=warm_model, opt=warm_opt)
    del warm_model, warm_opt
    model, opt, x, y = build(workload)
    function = _function(system)
    if system.endswith("3rd call"):
        for _ in range(2):
            function(x, y, model=model, opt=opt)
    before = protocol.reset_peak_rss()  # freed heap handed back, VmHWM := VmRSS
    gc.disable()
    start = time.perf_counter()
    loss = function(x, y, model=model, opt=opt)
    seconds = time.perf_counter() - start
    peak = protocol.status_kb("VmHWM")
    return {"peak_above_start_mb": (peak - before) / 1024, "seconds": seconds, "loss": loss.item()}


def _function(system: str):
    if system.startswith("tracejit"):
        return tracejit.trace(step, symbolic=system == "tracejit symbolic")
    return step


def validate(workload: str) -> None:
    """A symbolic first call must leave exactly the state an eager step leaves."""
    model_a, opt_a, x, y = build(workload)
    model_b = copy.deepcopy(model_a)
    opt_b = torch.optim.Adam(model_b.parameters(), lr=1e-3, fused=True)
    expected = step(x, y, model=model_a, opt=opt_a)
    got = tracejit.trace(step, symbolic=True)(x, y, model=model_b, opt=opt_b)
    assert torch.equal(expected, got), f"{workload}: loss differs"
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b), f"{workload}: parameters differ"
    for a, b in zip(opt_a.state.values(), opt_b.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a), f"{workload}: optimizer state differs"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="processes per (workload, system)")
    parser.add_argument("--quick", action="store_true",
                        help="one repeat of the medium workload, results not saved")
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "SYSTEM"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return 0
    protocol.configure_threads()
    workloads = ["mlp_train_medium"] if args.quick else list(WORKLOADS)
    repeats = 1 if args.quick else args.repeats
    rows = []
    for workload in workloads:
        validate(workload)
        for system in SYSTEMS:
            samples = [_run_child(workload, system) for _ in range(repeats)]
            rows.append({
                "workload": workload, "system": system, "repeats": repeats,
                "peak_above_start_mb": statistics.median(s["peak_above_start_mb"] for s in samples),
                "seconds": statistics.median(s["seconds"] for s in samples),
            })
    _report(rows, save=not args.quick)
    return 0


def _run_child(workload: str, system: str) -> dict:
    completed = subprocess.run([sys.executable, __file__, "--child", workload, system],
                               capture_output=True, text=True, check=True, env=os.environ)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _report(rows: list[dict], save: bool) -> None:
    print("| workload | system | peak memory above start (MB, median) | time (ms, median) |")
    print("|---|---|---:|---:|")
    for row in rows:
        print(f"| {row['workload']} | {row['system']} | {row['peak_above_start_mb']:.1f} | "
              f"{row['seconds'] * 1e3:.1f} |")
    print("validated: a symbolic first call leaves loss, parameters and Adam state bitwise equal to eager")
    if not save:
        return
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, "first_call_memory.json"), "w") as out:
        json.dump({"torch": torch.__version__, "date": datetime.date.today().isoformat(),
                   "threads": torch.get_num_threads(), "rows": rows}, out, indent=2)


if __name__ == "__main__":
    sys.exit(main())
