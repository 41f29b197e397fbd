"""Run the benchmark suite: every workload, every system, side by side in one process.

    python benchmarks/run.py                      # the full suite (about 10-15 minutes)
    python benchmarks/run.py --quick              # smoke run: 3 rows, short sampling
    python benchmarks/run.py --only mlp_train_small,elementwise_chain --systems compile,tj-host-free

Prints a markdown table per workload (median and min per call, speed-up vs eager, cold first-call
times, peak memory, validation) and writes the numbers as JSON: benchmarks/results/suite.json for
a full run, benchmarks/results/partial.json otherwise, or --json PATH. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bandwidth, firstcall, protocol, report, suite, systems, targets, workloads

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 rows, 0.2 s of samples per system")
    parser.add_argument("--only", metavar="NAME[,NAME]", help="workloads (families or row names)")
    parser.add_argument("--systems", metavar="KEY[,KEY]", help=f"systems besides eager: {', '.join(systems.SYSTEMS)}")
    parser.add_argument("--json", metavar="PATH", help="where to write the results")
    parser.add_argument("--no-first-call", action="store_true", help="skip the cold first-call subprocesses")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the memory-bandwidth measurement")
    parser.add_argument(firstcall.CHILD_FLAG, nargs=2, metavar=("ROW", "SYSTEM"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    child = getattr(args, firstcall.CHILD_FLAG.lstrip("-").replace("-", "_"))
    if child:
        print(json.dumps(firstcall.measure(*child)))
        return 0
    started, begin, load = datetime.datetime.now(), time.perf_counter(), os.getloadavg()[0]
    settings = protocol.QUICK if args.quick else protocol.Settings()
    rows = workloads.select(args.only or (",".join(workloads.QUICK_ROWS) if args.quick else None))
    chosen = systems.select(args.systems)
    full = not (args.quick or args.only or args.systems or args.no_first_call or args.no_bandwidth)
    path = args.json or os.path.join(RESULTS, "suite.json" if full else "partial.json")
    protocol.configure_threads()
    systems.configure_compile()
    # kernels compiled in this process go to a fresh directory, removed at the end
    scratch = tempfile.TemporaryDirectory(prefix="tracejit-bench-")
    for name in ("TRACEJIT_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        os.environ[name] = os.path.join(scratch.name, name.lower())
    print(report.header(settings, started), flush=True)
    measured_bandwidth = None if args.no_bandwidth else bandwidth.measure(settings)
    if measured_bandwidth:
        print(report.bandwidth_table(measured_bandwidth), flush=True)
    results = []
    for workload in rows:
        row_begin = time.perf_counter()
        result = suite.run_workload(workload, chosen, settings, measure_bandwidth=not args.no_bandwidth)
        if not args.no_first_call:
            suite.add_first_calls(result, chosen)
        print(report.workload_table(result) + f"\n({time.perf_counter() - row_begin:.0f} s)\n", flush=True)
        results.append(result)
    for table in (report.recording_table(results), report.warmup_table(results)):
        if table:
            print(table)
    seconds = time.perf_counter() - begin
    report.write_json(path, settings, started, seconds, measured_bandwidth, results, load)
    with open(path) as written:
        print(targets.table(json.load(written)))
    print(f"{len(rows)} workloads in {seconds:.0f} s; results written to {os.path.relpath(path)}")
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
