"""tracejit: a PyTorch-native tracing JIT.

Record a step function's aten ops once, then replay them: checked against the Python function on
every call, or compiled and run without it.
"""

from .errors import (
    CollectiveAbortedError,
    CollectiveMismatchError,
    GradientWarning,
    HostDependencyError,
    HostFreeMissWarning,
    LoadError,
    ReplayLevelWarning,
    SpecializationWarning,
    SymbolicTraceError,
    TraceCacheFullError,
    TraceMismatchError,
)
from .options import DTRConfig, GraphOptimizationConfig, SublinearMemoryConfig
from .record.modes import exclude_from_trace, is_tracing
from .serialize import load
from .trace import trace

__all__ = [
    "CollectiveAbortedError", "CollectiveMismatchError", "DTRConfig", "GradientWarning", "GraphOptimizationConfig",
    "HostDependencyError", "HostFreeMissWarning", "LoadError", "ReplayLevelWarning", "SpecializationWarning", "SublinearMemoryConfig",
    "SymbolicTraceError", "TraceCacheFullError", "TraceMismatchError", "exclude_from_trace", "is_tracing", "load",
    "trace",
]
__version__ = "0.1.0"
