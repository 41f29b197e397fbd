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


class CollectiveMismatchError(RuntimeError):
    """The ranks of a torch.distributed job recorded different collectives for the same call (see
    docs/distributed.md); raised on every rank."""


class CollectiveAbortedError(RuntimeError):
    """A collective stopped waiting because a peer rank's traced call failed (see docs/distributed.md)."""


class ReplayLevelWarning(UserWarning):
    """A trace's checked calls stay at the aten level (slower): the torch API level cannot stand in
    for them, for the reason the message gives (see docs/guide.md, "How checked calls run")."""


class SpecializationWarning(UserWarning):
    """A symbolic-shape trace meets more input sizes than it keeps compiled programs for: sizes it
    let go of are compiled again when they come back (see docs/guide.md, "Many input sizes")."""


class HostFreeMissWarning(UserWarning):
    """Most calls of a `without_host=True` trace run the function (slower): a guard of the program
    fails on them, named in the message (see docs/guide.md, "without_host=True")."""


class GradientWarning(UserWarning):
    """A traced call's outputs require grad, but the way it replays returns them without an
    autograd graph (a backward pass after the call would not reach the parameters)."""
