"""`tracejit.trace`: the decorator that records a function once and replays it afterwards."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import TraceCacheFullError, TraceMismatchError
from .options import TraceOptions
from .record.modes import CallContext, traced_call
from .record.names import ExternalNames
from .record.record import Record
from .record.recorder import Recorder
from .record.symbolic import SymbolicRecorder
from .runtime.program import Program, build_program
from .runtime.realize import Realizer
from .runtime.replay import Replayer
from .signature import describe_signature, signature


@dataclass
class TraceEntry:
    """One recorded trace of the function, for one input signature."""

    key: tuple
    record: Record
    program: Program
    replays: int = 0


class trace:
    """Record a function's aten ops on its first call and replay them on later calls.

    Usable as ``@trace`` or ``@trace(**options)``. Positional arguments must be tensors (the
    inputs of the graph); keyword arguments that are tensors are inputs too, others (modules,
    optimizers, flags) pass through to the function.

    Options:
        symbolic: record the first call without computing it (no kernel runs while recording),
            then run the recorded program for real; see docs/symbolic.md.
        capture_as_const: freeze every external tensor (parameters, buffers) into the trace;
            a later call that sees another object or a modified one raises TraceMismatchError.
        opt_level: 0 executes the record as recorded; higher levels run the compiler passes.
        max_traces: how many input signatures get a trace of their own before calls fail.
    """

    def __new__(cls, function: Callable | None = None, **options: Any):
        if function is None:
            return functools.partial(cls, **options)
        return super().__new__(cls)

    def __init__(self, function: Callable | None = None, *, symbolic: bool = False,
                 capture_as_const: bool = False, opt_level: int = 2, max_traces: int = 8,
                 without_host: bool = False, verify_every: int | None = None, profiling: bool = False,
                 backend: str = "auto", sublinear_memory_config: Any = None):
        if not callable(function):
            raise TypeError(f"tracejit.trace: expected a function to trace, got {type(function).__name__}")
        self.options = TraceOptions(
            symbolic=symbolic, capture_as_const=capture_as_const, opt_level=opt_level,
            max_traces=max_traces, without_host=without_host, verify_every=verify_every,
            profiling=profiling, backend=backend, sublinear_memory_config=sublinear_memory_config,
        )
        self._function = function
        self._traces: dict[tuple, TraceEntry] = {}
        self._kwarg_is_tensor: dict[str, bool] = {}
        self._arg_names = _positional_names(function)
        functools.update_wrapper(self, function)

    # -- calling --------------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._check_arguments(args, kwargs)
        key = signature(args, kwargs)
        entry = self._traces.get(key)
        if entry is None:
            return self._record(key, args, kwargs)
        return self._replay(entry, args, kwargs)

    def _check_arguments(self, args: tuple, kwargs: dict) -> None:
        for i, value in enumerate(args):
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"tracejit: positional argument {i} ({self._arg_name(i)}) of {self.__name__}() must be "
                    f"a torch.Tensor, got {type(value).__name__}. Positional arguments are the inputs of "
                    f"the traced graph; pass modules, optimizers and flags as keyword arguments."
                )
        for name, value in kwargs.items():
            is_tensor = isinstance(value, torch.Tensor)
            recorded = self._kwarg_is_tensor.setdefault(name, is_tensor)
            if recorded != is_tensor:
                then, now = ("a tensor", type(value).__name__) if recorded else (
                    "a non-tensor", f"a tensor ({list(value.shape)})")
                raise TraceMismatchError(
                    f"{self.__name__}(): keyword argument {name!r} was {then} when traced and is {now} "
                    f"now. Tensor keyword arguments are graph inputs and other values pass through to "
                    f"the function, so a keyword cannot switch between the two."
                )

    def _record(self, key: tuple, args: tuple, kwargs: dict) -> Any:
        if len(self._traces) >= self.options.max_traces:
            seen = "\n".join(f"  {describe_signature(k, self._arg_names)}" for k in self._traces)
            raise TraceCacheFullError(
                f"{self.__name__}() was called with a new input signature, but max_traces="
                f"{self.options.max_traces} traces exist already.\n  new: "
                f"{describe_signature(key, self._arg_names)}\nrecorded signatures:\n{seen}\n"
                f"Pad or bucket inputs to a few shapes, or raise max_traces."
            )
        recorder = self._new_recorder(kwargs)
        recorder.bind_inputs(args, kwargs, [self._arg_name(i) for i in range(len(args))])
        try:
            with traced_call(CallContext(self, recorder, self.options.capture_as_const)):
                result = self._function(*args, **kwargs)
            record = recorder.finish(result)
            program = self._compile(record)
        except BaseException:
            recorder.abandon()  # symbolic: run what was recorded, so side effects match an eager call
            raise
        recorder.complete(program)  # symbolic: run the program for real, filling every placeholder
        self._traces[key] = TraceEntry(key, record, program)
        return result

    def _new_recorder(self, kwargs: dict) -> Recorder:
        names = ExternalNames(self._function, kwargs)
        if self.options.symbolic:
            return SymbolicRecorder(self.__name__, capture_as_const=self.options.capture_as_const,
                                    external_names=names, compile=self._compile, runner=Realizer())
        return Recorder(self.__name__, capture_as_const=self.options.capture_as_const, external_names=names)

    def _replay(self, entry: TraceEntry, args: tuple, kwargs: dict) -> Any:
        record = entry.record
        replayer = Replayer(
            entry.program, args, kwargs,
            may_rerecord=record.created_state and not record.rerecorded and entry.replays == 0,
            external_names=ExternalNames(self._function, kwargs),
            capture_as_const=self.options.capture_as_const,
        )
        with traced_call(CallContext(self, replayer, self.options.capture_as_const)):
            result = self._function(*args, **kwargs)
        new_record = replayer.finish(result)
        if new_record is not None:
            self._traces[entry.key] = TraceEntry(entry.key, new_record, self._compile(new_record))
        else:
            entry.replays += 1
        return result

    def _compile(self, record: Record) -> Program:
        return build_program(record)

    # -- introspection --------------------------------------------------------------------------

    @property
    def records(self) -> list[Record]:
        """The current record of every input signature, oldest first."""
        return [entry.record for entry in self._traces.values()]

    def listing(self) -> str:
        """The records as numbered op listings with source lines."""
        return "\n\n".join(record.listing() for record in self.records)

    def _arg_name(self, index: int) -> str:
        if index < len(self._arg_names):
            return self._arg_names[index]
        return f"arg{index}"


def _positional_names(function: Callable) -> list[str]:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    names = []
    for p in parameters:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return names
