"""Data-parallel benchmarks: 2 processes x 1 thread on gloo over localhost (issue 12).

    python benchmarks/distributed.py            # both rows, eager vs checked vs without_host
    python benchmarks/distributed.py --quick    # smoke run: shorter sampling

Rows (the model and step of `mlp_train_small[fused=True]`: MLP 64-128-128-10, batch 32 per rank,
cross_entropy, backward, Adam(lr=1e-3, fused=True), zero_grad):
- `ddp_train_small`: the model wrapped in DistributedDataParallel;
- `allreduce_naive`: no DDP; the step all-reduces each gradient by hand (`dist.all_reduce(p.grad)`
  and `p.grad.div_(world)` per parameter). tracejit's without_host program buckets those
  all-reduces (passes/bucket_collectives.py); `TRACEJIT_BUCKET_MB=0` measures it unbucketed.

Timing follows BENCHMARKS.md (benchmarks/protocol.py's settings), with the numbers of calls agreed
between the ranks, which step in lockstep (every step is a collective): each system warms up, one
sample is ~5 ms of whole calls, samples are taken round-robin in bursts of ~0.1 s per system with
the garbage collector disabled, until each system has >= 2 s of samples. Each rank proposes its
counts from its own warm-up and both use the larger. The table gives the median and the min per
step; ratios are eager's median over the system's, from the same run. Rank 0 prints the table and
writes benchmarks/results/distributed.json (or --json PATH).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import models, protocol

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
WORLD = 2
SYSTEMS = ("eager", "tj-checked", "tj-host-free")
WARMUP_CALLS = 200  # a DDP step of this size takes 1-2 ms


def ddp_step(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def allreduce_step(x, y, *, model, opt, world):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    opt.step()
    opt.zero_grad()
    return loss


def build(row: str, rank: int):
    """(step, model, opt, x, y, extra keyword arguments) of a row, seeded alike on every rank."""
    torch.manual_seed(0)
    model = models.mlp((64, 128, 128, 10))
    generator = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(32, 64, generator=generator), torch.randint(0, 10, (32,), generator=generator)
    if row == "ddp_train_small":
        model = torch.nn.parallel.DistributedDataParallel(model)
        step, extra = ddp_step, {}
    else:
        step, extra = allreduce_step, {"world": WORLD}
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    return step, model, opt, x, y, extra


def system_call(system: str, row: str, rank: int):
    import tracejit

    step, model, opt, x, y, extra = build(row, rank)
    if system != "eager":
        step = tracejit.trace(step, without_host=system == "tj-host-free")
    return lambda: step(x, y, model=model, opt=opt, **extra)


def _timed(run: Any) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _agreed(counts: list[int]) -> list[int]:
    """The largest of each count over the ranks: both ranks must make the same number of calls."""
    tensor = torch.tensor(counts, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def measure(row: str, rank: int, settings: protocol.Settings) -> dict[str, dict[str, float]]:
    runs = {system: system_call(system, row, rank) for system in SYSTEMS}
    estimates = {}
    for system, run in runs.items():  # recording, re-recording (DDP's bucket rebuild), compiling
        for _ in range(10):
            run()
        dist.barrier()
        # a fixed number of calls (a warm-up by time would differ between the ranks), >= 0.3 s
        estimates[system] = statistics.median(_timed(run) for _ in range(WARMUP_CALLS))
    calls = _agreed([max(1, round(settings.sample_seconds / estimates[s])) for s in SYSTEMS])
    burst = _agreed([max(1, round(settings.burst_seconds / (estimates[s] * n))) for s, n in zip(SYSTEMS, calls)])
    rounds = _agreed([math.ceil(settings.min_seconds / (estimates[s] * n * b)) for s, n, b in zip(SYSTEMS, calls, burst)])
    samples: dict[str, list[float]] = {system: [] for system in SYSTEMS}
    gc.collect()
    gc.disable()
    try:
        for _ in range(max(rounds)):
            for (system, run), n, b in zip(runs.items(), calls, burst):
                dist.barrier()
                for _ in range(b):
                    start = time.perf_counter()
                    for _ in range(n):
                        run()
                    samples[system].append((time.perf_counter() - start) / n)
    finally:
        gc.enable()
    return {system: {"median_s": statistics.median(values), "min_s": min(values), "samples": len(values),
                     "calls_per_sample": n}
            for (system, values), n in zip(samples.items(), calls)}


def worker(rank: int, directory: str, quick: bool, rows: list[str], out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(directory, "store"), WORLD),
                            rank=rank, world_size=WORLD)
    settings = protocol.QUICK if quick else protocol.Settings()
    results = {row: measure(row, rank, settings) for row in rows}
    if rank == 0:
        with open(out, "w") as file:
            json.dump(results, file)
    # both ranks done with every collective before the group goes (a rank that tears it down while
    # the other still waits in gloo has been seen to abort at exit)
    dist.barrier()
    dist.destroy_process_group()


def table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["| row | system | ms / step (median) | min | vs eager |", "|---|---|---|---|---|"]
    for row, timings in results.items():
        eager = timings["eager"]["median_s"]
        for system, timing in timings.items():
            median = timing["median_s"]
            lines.append(f"| {row} | {system} | {median * 1e3:.3f} | {timing['min_s'] * 1e3:.3f} | {eager / median:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: shorter warm-up and sampling")
    parser.add_argument("--only", metavar="ROW[,ROW]", help="ddp_train_small, allreduce_naive")
    parser.add_argument("--json", metavar="PATH", help="where to write the results")
    args = parser.parse_args(argv)
    rows = args.only.split(",") if args.only else ["ddp_train_small", "allreduce_naive"]
    started, load = datetime.datetime.now(datetime.timezone.utc), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tracejit-dist-bench-") as directory:
        out = os.path.join(directory, "results.json")
        mp.spawn(worker, args=(directory, args.quick, rows, out), nprocs=WORLD, join=True)
        with open(out) as file:
            results = json.load(file)
    print(table(results))
    path = args.json or os.path.join(RESULTS, "distributed.json")
    record = {"started": started.isoformat(timespec="seconds"), "torch": torch.__version__, "world": WORLD,
              "threads_per_rank": 1, "quick": args.quick, "load_average": load,
              "bucket_mb": os.environ.get("TRACEJIT_BUCKET_MB", "25"), "results_s": results}
    with open(path, "w") as file:
        json.dump(record, file, indent=1)
    print(f"written to {os.path.relpath(path)} (load average at start {load:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
