"""First-call cost and peak memory, each (workload, system) in a fresh subprocess with cold caches.

The child first warms the system's one-time machinery up on a tiny function (for torch.compile the
inductor warm-up: compiler checks, codecache, worker start-up), timed and reported on its own. Then
it builds the workload and times the first three calls one by one: the first includes preparing
the system (torch.jit.trace + freeze, tracejit's record + compile); tracejit compiles its without_host
program on the second or third call. Memory is the resident set size (Linux VmHWM, reset through
/proc/self/clear_refs): its high-water mark over the first three calls, and over three later calls,
each above the resident size just before them. Kernel caches are fresh temporary directories
(TRACEJIT_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR), deleted afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from . import protocol
from .systems import SYSTEMS, configure_compile
from .workloads import TINY, WORKLOADS

RUN_PY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py")
CHILD_FLAG = "--child-first-call"
FIRST_CALLS = 3
TIMEOUT_S = 600


def measure_in_subprocess(row: str, key: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="tracejit-bench-") as cache:
        env = dict(os.environ, **{name: os.path.join(cache, name.lower()) for name in
                                  ("TRACEJIT_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")})
        try:
            completed = subprocess.run([sys.executable, RUN_PY, CHILD_FLAG, row, key], capture_output=True,
                                       text=True, env=env, timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"no result within {TIMEOUT_S} s"}
    if completed.returncode != 0:
        lines = completed.stderr.strip().splitlines() or [f"exit status {completed.returncode}"]
        return {"error": lines[-1]}
    return json.loads(completed.stdout.strip().splitlines()[-1])


def measure(row: str, key: str) -> dict:
    """In the child: warm-up, the first calls and the memory readings of one system on one row."""
    protocol.configure_threads()
    configure_compile()
    system, workload = SYSTEMS[key], WORKLOADS[row]
    begin = time.perf_counter()
    tiny_call = system.prepare(TINY, TINY.build())
    for _ in range(FIRST_CALLS):
        tiny_call()
    warmup_s = time.perf_counter() - begin
    case = workload.build()
    before_kb = protocol.reset_peak_rss()
    calls_s = []
    begin = time.perf_counter()
    call = system.prepare(workload, case)
    for _ in range(FIRST_CALLS):
        call()
        calls_s.append(time.perf_counter() - begin)
        begin = time.perf_counter()
    first_peak_kb = protocol.status_kb("VmHWM") - before_kb
    before_kb = protocol.reset_peak_rss()
    for _ in range(FIRST_CALLS):
        call()
    steady_peak_kb = protocol.status_kb("VmHWM") - before_kb
    return {"warmup_s": warmup_s, "calls_s": calls_s, "peak_first_calls_mb": first_peak_kb / 1024,
            "peak_steady_mb": steady_peak_kb / 1024}
