"""The options of `tracejit.trace`, validated once when the decorator is applied."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# The `backend=` choices, the one list of them: backends/__init__.py resolves each, the CLI offers them.
BACKENDS = ("auto", "triton", "c", "aten", "reference")


@dataclass(frozen=True)
class SublinearMemoryConfig:
    """Recompute forward activations in backward instead of keeping them (gradient checkpointing).

    checkpoint_every: keep one of every N forward values that backward reads (default: sqrt of
        their number, which makes the activation memory grow as the square root of depth).
    lb_memory_mb: only values of at least this many MiB are dropped; smaller ones are kept.
    """

    checkpoint_every: int | None = None
    lb_memory_mb: float = 0.0

    def __post_init__(self) -> None:
        if self.checkpoint_every is not None and (not isinstance(self.checkpoint_every, int)
                                                  or self.checkpoint_every < 2):
            raise ValueError(f"SublinearMemoryConfig: checkpoint_every must be None or an int >= 2, "
                             f"got {self.checkpoint_every!r}")
        if (not isinstance(self.lb_memory_mb, (int, float)) or isinstance(self.lb_memory_mb, bool)
                or not 0 <= self.lb_memory_mb < float("inf")):  # NaN fails both comparisons
            raise ValueError(f"SublinearMemoryConfig: lb_memory_mb must be a number >= 0, got {self.lb_memory_mb!r}")


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


@dataclass(frozen=True)
class DTRConfig:
    """Train under a memory budget (MegEngine's `DTRConfig`): forward values that backward reads
    are recomputed in backward instead of kept, chosen so that the step's planned peak stays under
    `eviction_threshold`. MegEngine chooses at run time; tracejit plans once at compile time with
    every next use known (passes/recompute_budget.py).

    eviction_threshold: the budget for the step's own tensors, in bytes or as a string such as
        "512MB" or "2GiB"; 0 recomputes everything that can be recomputed.
    evictee_minimum_size: only values of at least this many bytes are recomputed (default 1 MiB).
    recomp_memory_factor, recomp_time_factor: the weights of size and recompute cost in the
        choice (score = cost ** time_factor / (bytes ** memory_factor * idle ops); lowest first).
    """

    eviction_threshold: int | str = 0
    evictee_minimum_size: int | str = 1 << 20
    recomp_memory_factor: float = 1.0
    recomp_time_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("eviction_threshold", "evictee_minimum_size"):
            object.__setattr__(self, name, _bytes_option(name, getattr(self, name)))
        for name in ("recomp_memory_factor", "recomp_time_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"DTRConfig: {name} must be a number >= 0, got {value!r}")


def _bytes_option(name: str, value: Any) -> int:
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", value)
        unit = match and _UNITS.get(match.group(2).lower() or "b")
        if not unit:
            raise ValueError(f"DTRConfig: {name} must be a number of bytes or a size such as '512MB' or '2GiB', "
                             f"got {value!r}")
        return int(float(match.group(1)) * unit)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"DTRConfig: {name} must be a number of bytes >= 0 or a size such as '512MB', got {value!r}")
    return value


# opt_level from which an unset (None) jit_fuse_reduce is on, as MegEngine turns its JIT fusion
# on at graph opt level 3: the row kernels that sum (softmax, layer norm, BatchNorm...) add in
# another order than eager
FUSION_OPT_LEVEL = 3
# opt_level from which what changes no number is on with an unset graph_opt_config field: the
# dimshuffle fusion (views made once, strided copies) and the row kernels that sum nothing (max
# pooling and its backward); the default opt_level=2 also fuses elementwise ops from there
EXACT_OPT_LEVEL = 2


@dataclass(frozen=True)
class GraphOptimizationConfig:
    """Which fusions beyond elementwise ops the compiler does (MegEngine's `GraphOptimizationConfig`):
    False for off, True for on, None (the default) to follow `opt_level`: what changes no number
    from opt_level=2, the summing row kernels from opt_level=3.

    jit_fuse_reduce: reductions (softmax and log-softmax, layer norm, cross-entropy's nll_loss,
        sum/mean/amax, and their backward) become one row kernel each, fused with the elementwise
        ops that feed and consume them (docs/kernels.md, "Row kernels"). Unset, the row kernels
        that give eager's numbers bit for bit (max pooling, forward and backward) are on from
        opt_level=2 already; False turns them off too.
    jit_fuse_dimshuffle (changes no number: on from opt_level=2): dimshuffles (views: transpose,
        permute, reshape, expand) cost nothing per
        call and copies read with strides: a view of a buffer the program keeps is made once when
        the program is built, and an elementwise op alone (a copy of a transposed tensor, a division
        of a broadcast one) runs as a strided kernel rather than an aten op.
    With either on, a lone `_foreach_` op (an optimizer's step count) is one multi-tensor kernel.
    """

    jit_fuse_reduce: bool | None = None
    jit_fuse_dimshuffle: bool | None = None

    def __post_init__(self) -> None:
        for name in ("jit_fuse_reduce", "jit_fuse_dimshuffle"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"GraphOptimizationConfig: {name} must be None, False or True, got {value!r}")

    def fuse_reduce(self, opt_level: int) -> bool:
        """Whether row kernels are on at `opt_level`."""
        return opt_level >= FUSION_OPT_LEVEL if self.jit_fuse_reduce is None else self.jit_fuse_reduce

    def fuse_exact_rows(self, opt_level: int) -> bool:
        """Whether the exact row kernels (max pooling, forward and backward) are on at `opt_level`."""
        return opt_level >= EXACT_OPT_LEVEL if self.jit_fuse_reduce is None else self.jit_fuse_reduce

    def fuse_dimshuffle(self, opt_level: int) -> bool:
        """Whether views are made once and copies run as strided kernels at `opt_level`."""
        return opt_level >= EXACT_OPT_LEVEL if self.jit_fuse_dimshuffle is None else self.jit_fuse_dimshuffle


@dataclass(frozen=True)
class TraceOptions:
    symbolic: bool = False
    capture_as_const: bool = False
    opt_level: int = 2
    max_traces: int = 8
    without_host: bool = False
    verify_every: int | None = None
    profiling: bool = False
    backend: str = "auto"
    sublinear_memory_config: Any = None
    record_only: bool = False
    dtr_config: Any = None
    graph_opt_config: Any = None
    # MegEngine's symbolic_shape: False, one trace per input shape; True, every input size symbolic
    # from the first call; None (automatic dynamic, torch.compile's dynamic=None), the first trace
    # static and, once a call differs only in sizes, a trace of symbolic sizes (docs/guide.md).
    symbolic_shape: bool | None = None

    def __post_init__(self) -> None:
        if self.symbolic_shape is not None and not isinstance(self.symbolic_shape, bool):
            raise TypeError(f"tracejit.trace: symbolic_shape must be None, False or True, got {self.symbolic_shape!r}")
        for name in ("symbolic", "capture_as_const", "without_host", "profiling", "record_only"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"tracejit.trace: {name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.opt_level, int) or isinstance(self.opt_level, bool) or not 0 <= self.opt_level <= 3:
            raise ValueError(f"tracejit.trace: opt_level must be an int from 0 to 3, got {self.opt_level!r}")
        if not isinstance(self.max_traces, int) or isinstance(self.max_traces, bool) or self.max_traces < 1:
            raise ValueError(f"tracejit.trace: max_traces must be a positive int, got {self.max_traces!r}")
        if self.verify_every is not None and (
            not isinstance(self.verify_every, int) or isinstance(self.verify_every, bool) or self.verify_every < 1
        ):
            raise ValueError(f"tracejit.trace: verify_every must be None or a positive int, got {self.verify_every!r}")
        if self.verify_every is not None and not self.without_host:
            raise ValueError("tracejit.trace: verify_every only applies with without_host=True "
                             "(checked replay already verifies every call)")
        if self.record_only:
            # record_only calls run eagerly and record; these options are about running a program
            for name, why in (("without_host", "skips the function to run the compiled program"),
                              ("symbolic", "runs the recorded program to compute the first call"),
                              ("profiling", "times the nodes of the compiled program"),
                              ("symbolic_shape", "records a trace of symbolic sizes and runs it per size")):
                if getattr(self, name):
                    raise ValueError(f"tracejit.trace: record_only=True never runs the compiled program, but "
                                     f"{name}=True {why}; use one or the other")
        if self.backend not in BACKENDS:
            raise ValueError(f"tracejit.trace: backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.sublinear_memory_config is not None:
            if not isinstance(self.sublinear_memory_config, SublinearMemoryConfig):
                raise TypeError(f"tracejit.trace: sublinear_memory_config must be a tracejit.SublinearMemoryConfig, "
                                f"got {type(self.sublinear_memory_config).__name__}")
        if self.graph_opt_config is not None and not isinstance(self.graph_opt_config, GraphOptimizationConfig):
            raise TypeError(f"tracejit.trace: graph_opt_config must be a tracejit.GraphOptimizationConfig, "
                            f"got {type(self.graph_opt_config).__name__}")
        if self.dtr_config is not None:
            if not isinstance(self.dtr_config, DTRConfig):
                raise TypeError(f"tracejit.trace: dtr_config must be a tracejit.DTRConfig, "
                                f"got {type(self.dtr_config).__name__}")
            if self.sublinear_memory_config is not None:
                raise ValueError("tracejit.trace: sublinear_memory_config and dtr_config both choose what backward "
                                 "recomputes; pass one of them")

    @property
    def fuse_reduce(self) -> bool:
        """graph_opt_config.jit_fuse_reduce resolved against opt_level."""
        return (self.graph_opt_config or GraphOptimizationConfig()).fuse_reduce(self.opt_level)

    @property
    def fuse_exact_rows(self) -> bool:
        """Whether max pooling's bit-exact row kernels are on (graph_opt_config.jit_fuse_reduce, opt_level)."""
        return (self.graph_opt_config or GraphOptimizationConfig()).fuse_exact_rows(self.opt_level)

    @property
    def fuse_dimshuffle(self) -> bool:
        """graph_opt_config.jit_fuse_dimshuffle resolved against opt_level."""
        return (self.graph_opt_config or GraphOptimizationConfig()).fuse_dimshuffle(self.opt_level)
