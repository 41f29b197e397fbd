"""`tracejit run FILE`: load a dumped graph, run it, report latency and throughput; `--check` runs
the embedded test cases, `--profile` prints where a call spends its time."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch

from ..runtime.profile import format_table
from ..serialize import LoadedGraph, read_graphs
from ..serialize.load import compile_graph, select
from ..serialize.testcases import CaseResult, fresh_inputs, max_error, parse_case
from .progress import Progress


def run_file(args: argparse.Namespace) -> int:
    graph = select(read_graphs(args.file), args.graph, option="--graph NAME")
    loaded = compile_graph(graph, backend=args.backend, profiling=args.profile)
    ins = ", ".join(f"{name}: {meta}" for name, meta in loaded.inputs.items())
    print(f"{loaded.name}({ins}): {len(loaded.portable.ops)} ops, loaded from {args.file}")
    inputs, origin = _inputs(loaded, args.input)
    print(f"inputs: {origin}")
    for _ in range(args.warmup):
        _call(loaded, inputs)
    times = _timed(loaded, inputs, args.iters)
    if times:
        _report(times, _batch(inputs))
    _describe_outputs(_call(loaded, inputs))
    if args.profile:
        print(format_table(loaded.get_profile()))
    return _check(loaded) if args.check else 0


def _call(loaded: LoadedGraph, inputs: dict[str, torch.Tensor]) -> Any:
    """A call of the graph; an error of torch's on these inputs (an embedding index out of range)
    is the user's to fix, reported in one line."""
    try:
        return loaded(**inputs)
    except (RuntimeError, IndexError) as error:
        raise ValueError(f"{loaded.name}() failed on these inputs: {error}") from None


def _inputs(loaded: LoadedGraph, specs: list[str]) -> tuple[dict[str, torch.Tensor], str]:
    given: dict[str, Any] = {}
    for spec in specs:
        name, equals, data = spec.partition("=")
        if not equals:
            given.update({n: spec for n in loaded.input_names})  # one spec without a name: every input
        elif name not in loaded.inputs:
            raise ValueError(f"--input {spec}: the graph has no input {name!r}; inputs: {', '.join(loaded.input_names)}")
        else:
            given[name] = data
    if loaded.testcases:
        defaults, default_origin = fresh_inputs(loaded.testcases[0].inputs), "embedded test case 0"
    else:
        defaults, default_origin = {name: "#rand(0,1)" for name in loaded.input_names}, "#rand(0,1)"
    inputs = parse_case(given, loaded.inputs, defaults=defaults)
    parts = [f"{name}={given[name]}" for name in loaded.input_names if name in given]
    rest = [name for name in loaded.input_names if name not in given]
    if rest:
        parts.append(f"{', '.join(rest)} from {default_origin}")
    return inputs, "; ".join(parts)


def _timed(loaded: LoadedGraph, inputs: dict[str, torch.Tensor], iters: int) -> list[float]:
    if iters == 0:
        return []
    progress = Progress(iters, "calls")
    times = []
    for i in range(iters):
        start = time.perf_counter()
        _call(loaded, inputs)
        times.append(time.perf_counter() - start)
        progress.update(i + 1)
    progress.close()
    return times


def _batch(inputs: dict[str, torch.Tensor]) -> int | None:
    first = next(iter(inputs.values()), None)
    return first.shape[0] if first is not None and first.dim() > 0 else None


def percentile(times: list[float], fraction: float) -> float:
    ordered = sorted(times)
    return ordered[max(math.ceil(fraction * len(ordered)) - 1, 0)]


def _report(times: list[float], batch: int | None) -> None:
    median = statistics.median(times)
    print(f"latency over {len(times)} calls: min {min(times) * 1e3:.3f} ms, median {median * 1e3:.3f} ms, "
          f"p99 {percentile(times, 0.99) * 1e3:.3f} ms")
    throughput = f"throughput: {1 / median:.1f} calls/s"
    if batch:
        throughput += f", {batch / median:.1f} samples/s (batch {batch})"
    print(throughput)


def _describe_outputs(outputs: tuple | dict) -> None:
    named = outputs.items() if isinstance(outputs, dict) else enumerate(outputs)
    for name, tensor in named:
        stats = ""
        if tensor.numel() and not tensor.dtype.is_complex:
            values = tensor.double()
            stats = f", min {values.min().item():.4g}, max {values.max().item():.4g}, mean {values.mean().item():.4g}"
        dtype = str(tensor.dtype).removeprefix("torch.")
        print(f"output {name}: {tensor.device.type} {dtype}{list(tensor.shape)}{stats}")


def _check(loaded: LoadedGraph) -> int:
    if not loaded.testcases:
        print("check: the file has no embedded test cases (dump with input_data=... to embed some)")
        return 1
    results = []
    for index, case in enumerate(loaded.testcases):
        start = time.perf_counter()
        outputs = loaded(**fresh_inputs(case.inputs))
        seconds = time.perf_counter() - start
        outputs = list(outputs.values()) if isinstance(outputs, dict) else list(outputs)
        error = None if case.outputs is None else max_error(outputs, case.outputs)
        results.append(CaseResult(index, error, case.maxerr, seconds))
    for result in results:
        if result.max_error is None:
            print(f"check: case {result.index}: ran, no reference outputs (dumped with no_assert=True)")
        else:
            verdict = "ok" if result.passed else "FAILED"
            print(f"check: case {result.index}: max error {result.max_error:.3g} "
                  f"{'<=' if result.passed else '>'} maxerr {result.maxerr:.3g}: {verdict}")
    failed = sum(not r.passed for r in results)
    print(f"check: {len(results) - failed} of {len(results)} test cases passed")
    return 1 if failed else 0
