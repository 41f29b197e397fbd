"""The options of `tracejit.trace`, validated once when the decorator is applied."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BACKENDS = ("auto", "triton", "c", "aten")


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

    def __post_init__(self) -> None:
        for name in ("symbolic", "capture_as_const", "without_host", "profiling"):
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
        if self.backend not in BACKENDS:
            raise ValueError(f"tracejit.trace: backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        unimplemented = {
            "without_host": self.without_host,
            "profiling": self.profiling,
            "sublinear_memory_config": self.sublinear_memory_config is not None,
            "backend": self.backend != "auto",
        }
        for name, requested in unimplemented.items():
            if requested:
                raise NotImplementedError(
                    f"tracejit.trace: the option {name}={getattr(self, name)!r} is not implemented yet; "
                    f"leave it at its default"
                )
