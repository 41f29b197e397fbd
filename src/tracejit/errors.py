"""Exceptions raised by tracejit."""


class TraceMismatchError(RuntimeError):
    """A call of a traced function diverged from its recorded trace."""


class TraceCacheFullError(RuntimeError):
    """A call needed a new trace but `max_traces` traces exist already."""


class SymbolicTraceError(RuntimeError):
    """A `symbolic=True` first call needed data that symbolic recording does not compute."""
