"""symbolic_shape on the transformer_train step: per-call time at one shape, and the time to serve
a new shape, against eager, a static trace of the same shape and torch.compile (dynamic=None).

Per call: each system trains its own copy of the model at batch 8 x 32 tokens (the suite's
transformer_train row); systems are sampled round-robin in short bursts (benchmarks/protocol.py),
so a noisy neighbour slows all of them alike. The symbolic-shape trace serves that shape from a
trace recorded at another shape (it was specialized, not recorded, for it).

New shape: the first call at a (batch, tokens) not seen before, after the system has seen a few
shapes: tracejit specializes its symbolic trace (checked: the function runs once against the
specialized record; without_host: the same, and the host-free program is compiled for the size);
torch.compile recompiles, for the first size change, a graph with dynamic sizes (and serves later
sizes from it). The second call at that new shape is reported too.

Usage: python benchmarks/symbolic_shape.py [--quick] [--no-compile] [--out PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tracejit  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.protocol import QUICK, Settings, configure_threads, measure  # noqa: E402
from benchmarks.workloads import train_step  # noqa: E402

SHAPE = (8, 32)
WARM_SHAPES = [(4, 16), (6, 24), (8, 40)]  # seen before the measured shapes
NEW_SHAPES = [(5, 20), (7, 28), (3, 48), (8, 12), (2, 56), (6, 36)]
RESULTS = Path(__file__).resolve().parent / "results" / "symbolic_shape.json"


def batch(shape: tuple[int, int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, 64, generator=generator), torch.randint(0, 10, (shape[0],), generator=generator)


def objects(base: torch.nn.Module) -> dict:
    model = copy.deepcopy(base)
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)}


def systems(base: torch.nn.Module) -> dict:
    """name -> (callable step, its objects), each warmed up at SHAPE the way its kind is used."""
    made = {
        "eager": train_step,
        "static trace, without_host": tracejit.trace(train_step, symbolic_shape=False, without_host=True),
        "static trace, without_host, backend=aten": tracejit.trace(train_step, symbolic_shape=False,
                                                                   without_host=True, backend="aten"),
        "symbolic-shape trace, without_host": tracejit.trace(train_step, symbolic_shape=True, without_host=True),
        "static trace, checked": tracejit.trace(train_step, symbolic_shape=False),
        "symbolic-shape trace, checked": tracejit.trace(train_step, symbolic_shape=True),
    }
    prepared = {}
    for name, fn in made.items():
        state = objects(base)
        if name.startswith("symbolic"):
            fn(*batch((3, 10)), **state)  # recorded at another shape: SHAPE is served by a specialization
            fn(*batch((3, 10)), **state)
        for _ in range(4):
            fn(*batch(SHAPE), **state)
        if isinstance(fn, tracejit.trace) and name.startswith("symbolic"):
            assert fn.stats.records == 1 and fn.stats.shape_specializations >= 1, fn.stats
        prepared[name] = (fn, state)
    return prepared


def per_call(base: torch.nn.Module, settings: Settings) -> dict[str, dict[str, float]]:
    """name -> median and best sample per call. On the shared machine the best sample is the steadier
    figure: a neighbour's burst inflates some samples of every system, never deflates one."""
    prepared = systems(base)
    x, y = batch(SHAPE)
    calls = {name: (lambda fn=fn, state=state: fn(x, y, **state)) for name, (fn, state) in prepared.items()}
    timings = measure(calls, settings)
    for name, (fn, _) in prepared.items():  # the JIT served the sampled calls without recording
        if isinstance(fn, tracejit.trace):
            assert fn.stats.records == 1 and fn.stats.host_free_misses == 0, (name, fn.stats)
    return {name: {"median_s": t.median_s, "min_s": t.min_s} for name, t in timings.items()}


def new_shapes(base: torch.nn.Module, make, warm: list, new: list) -> dict[str, float]:
    """Seconds of the first and of the second call at each new shape (medians), after `warm`."""
    fn, state = make(), objects(base)
    for shape in warm:
        fn(*batch(shape), **state)
    first, second = [], []
    for i, shape in enumerate(new):
        args = batch(shape, seed=i)
        start = time.perf_counter()
        fn(*args, **state)
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        fn(*args, **state)
        second.append(time.perf_counter() - start)
    return {"first_call_s": statistics.median(first), "second_call_s": statistics.median(second),
            "first_call_each_s": first}


def torch_compile_recompile(base: torch.nn.Module) -> dict[str, float]:
    """torch.compile(dynamic=None): the first size change recompiles with dynamic sizes; later sizes
    reuse that graph. Reports the static compile, the recompile, and a later new size. Inductor's
    on-disk caches start empty (a temporary TORCHINDUCTOR_CACHE_DIR), as tracejit's specializations
    do in a process: a warm cache from an earlier run would hide the compilation."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    torch._dynamo.reset()
    fn, state = torch.compile(train_step, dynamic=None), objects(base)
    times = []
    for i, shape in enumerate([SHAPE, *NEW_SHAPES[:3]]):
        args = batch(shape, seed=i)
        start = time.perf_counter()
        fn(*args, **state)
        times.append(time.perf_counter() - start)
    return {"first_compile_s": times[0], "recompile_s": times[1], "later_new_shape_s": statistics.median(times[2:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short sampling (a smoke run)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (slow to compile)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    configure_threads()
    torch.manual_seed(0)
    base = models.TransformerBlock()
    settings = QUICK if args.quick else Settings()

    times = per_call(base, settings)
    print(f"per call at batch {SHAPE[0]} x {SHAPE[1]} tokens (median and best ms, speed vs eager by median):")
    for name, t in times.items():
        print(f"  {name:<42} {t['median_s'] * 1e3:8.3f} ms {t['min_s'] * 1e3:8.3f} ms  "
              f"{times['eager']['median_s'] / t['median_s']:5.2f}x eager")
    pairs = {
        "symbolic/static without_host": ("symbolic-shape trace, without_host", "static trace, without_host"),
        "symbolic/static without_host (both aten)": ("symbolic-shape trace, without_host",
                                                     "static trace, without_host, backend=aten"),
        "symbolic/static checked": ("symbolic-shape trace, checked", "static trace, checked"),
        "symbolic without_host/eager": ("symbolic-shape trace, without_host", "eager"),
    }
    ratios = {name: {kind: times[a][kind] / times[b][kind] for kind in ("median_s", "min_s")}
              for name, (a, b) in pairs.items()}
    for name, ratio in ratios.items():
        print(f"  time ratio {name}: median {ratio['median_s']:.3f}, best {ratio['min_s']:.3f}")

    serving = {
        "tracejit symbolic_shape=True, checked": new_shapes(
            base, lambda: tracejit.trace(train_step, symbolic_shape=True), WARM_SHAPES, NEW_SHAPES),
        "tracejit symbolic_shape=True, without_host": new_shapes(
            base, lambda: tracejit.trace(train_step, symbolic_shape=True, without_host=True), WARM_SHAPES, NEW_SHAPES),
        "tracejit symbolic_shape=False (records each shape), checked": new_shapes(
            base, lambda: tracejit.trace(train_step, symbolic_shape=False, max_traces=64), WARM_SHAPES, NEW_SHAPES),
        "eager": new_shapes(base, lambda: train_step, WARM_SHAPES, NEW_SHAPES),
    }
    print("new shape (median s of the first call at a new shape; second call at it):")
    for name, row in serving.items():
        print(f"  {name:<60} {row['first_call_s']:.3f} s  then {row['second_call_s'] * 1e3:.1f} ms")
    compiled = None
    if not args.no_compile:
        compiled = torch_compile_recompile(base)
        print(f"  torch.compile(dynamic=None): first compile {compiled['first_compile_s']:.1f} s, recompile at a new "
              f"shape {compiled['recompile_s']:.1f} s, a later new shape {compiled['later_new_shape_s']:.3f} s")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "workload": "transformer_train (TransformerBlock width 64, 4 heads; Adam fused=True)",
        "shape": list(SHAPE), "torch": torch.__version__, "threads": torch.get_num_threads(), "quick": args.quick,
        "per_call_s": times, "ratios": ratios, "new_shape": serving, "torch_compile": compiled,
    }, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
