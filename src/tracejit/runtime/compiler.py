"""The one place a graph becomes a host-free program: passes, fused kernels, generated code.

Used by every path that runs a graph without its Python function: `without_host=True`, checked
replay at the API level (which runs the same program once the function has matched), and
`tracejit.load`. Checked replay at the aten level runs a `CheckedProgram` instead (trace.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..backends.kernels import compile_fused_nodes
from ..backends.rows import is_exact_row_op
from ..debug import bucket_bytes, dump_compilation, fusion_fuel, verify_passes
from ..ir.graph import Graph, Node
from ..options import GraphOptimizationConfig
from ..passes import CanFuseRow, Pass, PipelineResult, pipeline, run_pipeline
from ..passes.recompute_budget import plan_recomputation
from ..passes.rematerialize import rematerialize
from .profile import Profiler
from .program import HostFreeProgram


@dataclass(frozen=True)
class CompileOptions:
    opt_level: int = 2
    fusion: Any = None  # a resolved fusion backend (backends.resolve_backend), or None: no fused kernels
    sublinear: Any = None  # a SublinearMemoryConfig, or None
    dtr: Any = None  # a DTRConfig, or None
    fuse_reduce: bool = False  # row kernels for reductions (graph_opt_config.jit_fuse_reduce, resolved)
    fuse_dimshuffle: bool = False  # views made once, strided copies as kernels (jit_fuse_dimshuffle, resolved)
    # the row kernels that give eager's numbers bit for bit (max pooling); None: on from opt_level 2
    fuse_exact_rows: bool | None = None


def optimize(graph: Graph, options: CompileOptions) -> PipelineResult:
    """Run the compiler passes the options ask for."""
    can_fuse = options.fusion.can_fuse if options.fusion is not None else None
    fuel = fusion_fuel()
    can_fuse_row = _row_fusion(options)
    passes = pipeline(can_fuse, fusion_fuel=fuel, recompute=_recompute_pass(options), bucket_bytes=bucket_bytes(),
                      can_fuse_row=can_fuse_row, graph_opt=options.fuse_reduce or options.fuse_dimshuffle,
                      dimshuffle=options.fuse_dimshuffle,
                      can_chain_linear=options.fusion.can_chain_linear if options.fusion is not None else None)
    return run_pipeline(graph, options.opt_level, check=verify_passes(), passes=passes)


def _row_fusion(options: CompileOptions) -> CanFuseRow | None:
    """Which row ops become row kernels: all with jit_fuse_reduce, else only the exact ones."""
    if options.fusion is None:
        return None
    if options.fuse_reduce:
        return options.fusion.can_fuse_row
    exact = options.fuse_exact_rows
    if not (GraphOptimizationConfig().fuse_exact_rows(options.opt_level) if exact is None else exact):
        return None
    fusion = options.fusion

    def can_fuse_exact_row(graph: Graph, node: Node) -> bool:
        return is_exact_row_op(node.target) and fusion.can_fuse_row(graph, node)

    return can_fuse_exact_row


def _recompute_pass(options: CompileOptions) -> Pass | None:
    """The pass that chooses what backward recomputes, if the options ask for one."""
    sublinear, dtr = options.sublinear, options.dtr
    # with row kernels for reductions, a training batch norm's forward is one of them: recomputed
    # through aten, backward would read other bits than forward made ("same numbers" in the guide)
    batch_norm = not (options.fusion is not None and options.fuse_reduce)
    if sublinear is not None:
        def rematerialize_with_config(graph: Graph) -> Graph:
            return rematerialize(graph, sublinear.checkpoint_every, int(sublinear.lb_memory_mb * 2**20), batch_norm)

        rematerialize_with_config.__name__ = "rematerialize"
        return rematerialize_with_config
    if dtr is not None:
        def plan_recomputation_with_config(graph: Graph) -> Graph:
            return plan_recomputation(graph, dtr.eviction_threshold, dtr.evictee_minimum_size,
                                      dtr.recomp_memory_factor, dtr.recomp_time_factor, batch_norm)

        plan_recomputation_with_config.__name__ = "plan_recomputation"
        return plan_recomputation_with_config
    return None


def compile_kernels(graph: Graph, options: CompileOptions, name: str, program: str, history: list) -> dict:
    """The fused kernels of `graph` (node index -> callable); written out with TRACEJIT_DUMP_DIR."""
    kernels = compile_fused_nodes(graph, options.fusion.compile if options.fusion is not None else None)
    dump_compilation(name, program, history, kernels)
    return kernels


def compile_host_free(graph: Graph, options: CompileOptions, name: str,
                      profiler: Profiler | None = None) -> tuple[HostFreeProgram, list]:
    """Passes, kernels and generated code for a graph run without its function; returns the
    program and the pass history."""
    result = optimize(graph, options)
    if profiler is not None and result.graph.recompute_plan is not None:
        profiler.memory = {**result.graph.recompute_plan.as_dict(), "arena_bytes": result.graph.arena_bytes}
    kernels = compile_kernels(result.graph, options, name, "without_host", result.history)
    return HostFreeProgram(result.graph, profiler, kernels), result.history
