"""Graph passes and the pipeline that runs them.

Every pass is a plain function `Graph -> Graph` in a file of its own. `run_pipeline` owns the
cross-cutting work: the order, timing, optional verification, and the history of graphs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..ir.graph import Graph
from ..ir.verify import verify
from .bucket_collectives import DEFAULT_BUCKET_BYTES, bucket_all_reduces
from .chain_linear import CanChain, chain_small_linear, linear_groups
from .cse import eliminate_common_subexpressions
from .dce import eliminate_dead_code
from .fold_constants import fold_constants
from .fuse_dimshuffle import make_views_static, worth_alone
from .fuse_linear_activation import fuse_linear_activation
from .fuse_reduce import CanFuseRow, fuse_row_reductions
from .group import CanFuse, group_elementwise
from .hoist import hoist_external_views
from .noop import remove_noop_views
from .plan_memory import plan_memory

Pass = Callable[[Graph], Graph]

# (minimum opt_level, pass), in order.
PIPELINE: list[tuple[int, Pass]] = [
    # Step 1: aliases the program does not need (detach, alias) become the value they alias.
    (1, remove_noop_views),
    # Step 2: constants captured with capture_as_const are folded through the ops they feed.
    (1, fold_constants),
    # Step 3: identical pure ops on identical inputs run once.
    (2, eliminate_common_subexpressions),
    # Step 4: ops whose results nothing uses and that write nothing observable disappear.
    (1, eliminate_dead_code),
    # Step 5: relu(addmm(...)) (Linear + ReLU) becomes one _addmm_activation call.
    (2, fuse_linear_activation),
    # Step 6: views of external tensors are computed once and kept across calls.
    (2, hoist_external_views),
    # Step 7: small matrix products (batch-1 Linear layers) become one kernel per chain (the C backend fills this).
    (2, chain_small_linear),
    # Step 8: per-tensor all-reduces become bucketed ones (torch.distributed), before grouping so
    # that the ops they move can still fuse.
    (2, bucket_all_reduces),
    # Step 9: elementwise chains become fused kernel nodes (the fused-kernel backends fill this).
    (2, group_elementwise),
    # Step 10: intermediate buffers get persistent storage, reused when lifetimes do not overlap.
    (2, plan_memory),
]


def pipeline(can_fuse: CanFuse | None = None, fusion_fuel: int | None = None, recompute: Pass | None = None,
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, can_fuse_row: CanFuseRow | None = None,
             graph_opt: bool = False, dimshuffle: bool = False,
             can_chain_linear: CanChain | None = None) -> list[tuple[int, Pass]]:
    """PIPELINE with the trace's choices bound: the fusion backend's `can_fuse` (and the fuel that
    bounds how many groups form, linear chains counted first) for the grouping pass, its
    `can_chain_linear` for chain_small_linear, the pass that chooses what backward
    recomputes (sublinear memory, dtr_config) after dead code elimination when requested, and the
    all-reduce bucket size. `can_fuse_row` (jit_fuse_reduce) adds fuse_row_reductions before the
    grouping pass; with `graph_opt` (any graph_opt_config fusion) lone `_foreach_` ops become kernels,
    with `dimshuffle` (jit_fuse_dimshuffle) lone ops reading strided tensors too, and views of
    arena buffers are made once (make_views_static, after plan_memory)."""
    passes = list(PIPELINE)
    if bucket_bytes != DEFAULT_BUCKET_BYTES:
        def bucket_all_reduces_of_size(graph: Graph) -> Graph:
            return bucket_all_reduces(graph, bucket_bytes)

        bucket_all_reduces_of_size.__name__ = "bucket_all_reduces"
        passes = [(level, bucket_all_reduces_of_size if p is bucket_all_reduces else p) for level, p in passes]
    if can_fuse is not None:
        alone = worth_alone(dimshuffle) if graph_opt else None

        def group_elementwise_for_backend(graph: Graph) -> Graph:
            fuel = fusion_fuel if fusion_fuel is None else fusion_fuel - len(linear_groups(graph))
            return group_elementwise(graph, can_fuse, fuel=fuel, alone=alone)

        group_elementwise_for_backend.__name__ = "group_elementwise"
        passes = [(level, group_elementwise_for_backend if p is group_elementwise else p) for level, p in passes]
    if can_chain_linear is not None:
        def chain_small_linear_for_backend(graph: Graph) -> Graph:
            return chain_small_linear(graph, can_chain_linear, fuel=fusion_fuel)

        chain_small_linear_for_backend.__name__ = "chain_small_linear"
        passes = [(level, chain_small_linear_for_backend if p is chain_small_linear else p) for level, p in passes]
    if can_fuse is not None and can_fuse_row is not None:
        def fuse_row_reductions_for_backend(graph: Graph) -> Graph:
            return fuse_row_reductions(graph, can_fuse, can_fuse_row)

        fuse_row_reductions_for_backend.__name__ = "fuse_row_reductions"
        at = next(i for i, (_, p) in enumerate(passes) if p.__name__ == "group_elementwise")
        passes.insert(at, (2, fuse_row_reductions_for_backend))
    if recompute is not None:
        at = next(i for i, (_, p) in enumerate(passes) if p is eliminate_dead_code) + 1
        passes.insert(at, (0, recompute))
    if dimshuffle:
        def plan_memory_with_kernels(graph: Graph) -> Graph:
            return plan_memory(graph, fused=True)

        plan_memory_with_kernels.__name__ = "plan_memory"
        passes = [(level, plan_memory_with_kernels if p is plan_memory else p) for level, p in passes]
        passes.append((2, make_views_static))
    return passes


@dataclass
class PipelineResult:
    graph: Graph
    history: list[tuple[str, Graph, float]] = field(default_factory=list)  # (pass name, graph after, seconds)


def run_pipeline(graph: Graph, opt_level: int, *, check: bool = False,
                 passes: list[tuple[int, Pass]] | None = None) -> PipelineResult:
    """Run every pass enabled at `opt_level` (0 runs none: the record executes as recorded).
    `check` verifies the graph it is given and the graph after each pass (TRACEJIT_VERIFY=1)."""
    if check:
        verify(graph, after="build_graph" if graph.provenance == "record" else graph.provenance)
    result = PipelineResult(graph, [("record", graph, 0.0)])
    for level, graph_pass in passes if passes is not None else PIPELINE:
        if opt_level < level:
            continue
        start = time.perf_counter()
        after = graph_pass(result.graph)
        seconds = time.perf_counter() - start
        after = after.with_nodes(after.nodes, f"{graph_pass.__name__} ({seconds * 1e3:.1f} ms)")
        if check:
            verify(after, after=f"pass {graph_pass.__name__}")
        result.graph = after
        result.history.append((graph_pass.__name__, after, seconds))
    return result
