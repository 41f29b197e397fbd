"""Exceptions raised by tracejit."""


class TraceMismatchError(RuntimeError):
    """A call of a traced function diverged from its recorded trace."""


class TraceCacheFullError(RuntimeError):
    """A call needed a new trace but `max_traces` traces already exist."""


class HostDependencyError(RuntimeError):
    """without_host=True cannot skip a function whose trace depends on values only the host computes."""


class SymbolicTraceError(RuntimeError):
    """A `symbolic=True` first call needed data that symbolic recording does not compute."""


class LoadError(ValueError):
    """A file given to `tracejit.load` is not a valid, safe tracejit graph (see docs/format.md)."""
