"""`tracejit.trace`: the decorator that records a function once and replays it afterwards."""

from __future__ import annotations

import dataclasses
import functools
import gc
import inspect
import os
import pickle
import threading
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .backends import resolve_backend
from .errors import (
    GradientWarning,
    HostDependencyError,
    HostFreeMissWarning,
    ReplayLevelWarning,
    SpecializationWarning,
    SymbolicTraceError,
    TraceCacheFullError,
    TraceMismatchError,
)
from .ir import build_graph
from .ir.to_fx import to_fx
from .methods import UnboundMethod, bound_trace
from .options import TraceOptions
from .record.amp import ScalerStages
from .record.api import ApiTracer, record_refusal
from .record.ddp_calls import is_ddp
from .record.handles import HandleMap
from .record.modes import CallContext, check_not_nested, is_tracing, traced_call
from .record.names import ExternalNames, has_lazy_tensors, lazy_modules, roots_of, same_value
from .record.placeholders import SYMBOLIC_LIMITS
from .record.ranks import post_failure
from .record.reached import Seen
from .record.reads import reads_state_it_changes, storage_root
from .record.record import Kind, Record
from .record.recorder import Recorder
from .record.rng import rng_dependency
from .record.schedulers import SchedulerStates
from .record.source import traceback_location, user_location
from .record.specialize import record_symbols, specialize
from .record.symbolic import SymbolicRecorder
from .record.symbolic_shapes import SymbolicSizes, tensor_inputs
from .runtime import shape_traces
from .runtime.api_replay import (
    BEFORE_THE_FUNCTION,
    ApiInterrupted,
    ApiProgram,
    NotReplayable,
    gradient_owners,
    held_after_calls,
    run_checked,
)
from .runtime.compiler import CompileOptions, compile_host_free, compile_kernels, optimize
from .runtime.ddp_stand_in import kept_by_ddp
from .runtime.early_finish import read_exports
from .runtime.gc_pause import collector_paused
from .runtime.hostfree import MISS, GuardFailure, HostFreeRunner, refuse_stateful_comm_hooks
from .runtime.profile import CLOCK, ProfileAccess, Profiler
from .runtime.program import CheckedProgram, HostFreeProgram
from .runtime.python_state import python_state, refuse_python_state_changes
from .runtime.realize import Realizer
from .runtime.replay import OPTIMIZER_BRANCHES, Replayer
from .runtime.shape_traces import ShapeTrace, all_dims, family, input_shapes, why_static, why_static_inputs
from .runtime.stats import TraceStats
from .runtime.turns import register, take_turn
from .runtime.undo import StateSnapshot, is_fake
from .runtime.variants import ShapeVariants
from .signature import (
    call_context_key,
    describe_signature,
    gradient_byte,
    gradient_snapshot,
    gradient_state,
    input_grads,
    reached_gradient_state,
    signature,
    under_saved_tensor_hooks,
    user_modes,
)

# calls in a row that missed the fast path for one cause (an API-level program that could not be
# bound, containers a without_host call rearranged) before a warning says so: one is a call's own
# business (a tensor reached for the first time, a cache filled once), three are a pattern
_CALLS_IN_A_ROW = 3


@dataclass
class TraceEntry:
    """One recorded trace of the function, for one input signature."""

    key: tuple
    record: Record
    program: CheckedProgram
    grad_state: tuple | None  # gradient state of keyword modules it was recorded in; None: irrelevant
    replays: int = 0
    host_free: HostFreeRunner | None = None  # without_host: the program run without the function
    host_free_error: Exception | None = None  # why this trace cannot run without its function
    host_free_calls: int = 0
    host_free_misses: int = 0  # of those, the calls whose guards failed (they ran the function)
    warned_misses: bool = False
    rearranging_calls: int = 0  # without_host: calls in a row that rearranged containers (ran the function)
    history: list = field(default_factory=list)  # (pass, graph, seconds) of the host-free pipeline
    handles: HandleMap | None = None  # the handle map of the last call that ran the function (weak)
    api: ApiProgram | None = None  # checked replay at the torch API level (runtime/api_replay.py)
    api_refused: str | None = None  # why this trace replays at the aten level only
    api_fallbacks: int = 0  # API-level calls that had to run at the aten level instead
    api_last_fallback: str | None = None
    warned_ran_twice: bool = False  # a diverging call ran the function again: said once per trace
    api_unbound: int = 0  # aten-level calls in a row whose API-level program could not be bound
    optimizer_branches: int = 0  # calls recorded again at a change of an optimizer step()'s ops (replay.py)
    # keyword optimizers that held state after the recorded call: one found empty later creates it again
    stateful_optimizers: frozenset = frozenset()
    # of those, the ones that had none when it began: the recorded call created their state, which
    # a later call with state does not (models trained in turn, each with its own optimizer)
    fresh_optimizers: frozenset = frozenset()
    # (name, how many parameters have state) of the keyword optimizers after the recorded call: one
    # with fewer later (`opt.state.pop(p)` for a head re-initialized) creates that state again
    state_sizes: tuple = ()
    variants: ShapeVariants | None = None  # programs per data-dependent output size; None: one so far
    shape_trace: ShapeTrace | None = None  # symbolic_shape: the trace of symbolic sizes it specializes
    tensor_kwargs: tuple[str, ...] | None = None  # its tensor keyword arguments, sorted (the signature fixes them)
    # parameters it reads that no keyword module holds (weakly), and their gradient state when
    # its recorded call began (signature.reached_gradient_state: requires_grad, has a .grad)
    reached: tuple = ()
    reached_bits: int = 0

    @property
    def serving_program(self) -> CheckedProgram | HostFreeProgram:
        """The program that computes this trace's calls now: the host-free one once it exists
        (without_host, or checked replay at the API level), else the aten-level checked program."""
        return self.host_free.program if self.host_free is not None else self.program

    @property
    def provisional(self) -> bool:
        """Its first replay may still re-record (the recorded call created Python-side state)."""
        return self.record.created_state and not self.record.rerecorded and self.replays == 0


class trace(ProfileAccess):
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
        without_host: later calls run the compiled program without the Python function.
        verify_every: with without_host, every N-th call runs as a checked replay.
        profiling: time every node; see get_profile() and export_chrome_trace().
        backend: fused-kernel backend, "auto", "c", "triton", "aten" (no fusion) or "reference".
        sublinear_memory_config: recompute every N-th forward activation in backward (a
            tracejit.SublinearMemoryConfig).
        dtr_config: recompute forward activations in backward so that the step's planned peak
            stays under a threshold (a tracejit.DTRConfig); see docs/guide.md.
        record_only: every call runs the function eagerly and records it (for `dump`); the
            compiled program never runs.
        graph_opt_config: fusions beyond elementwise ops (a tracejit.GraphOptimizationConfig);
            its unset fields follow opt_level (jit_fuse_reduce on from 3, jit_fuse_dimshuffle from 2).
        symbolic_shape: False, one trace per input shape; True, every input size is a symbol from
            the first call; None (default), the first trace static and a later call that differs
            only in sizes records a trace with every input size symbolic (see docs/guide.md).
    """

    def __new__(cls, function: Callable | None = None, **options: Any):
        if function is None:
            return functools.partial(cls, **options)
        return super().__new__(cls)

    def __init__(self, function: Callable | None = None, *, symbolic: bool = False,
                 capture_as_const: bool = False, opt_level: int = 2, max_traces: int = 8,
                 without_host: bool = False, verify_every: int | None = None, profiling: bool = False,
                 backend: str = "auto", sublinear_memory_config: Any = None, record_only: bool = False,
                 dtr_config: Any = None, graph_opt_config: Any = None, symbolic_shape: bool | None = None):
        # `@trace` over `@staticmethod` / `@classmethod`: the function they wrap, bound as they bind it (__get__)
        self._descriptor = type(function) if isinstance(function, (staticmethod, classmethod)) else None
        if self._descriptor is not None:
            function = function.__func__
        if not callable(function):
            raise TypeError(f"tracejit.trace: expected a function to trace, got {type(function).__name__}")
        self.options = TraceOptions(
            symbolic=symbolic, capture_as_const=capture_as_const, opt_level=opt_level,
            max_traces=max_traces, without_host=without_host, verify_every=verify_every,
            profiling=profiling, backend=backend, sublinear_memory_config=sublinear_memory_config,
            record_only=record_only, dtr_config=dtr_config, graph_opt_config=graph_opt_config,
            symbolic_shape=symbolic_shape,
        )
        self._function = function
        # signature -> the traces recorded for it, one per gradient state when that matters
        self._traces: dict[tuple, list[TraceEntry]] = {}
        self._shape_traces: list[ShapeTrace] = []  # symbolic_shape: traces of symbolic sizes, oldest first
        self._static_families: set = set()  # symbolic_shape=None: kinds of call whose symbolic recording failed
        # DistributedDataParallel modules the function reaches without a keyword (a closure, a
        # global, inside a keyword module): their state selects traces too (see _watch_ddp)
        self._watched_ddp: list[weakref.ref] = []
        self._kwarg_is_tensor: dict[str, bool] = {}
        self._arg_names = _positional_names(function)
        functools.update_wrapper(self, function)
        if "__name__" not in self.__dict__:  # a functools.partial, a callable object, a module
            self.__name__ = getattr(getattr(function, "func", None), "__name__", None) or type(function).__name__
        self._profiler = Profiler(self.__name__) if profiling else None
        self._fusion = resolve_backend(backend)
        self._compile_options = CompileOptions(opt_level, self._fusion, sublinear_memory_config, dtr_config,
                                               fuse_reduce=self.options.fuse_reduce,
                                               fuse_dimshuffle=self.options.fuse_dimshuffle,
                                               fuse_exact_rows=self.options.fuse_exact_rows)
        # Fused kernels are generated for fixed sizes: specializations of a symbolic-shape trace run unfused
        self._unfused_options = replace(self._compile_options, fusion=None, fuse_reduce=False, fuse_dimshuffle=False,
                                        fuse_exact_rows=False)
        # the generated calls of the two traces used last without the host, the latest first: calls
        # alternating between two signatures (a gradient-accumulation flag, two batch sizes) find
        # theirs there (see _fast_call's setter)
        self._fast_calls: tuple = (None, None)
        self._fast_entries: tuple = (None, None)  # their traces
        # the traces the last checked calls at the API level used, the latest first: the next call
        # tries their signatures (HostFreeRunner.admit) before computing its own and looking it up
        self._fast_apis: tuple = (None, None)
        self._state_before: dict = {}  # without_host: python_state() when the current call began
        self._seen_in_call: Seen | None = None  # without_host: what the call's function changed (record/reached.py)
        self._warned_rearranging = False  # without_host: said that rearranged containers run every call
        # without_host: the plain values the last call that ran the function changed, by name: the
        # values it found and left (see _refuse_setting_changes)
        self._settings_changed: dict[tuple, dict[str, list]] = {}  # per input signature
        # per input signature, the lazy modules a call found not materialized and left so (the
        # function did not run them): they do not keep the next calls from recording (see _run_materializing)
        self._lazy_left: dict[tuple, weakref.WeakSet] = {}
        self._warned_modes = False  # the warning of _run_under_modes, once
        self._no_lazy_modules: set[tuple] = set()  # (signature, ids of the keywords) found without lazy modules
        # A trace's program reuses its buffers, and its checker and stand-ins hold one call's state:
        # calls from several threads take turns (see __call__)
        self._lock = threading.Lock()
        self._running_on: int | None = None  # the thread whose call holds the lock
        register(self)
        self.stats = TraceStats()  # what the calls did; see runtime/stats.py
        # Checked replay at the torch API level (docs/design.md); TRACEJIT_REPLAY=aten keeps every
        # checked call at the aten level. Profiling times aten-level nodes, so it keeps them too.
        self._api_level = (not without_host and not profiling
                           and os.environ.get("TRACEJIT_REPLAY", "api").lower() != "aten")

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        """`@tracejit.trace` on a method: `obj.method` is a traced function of its own per instance,
        as with torch.compile (see methods.py). Over a staticmethod it is the trace itself; over a
        classmethod, or under one (`@classmethod @tracejit.trace`, whose __get__ passes the class
        here), the traced function of the class. Looked up on the class (`Base.forward(self, x)`),
        it takes the instance first."""
        if self._descriptor is staticmethod:
            return self
        if self._descriptor is classmethod:
            return bound_trace(self, owner if owner is not None else type(instance))
        if instance is None:
            return self if owner is None else UnboundMethod(self)
        return bound_trace(self, instance)

    # -- copying ------------------------------------------------------------------------------
    # A trace's records hold the tensors of the calls that made them: a copy is the same function
    # with the same options and no traces yet (as a copied model's traced methods, methods.py).
    # Pickling stores a reference, as for a plain function: a module-level decorated function
    # unpickles as that module's trace.

    def __copy__(self) -> trace:
        function = self._function if self._descriptor is None else self._descriptor(self._function)
        return type(self)(function, **dataclasses.asdict(self.options))

    def __deepcopy__(self, memo: dict) -> trace:
        return self.__copy__()

    def __reduce__(self) -> str:
        qualname = self.__dict__.get("__qualname__")
        if qualname is None:  # a callable object, a module, a functools.partial: nothing to look up by name
            raise pickle.PicklingError(
                f"tracejit: cannot pickle the traced {self.__name__}: a traced function pickles by its qualified "
                f"name, which only a module-level function has, and this one wraps a "
                f"{type(self._function).__name__} object. Pickle what it wraps (the module's state_dict) and "
                f"trace it again after loading.")
        return qualname

    # -- calling --------------------------------------------------------------------------------

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:  # a traced method's instance is keyword `self`
        thread = threading.get_ident()
        if self._running_on == thread:
            raise RuntimeError(
                f"tracejit: {self.__name__}() was called again while its own call runs on this thread "
                f"(from an exclude_from_trace() block or a hook). A traced function cannot call itself; "
                f"call the undecorated function there.")
        lock = self._lock
        if not lock.acquire(False):
            take_turn(self, thread)  # another thread's call finishes first: they share the program's buffers
        try:
            self._running_on = thread
            try:
                stats = self.stats
                stats.calls += 1
                fast, before = self._fast_calls
                if fast is not None and not is_tracing():  # the last host-free traces used, checking their signatures
                    result = fast(args, kwargs)
                    if result is MISS and before is not None:
                        result = before(args, kwargs)
                        if result is not MISS:
                            self._fast_calls = (before, fast)
                            self._fast_entries = self._fast_entries[::-1]
                    if result is not MISS:
                        stats.host_free_calls += 1
                        entry = self._fast_entries[0]
                        entry.host_free_calls += 1  # for HostFreeMissWarning's share of misses
                        if entry.shape_trace is not None:  # a size in use (the specializations' LRU)
                            entry.shape_trace.used(entry.key)
                        return result
                return self._after_the_host_free_path(args, kwargs)
            except BaseException as error:
                post_failure(self.__name__, error, self.records)  # torch.distributed: peers stop waiting
                raise
            finally:
                self._running_on = None
        finally:
            lock.release()

    def _after_the_host_free_path(self, args: tuple, kwargs: dict) -> Any:
        for entry in self._fast_apis:  # the last traces checked at the API level, their signatures checked
            if entry is None:
                break
            if entry.api is not None and entry.host_free.admit(args, kwargs) is True and not is_tracing():
                if entry.shape_trace is not None:  # a size in use (the specializations' LRU)
                    entry.shape_trace.used(entry.key)
                return self._replay_api(entry, args, kwargs)
        if self._profiler is None:
            return self._call(args, kwargs)
        start = CLOCK()
        recordings = self._recordings()
        try:
            return self._call(args, kwargs)
        finally:  # a call that raised ran nodes too: it counts, or rows would count more calls than the summary
            self._profiler.call_done(start, recorded=self._recordings() != recordings)

    def _recordings(self) -> int:
        """Calls so far that recorded (a first record, a re-record, a variant): their time is the
        eager run and the compile, kept apart from replayed calls in the profile."""
        stats = self.stats
        return stats.records + stats.rerecords + stats.shape_variants + stats.branch_variants

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if not (torch.is_autocast_cache_enabled() and (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))):
            return self._run_call(args, kwargs)
        # Autocast caches its casts of the weights for the context it was entered in: a trace
        # recorded with the cache would hold that context's cast as an external, which the next
        # context (autocast entered around each step) replaces. Without the cache the casts are
        # ops of the trace, recomputed on every call, with the same values.
        torch.set_autocast_cache_enabled(False)
        try:
            return self._run_call(args, kwargs)
        finally:
            torch.set_autocast_cache_enabled(True)

    def _run_call(self, args: tuple, kwargs: dict) -> Any:
        check_not_nested(self.__name__)
        new_kinds = self._check_arguments(args, kwargs)
        if new_kinds is not None:
            return self._run_fixing_kinds(new_kinds, args, kwargs)
        modes = user_modes()
        if modes:
            return self._run_under_modes(modes, args, kwargs)
        if self.options.without_host:  # what the function changes that a host-free call would not
            self._state_before = python_state(self._function, kwargs)
            self._seen_in_call = None
        key = signature(args, kwargs)
        entry = self._lookup(key, kwargs)
        if self.options.record_only:  # as MegEngine's: every call is an eager, recording one
            return self._record(key, args, kwargs, replacing=entry)
        if entry is not None and entry.shape_trace is not None and entry.shape_trace.provisional:
            entry = None  # its symbolic-shape trace is recorded again (see _specialize), not this size alone
        if entry is None:
            entry = self._specialize(key, args, kwargs)
        if entry is None:
            return self._record(key, args, kwargs)
        if self.options.without_host:
            if entry.host_free_error is not None:
                raise entry.host_free_error
            if entry.host_free is not None and entry.host_free.call is not None:
                entry.host_free_calls += 1
                every = self.options.verify_every
                if not (every and entry.host_free_calls % every == 0):
                    result = entry.host_free.call(args, kwargs)
                    if result is not MISS:
                        self.stats.host_free_calls += 1
                        self._install_fast_call(entry)
                        return result
                    self.stats.host_free_misses += 1
                    entry.host_free_misses += 1
                    if not entry.warned_misses and entry.host_free_misses >= 3 \
                            and entry.host_free_misses * 2 > entry.host_free_calls:
                        entry.warned_misses = True
                        self._warn_misses(entry, args, kwargs)
                    # the world changed under the trace: run the function, which rebinds
        if entry.api is not None:
            return self._replay_api(entry, args, kwargs)
        return self._replay(entry, args, kwargs)

    def _run_fixing_kinds(self, new_kinds: dict[str, bool], args: tuple, kwargs: dict) -> Any:
        """A call passing keywords whose kind (tensor or not) no recorded call fixed yet: they are
        fixed once it returns with a trace recorded (by it or before). One that raised recorded
        nothing and fixes nothing: the next call records again, with whatever kinds it passes."""
        kinds = self._kwarg_is_tensor
        kinds.update(new_kinds)
        try:
            result = self._run_call(args, kwargs)
        except BaseException:
            for name in new_kinds:
                del kinds[name]
            raise
        if not self._recordings():  # ran eagerly (under a caller's torch mode, materializing a lazy module)
            for name in new_kinds:
                del kinds[name]
        return result

    def _replay_api(self, entry: TraceEntry, args: tuple, kwargs: dict) -> Any:
        """A checked call at the torch API level; one that diverges runs at the aten level instead."""
        names = entry.tensor_kwargs
        if names is None:
            names = entry.tensor_kwargs = tuple(k for k, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor))
        inputs = [*args, *map(kwargs.__getitem__, names)] if names else list(args)
        interrupted = None
        try:
            result, fallback = run_checked(entry.api, self, args, kwargs, inputs)
        except ApiInterrupted as stop:
            # Eager's effects up to the raise (the update before a KeyboardInterrupt) are owed:
            # the aten level runs the call, raising the function's exception again where it does.
            # One that came from outside the function's logic (Ctrl-C) may not come again: it is
            # raised once that call completes, so it is never lost.
            result, fallback, interrupted = None, str(stop), stop.raised
        if fallback is None:
            if self._profiler is None and not entry.api.autocast:  # autocast calls need _call's cache switch
                self._fast_api = entry
            entry.replays += 1
            self.stats.checked_replays += 1
            self.stats.api_replays += 1
            return result
        entry.api_last_fallback = fallback
        self.stats.api_fallbacks += 1
        # placeholders the function kept before it diverged (`history.append(loss.detach())`): the
        # run that computes nothing left them there, so they get the values the aten level computes
        stranded = entry.api.kept_placeholders()
        entry.api = None  # the aten-level call rebuilds it from what it sees
        # An exception the aten level raises too is the function's own (bad data, a retried call):
        # it says nothing against the API level. One that only the API level raised counts.
        handles: list[HandleMap] = []
        try:
            result = self._replay(entry, args, kwargs, handles)
        finally:
            if stranded:
                _fill_stranded(stranded, handles[0].live() if handles else {})
        if interrupted is not None:
            raise interrupted
        entry.api_fallbacks += 1
        if not entry.warned_ran_twice and fallback not in BEFORE_THE_FUNCTION:
            entry.warned_ran_twice = True
            self._warn_replay_level(
                f"a checked call of {self.__name__}() diverged at the torch API level ({fallback}) and ran the "
                f"function again at the aten level: its Python side effects before that point (a counter, a list "
                f"it appends to, a print) happened twice in this call. Said once per trace; "
                f"traced.stats.api_fallbacks counts such calls.")
        if entry.api_fallbacks >= 3 and entry.api_fallbacks * 4 > entry.replays:
            self._refuse_api(entry, f"{entry.api_fallbacks} calls diverged at the API level (last: {fallback})")
            entry.api = self._fast_api = None  # the replay had built it again
        return result

    def _gradient_state(self, kwargs: dict) -> tuple[int, ...]:
        return gradient_state(kwargs, self._watched_ddp)

    @staticmethod
    def _reached_parameters(kwargs: dict, recorder: Recorder, record: Record) -> tuple[tuple, int]:
        """The parameters the trace reads that no keyword module holds (a closure's model), held
        weakly, and their gradient state: which of them require grad and which held a `.grad` when
        the call began selects this trace as a keyword module's state does (`TraceEntry.reached`).
        Parameters rather than their modules: a module may be made anew on each call
        (`model.net[1:]`) around the same parameters. The `.grad` as the recorder found it before
        the call touched it: the recording call creates the gradients a later call accumulates into."""
        held = {id(p) for value in kwargs.values() if isinstance(value, torch.nn.Module) for p in value.parameters()}
        reached = [(h, t) for h, t in recorder.handles.live().items()
                   if record.tensors[h].kind is Kind.EXTERNAL and id(t) not in held and isinstance(t, torch.nn.Parameter)]
        state = bytearray()
        for handle, tensor in reached:
            at_start = recorder.grad_at_start(handle)
            state.append(gradient_byte(tensor.requires_grad, tensor.grad is not None if at_start is None else at_start))
        return tuple(weakref.ref(t) for _, t in reached), int.from_bytes(state)

    def _watch_ddp(self, seen: list, kwargs: dict) -> bool:
        """Watch the DDP modules a recording call ran that are not keyword arguments themselves;
        True if there are new ones (the call's gradient state did not include them)."""
        keywords = {id(value) for value in kwargs.values()}
        watched = {id(ref()) for ref in self._watched_ddp}
        new = [module for module in seen if is_ddp(module) and id(module) not in keywords and id(module) not in watched]
        self._watched_ddp += [weakref.ref(module) for module in new]
        return bool(new)

    def _lookup(self, key: tuple, kwargs: dict) -> TraceEntry | None:
        entries = self._traces.get(key)
        if not entries:
            return None
        if entries[0].shape_trace is not None:
            entries[0].shape_trace.used(key)
        if entries[0].grad_state is None:
            return entries[0]
        state = self._gradient_state(kwargs)
        return next((e for e in entries if e.grad_state == state
                     and (not e.reached or reached_gradient_state(e.reached) == e.reached_bits)), None)

    def _entries(self) -> list[TraceEntry]:
        return [entry for entries in self._traces.values() for entry in entries]

    def _trace_count(self) -> int:
        """Traces held, against max_traces: each variant of a data-dependent output size counts, and
        a symbolic-shape trace counts once, whatever the number of sizes it serves."""
        return len(self._shape_traces) + sum(len(e.variants) if e.variants is not None else 1
                                             for e in self._entries() if e.shape_trace is None)

    def _check_arguments(self, args: tuple, kwargs: dict) -> dict[str, bool] | None:
        """Refuse arguments no trace can take, before anything runs; return the kinds (tensor or
        not) of the keywords whose kind no recorded call fixed yet, None if there are none."""
        for i, value in enumerate(args):
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"tracejit: positional argument {i} ({self._arg_name(i)}) of {self.__name__}() must be "
                    f"a torch.Tensor, got {type(value).__name__}. Positional arguments are the inputs of "
                    f"the traced graph; pass modules, optimizers and flags as keyword arguments."
                )
            if value.is_nested or value.is_quantized:
                raise self._unsupported_tensor(f"positional argument {i} ({self._arg_name(i)})", value)
        kinds = self._kwarg_is_tensor
        new_kinds = None
        for name, value in kwargs.items():
            is_tensor = isinstance(value, torch.Tensor)
            if is_tensor and (value.is_nested or value.is_quantized):
                raise self._unsupported_tensor(f"keyword argument {name!r}", value)
            recorded = kinds.get(name)
            if recorded is None:
                new_kinds = new_kinds or {}
                new_kinds[name] = is_tensor
            elif recorded != is_tensor:
                then, now = ("a tensor", type(value).__name__) if recorded else (
                    "a non-tensor", f"a tensor ({list(value.shape)})")
                raise TraceMismatchError(
                    f"{self.__name__}(): keyword argument {name!r} was {then} when traced and is {now} "
                    f"now. Tensor keyword arguments are graph inputs and other values pass through to "
                    f"the function, so a keyword cannot switch between the two."
                )
        return new_kinds

    def _unsupported_tensor(self, where: str, value: torch.Tensor) -> NotImplementedError:
        """A nested or quantized tensor input: the signature, the stand-ins and the program all take
        dense tensors of plain dtypes (sparse and mkldnn ones are refused at the op that uses them)."""
        if value.is_nested:
            what, instead = f"a nested tensor (layout {value.layout})", "torch.nested.to_padded_tensor(x, 0.0)"
        else:
            what, instead = f"a quantized tensor ({value.dtype})", "x.dequantize()"
        return NotImplementedError(
            f"tracejit: {where} of {self.__name__}() is {what}: traced calls take strided (dense) tensors "
            f"that are neither nested nor quantized. Pass {instead}, or call the function undecorated."
        )

    def _record(self, key: tuple, args: tuple, kwargs: dict, replacing: TraceEntry | None = None) -> Any:
        lazy = self._lazy_modules(key, kwargs)
        if lazy:
            return self._run_materializing(key, lazy, args, kwargs)
        plan = self._symbolic_plan(key) if replacing is None else None
        if plan is not None:
            result = self._record_symbolic(key, args, kwargs, *plan)
            if result is not _STATIC:
                return result
            # The automatic mode tried symbols and the function cannot run on stand-ins of
            # symbolic size: the call records the static trace of its sizes, and the calls of its
            # kind do from now on -- unless the static run raises too (an error eager raises as well,
            # which says nothing against symbols).
            result = self._record_static(key, args, kwargs, replacing)
            self._static_families.add(family(key))
            return result
        return self._record_static(key, args, kwargs, replacing)

    def _lazy_modules(self, key: tuple, kwargs: dict) -> list[torch.nn.Module]:
        """The lazy modules not materialized yet that the function reaches, but those an eager call
        of this signature left lazy (see _run_materializing)."""
        # A module never becomes lazy again: keyword objects found without lazy modules are not
        # walked again (the walk costs milliseconds for a large model, on every aten-level call)
        objects = (key, tuple(map(id, kwargs.values())))
        if objects in self._no_lazy_modules:
            return []
        left = self._lazy_left.get(key, ())
        lazy = [module for module in lazy_modules(self._function, kwargs) if module not in left]
        if not lazy and len(self._no_lazy_modules) < 64:
            self._no_lazy_modules.add(objects)
        return lazy

    def _run_materializing(self, key: tuple, lazy: list[torch.nn.Module], args: tuple, kwargs: dict) -> Any:
        """A call that would record or replay, finding lazy modules not materialized yet
        (`nn.LazyLinear` before its first forward), runs the function eagerly and records nothing:
        their forward gives them their shapes, memory and initial values, which a recording would
        hold as ops of every call (torch.compile, too, initializes them eagerly before tracing).
        The next call records, or replays. The lazy modules this call left lazy (the function did
        not run them) do not stop the next one of its signature; should it run one after all, the
        recorder refuses it by name (record/recorder.py). A new signature (`aux=True`) runs eagerly
        again while they are lazy."""
        result = self._function(*args, **kwargs)
        left = [module for module in lazy if has_lazy_tensors(module)]
        if left:
            self._lazy_left.setdefault(key, weakref.WeakSet()).update(left)
        self.stats.eager_calls += 1
        return result

    def _run_under_modes(self, modes: list[str], args: tuple, kwargs: dict) -> Any:
        """A call made inside the caller's TorchFunctionMode or TorchDispatchMode runs eagerly: the
        mode's code must see every torch call and aten op as it does in eager, and may compute
        what it likes from its own state (see signature.user_modes)."""
        if not self._warned_modes:
            self._warned_modes = True
            self._warn_replay_level(
                f"{self.__name__}() was called inside {', '.join(modes)}: such calls run eagerly, untraced, "
                f"so that the mode or transform sees every call and op as in eager. "
                f"Said once; traced.stats.eager_calls counts them.")
        result = self._function(*args, **kwargs)
        self.stats.eager_calls += 1
        return result

    def _record_static(self, key: tuple, args: tuple, kwargs: dict, replacing: TraceEntry | None) -> Any:
        grad_state = self._gradient_state(kwargs)
        if self._trace_count() - (replacing is not None) >= self.options.max_traces:
            raise self._cache_full(key, args, kwargs, grad_state)
        grads_before = gradient_snapshot(kwargs)
        without_state = _optimizers_without_state(kwargs, self._function)
        recorder = self._new_recorder(kwargs)
        # symbolic: what a run of the record that raises leaves unwritten is put back (_put_back_unwritten)
        before = StateSnapshot(self._function, kwargs) if isinstance(recorder, SymbolicRecorder) else None
        recorder.bind_inputs(args, kwargs, [self._arg_name(i) for i in range(len(args))])
        context = CallContext(self, recorder, self.options.capture_as_const)
        seen = Seen(optimizers=self.options.without_host)
        try:
            with seen.watching(), traced_call(context):
                result = self._function(*args, **kwargs)
            record = recorder.finish(result)
            record.rng_calls = tuple(context.rng_calls)
            seen.store(record)
            self._seen_in_call = seen
            dependency = rng_dependency(record, after_first_draw=True) if self.options.symbolic else None
            if dependency:
                raise SymbolicTraceError(
                    f"tracejit: {self.__name__}() cannot be recorded with symbolic=True: {dependency}. "
                    f"Symbolic recording draws the random numbers only when the program runs, after the "
                    f"function (torch.utils.checkpoint does this to recompute dropout in backward). Trace it "
                    f"with symbolic=False.")
            program = self._compile(record)
        except BaseException as error:
            _abandon(recorder, error)  # symbolic: run what was recorded, so side effects match an eager call
            _put_back_unwritten(recorder, before)
            raise
        try:
            recorder.complete(program)  # symbolic: run the program for real, filling every placeholder
        except BaseException:
            _put_back_unwritten(recorder, before)
            raise
        # A call that ran a backward pass, or created or accumulated gradients, depends on which
        # parameters require grad and which .grad exist when it starts.
        depends = gradient_snapshot(kwargs) != grads_before or any(op.backward_of for op in record.ops)
        if self._watch_ddp(seen.modules, kwargs):
            self.stats.records += 1
            return result  # its state said nothing of the DDP it found: the next call records again
        reached, reached_bits = self._reached_parameters(kwargs, recorder, record) if depends else ((), 0)
        stateful = _stateful_optimizers(kwargs, self._function)
        entry = TraceEntry(key, record, program, grad_state if depends else None,
                           stateful_optimizers=stateful, fresh_optimizers=stateful & without_state,
                           state_sizes=_state_sizes(kwargs, self._function), reached=reached, reached_bits=reached_bits)
        if replacing is not None:  # record_only: the newest call's record stands for its signature
            self._traces[key].remove(replacing)
        if not depends:
            self._traces[key] = [e for e in self._traces.get(key, []) if e.grad_state is not None]
        self._traces.setdefault(key, []).append(entry)
        self._traces[key].sort(key=lambda e: e.grad_state is not None)  # state-free trace first
        self._prepare_host_free(entry, recorder.handles, recorder.names, args, kwargs, result=result,
                                live_graph=seen.live_graph)
        self.stats.records += 1
        return result

    def _cache_full(self, key: tuple, args: tuple, kwargs: dict, grad_state: tuple) -> TraceCacheFullError:
        seen = "\n".join(f"  {describe_signature(e.key, self._arg_names, e.grad_state)}"
                         for e in self._entries() if e.shape_trace is None)
        symbolic = ""
        tensors = [t for _, t in tensor_inputs(args, kwargs, self._arg_names_for(args))]
        for shape_trace in self._shape_traces:
            seen += f"\n  {shape_trace.describe()}"
            if shape_trace.family == family(key):
                broken = shape_trace.guards.broken(tensors)
                if broken:
                    symbolic += (f"\nthe trace of symbolic sizes {shape_trace.guards.describe()} cannot serve it: "
                                 f"its sizes break {'; '.join(broken)}")
        return TraceCacheFullError(
            f"{self.__name__}() was called with a new input signature, but max_traces="
            f"{self.options.max_traces} traces exist already.\n  new: "
            f"{describe_signature(key, self._arg_names, grad_state)}\nrecorded signatures:\n{seen}{symbolic}\n"
            f"Pad or bucket inputs to a few shapes, pass .contiguous() inputs where only their strides vary, "
            f"or raise max_traces."
        )

    def _arg_names_for(self, args: tuple) -> list[str]:
        return [self._arg_name(i) for i in range(len(args))]

    # -- symbolic_shape ---------------------------------------------------------------------------

    def _symbolic_plan(self, key: tuple) -> tuple[tuple, ShapeTrace | None] | None:
        """Whether a call without a trace records one of symbolic sizes: (which dims of which tensor
        input become symbols, the symbolic-shape trace it replaces), or None to record it static."""
        mode = self.options.symbolic_shape
        if mode is False or self.options.record_only:
            return None
        reason = why_static_inputs(key, self._arg_names_for(key[0]))
        if reason is not None:
            if mode is True:
                raise SymbolicTraceError(
                    f"tracejit: {self.__name__}() cannot be recorded with symbolic sizes (symbolic_shape=True): "
                    f"{reason}, and the recording runs the function on stand-ins of its inputs. Trace it with "
                    f"symbolic_shape=None (such calls get one trace per shape) or False.")
            return None
        kin = family(key)
        same = [t for t in self._shape_traces if t.family == kin]
        provisional = next((t for t in same if t.provisional), None)
        if mode is True:
            return all_dims(key), provisional
        # automatic: a call of a kind seen before at other sizes makes every input size a symbol (not
        # only those that changed, as torch.compile does): programs run per concrete size, so a symbol
        # costs nothing at run time, and the size that changes next (the batch after the sequence
        # length) needs no third trace. Sizes the code relies on stay pinned by their guards.
        if kin in self._static_families:  # a symbolic recording of this kind failed before
            return None
        shapes = input_shapes(key)
        relatives = [e for e in self._entries() if family(e.key) == kin and input_shapes(e.key) != shapes]
        if not relatives and not same:
            return None  # a first call of its kind: static, as torch.compile's dynamic=None
        if any(why_static(e.record) for e in relatives if e.shape_trace is None):
            return None
        return all_dims(key), provisional

    def _specialize(self, key: tuple, args: tuple, kwargs: dict) -> TraceEntry | None:
        """A trace entry for this call's sizes from a symbolic-shape trace whose guards hold, or None."""
        if not self._shape_traces:
            return None
        kin = family(key)
        tensors = None
        for shape_trace in reversed(self._shape_traces):  # the newest is the most general
            if shape_trace.family != kin:
                continue
            if shape_trace.grad_state is not None and shape_trace.grad_state != self._gradient_state(kwargs):
                continue
            if shape_trace.reached and reached_gradient_state(shape_trace.reached) != shape_trace.reached_bits:
                continue
            if tensors is None:
                tensors = [t for _, t in tensor_inputs(args, kwargs, self._arg_names_for(args))]
            if not shape_trace.guards.hold(tensors):
                continue
            if shape_trace.provisional:
                return None  # record it again, now that the state it created exists
            record = specialize(shape_trace.record, shape_trace.guards.binding(tensors))
            entry = TraceEntry(key, record, self._compile(record, fused=False), shape_trace.grad_state,
                               shape_trace=shape_trace, stateful_optimizers=shape_trace.stateful_optimizers,
                               state_sizes=shape_trace.state_sizes, reached=shape_trace.reached,
                               reached_bits=shape_trace.reached_bits)
            self._add_specialization(entry)
            self.stats.shape_specializations += 1
            return entry
        return None

    def _add_specialization(self, entry: TraceEntry) -> None:
        self._traces.setdefault(entry.key, []).append(entry)
        self._traces[entry.key].sort(key=lambda e: e.grad_state is not None)  # state-free trace first
        if entry.shape_trace.thrashing(entry.key):
            where = user_location()
            warnings.warn_explicit(
                f"tracejit: {self.__name__}() met more than {shape_traces.MAX_SPECIALIZATIONS} input sizes of one "
                f"symbolic-shape trace, and a size it let go of came back: such sizes compile their program again "
                f"(slow). Pad or bucket inputs to fewer sizes.", SpecializationWarning, where.filename or "<unknown>",
                where.line or 0)
        evicted = entry.shape_trace.admit(entry.key)
        if evicted is not None:
            kept = [e for e in self._traces.get(evicted, []) if e.shape_trace is not entry.shape_trace]
            if kept:
                self._traces[evicted] = kept
            else:
                self._traces.pop(evicted, None)
            self._fast_call = self._fast_api = None  # neither may serve the evicted program

    def _drop_shape_trace(self, shape_trace: ShapeTrace) -> None:
        self._shape_traces.remove(shape_trace)
        for key in list(self._traces):
            kept = [e for e in self._traces[key] if e.shape_trace is not shape_trace]
            if kept:
                self._traces[key] = kept
            else:
                del self._traces[key]
        self._fast_call = None

    def _record_symbolic(self, key: tuple, args: tuple, kwargs: dict, dynamic: tuple,
                         replaced: ShapeTrace | None) -> Any:
        """Record this call with the `dynamic` dims of its tensor inputs as symbols; see
        record/symbolic_shapes.py. The call's values come from the record specialized for its sizes."""
        grad_state = self._gradient_state(kwargs)
        if replaced is None and self._trace_count() >= self.options.max_traces:
            raise self._cache_full(key, args, kwargs, grad_state)
        grads_before = gradient_snapshot(kwargs)
        arg_names = self._arg_names_for(args)
        sizes = SymbolicSizes()
        inputs = tensor_inputs(args, kwargs, arg_names)
        fakes = [sizes.fake_input(name, tensor, dims) for (name, tensor), dims in zip(inputs, dynamic)]
        fake_args = tuple(fakes[:len(args)])
        fake_kwargs = {**kwargs, **{name: fake for (name, _), fake in zip(inputs[len(args):], fakes[len(args):])}}
        names = ExternalNames(self._function, kwargs, settings=self.options.without_host)
        recorder = SymbolicRecorder(self.__name__, capture_as_const=self.options.capture_as_const,
                                    external_names=names, compile=_record_itself, runner=Realizer(), sizes=sizes)
        # the automatic mode may drop the attempt: the state it changed is then put back (and an
        # attempt that fails in the symbolic mode leaves no symbol or stand-in in Python state)
        before = StateSnapshot(self._function, kwargs)
        recorder.bind_inputs(fake_args, fake_kwargs, arg_names)
        recorder.use_real_inputs(args, kwargs)
        context = CallContext(self, recorder, self.options.capture_as_const)
        seen = Seen(optimizers=self.options.without_host)
        recorder.live_graph = seen.live_graph  # a returned output whose graph the call's backward used is no kept stand-in
        try:
            with seen.watching(), traced_call(context):
                result = self._function(*fake_args, **fake_kwargs)
            record = recorder.finish(result)
            left = before.symbolic_left(returned=frozenset(id(t) for t in _tensors_of(result) if is_fake(t)))
            if left is not None:
                raise SymbolicTraceError(
                    f"tracejit: {self.__name__}() leaves a symbolic size in Python state ({left}) when recorded "
                    f"with symbolic sizes, where an eager call leaves a number. Keep sizes in locals or tensors, "
                    f"or trace it with symbolic_shape=False.")
            record.rng_calls = tuple(context.rng_calls)
            seen.store(record)
            self._seen_in_call = seen
            record.rerecorded = replaced is not None
            dependency = rng_dependency(record, after_first_draw=True)
            if dependency:
                raise SymbolicTraceError(
                    f"tracejit: {self.__name__}() cannot be recorded with symbolic sizes (symbolic_shape): "
                    f"{dependency}. The recording draws the random numbers only when the program runs, after "
                    f"the function. Trace it with symbolic_shape=False.")
            guards = sizes.guards()
            unbound = record_symbols(record) - {source[3] for source in guards.sources}
            if unbound:
                raise SymbolicTraceError(
                    f"tracejit: {self.__name__}() computes sizes from tensor values ({', '.join(map(str, unbound))}), "
                    f"which symbolic_shape cannot evaluate from the input sizes. Trace it with symbolic_shape=False.")
            concrete = specialize(record, guards.binding([t for _, t in inputs]))
            program = self._compile(concrete, fused=False)
        except Exception as error:
            result = None  # the attempt's result, and the stand-ins its autograd graph saved
            if self.options.symbolic_shape is None and not recorder.ran_for_real:
                # The automatic mode tried symbols and the function cannot run on stand-ins of
                # symbolic size (a size torch needs as a number, a view it cannot express, a
                # returned tensor whose autograd graph saved one). Nothing ran on the real tensors;
                # the Python state the attempt changed (.grad set to placeholders by backward,
                # optimizer state, module attributes) is put back as it was, and the call records
                # the static trace of its sizes (its Python runs twice in this call). A tensor of
                # the attempt kept where nothing puts it back raises instead.
                seen.forget_consumed()  # the nodes of the attempt's backward passes, which saved its tensors
                kept, restored = _drop_attempt(recorder, error, before)
                if kept is None:
                    return _STATIC
                if not restored:
                    _abandon(recorder, error)  # the state of an eager call that raised there, as below
                    _replace_stand_ins(recorder)
                if isinstance(error, SymbolicTraceError):
                    raise
                ran = ("Nothing of this call ran, and that tensor holds unwritten memory" if restored else
                       "The ops recorded before that point ran, as in an eager call that raised there")
                raise SymbolicTraceError(
                    f"tracejit: {self.__name__}() could not be recorded with symbolic sizes ({type(error).__name__}: "
                    f"{str(error).splitlines()[0] if str(error) else ''}). The automatic symbolic_shape mode records "
                    f"such a call static instead, running it again, but the attempt left {kept} in Python state "
                    f"that tracejit cannot put back as it was (a list or object of your own?), where the static run "
                    f"would find it. {ran}. Keep such tensors on a module or return them, or trace with "
                    f"symbolic_shape=False.") from error
            _abandon(recorder, error)  # run what was recorded, so side effects match an eager call
            before.restore_symbolic()  # no symbol or stand-in stays in the module or the globals
            _put_back_unwritten(recorder, before)
            if isinstance(error, RuntimeError) and not isinstance(error, SymbolicTraceError) \
                    and SYMBOLIC_LIMITS.search(str(error)):
                # torch's C++ asked a symbolic size for a number (at::native::lstm's numel(), a split of
                # GRU gates in a storage of symbolic size): a limit of the recording, not the user's error
                where = traceback_location(error.__traceback__)
                code = f": {where.code}" if where.code else ""
                raise SymbolicTraceError(
                    f"tracejit: symbolic_shape=True cannot record {self.__name__}() at {where}{code}: torch needs "
                    f"a concrete size there ({str(error).splitlines()[0]}). Trace it with symbolic_shape=None (the "
                    f"default: such calls record a trace per size) or symbolic_shape=False.") from error
            raise
        except BaseException as error:
            _abandon(recorder, error)
            _put_back_unwritten(recorder, before)
            raise
        try:
            recorder.complete(program)
        except BaseException:
            _put_back_unwritten(recorder, before)
            raise
        stand_ins = result
        result = recorder.real_result(result)
        _replace_returned_stand_ins(stand_ins, result)
        depends = gradient_snapshot(kwargs) != grads_before or any(op.backward_of for op in record.ops)
        if self._watch_ddp(seen.modules, kwargs):
            if replaced is not None:
                self._drop_shape_trace(replaced)
            self.stats.records += 1
            return result
        reached, reached_bits = self._reached_parameters(kwargs, recorder, record) if depends else ((), 0)
        shape_trace = ShapeTrace(family(key), record, guards, dynamic, grad_state if depends else None,
                                 stateful_optimizers=_stateful_optimizers(kwargs, self._function), reached=reached,
                                 reached_bits=reached_bits, state_sizes=_state_sizes(kwargs, self._function))
        if replaced is not None:
            self._drop_shape_trace(replaced)
            self.stats.rerecords += 1
        else:
            self.stats.records += 1
        self._shape_traces.append(shape_trace)
        self._add_specialization(TraceEntry(key, concrete, program, shape_trace.grad_state, shape_trace=shape_trace,
                                            stateful_optimizers=shape_trace.stateful_optimizers,
                                            state_sizes=shape_trace.state_sizes, reached=reached,
                                            reached_bits=reached_bits))
        return result

    def _new_recorder(self, kwargs: dict) -> Recorder:
        names = ExternalNames(self._function, kwargs, settings=self.options.without_host)
        if self.options.symbolic:
            # The realizer runs the record itself, op by op: catch-ups need no compiled program.
            return SymbolicRecorder(self.__name__, capture_as_const=self.options.capture_as_const,
                                    external_names=names, compile=_record_itself, runner=Realizer())
        return Recorder(self.__name__, capture_as_const=self.options.capture_as_const, external_names=names)

    def _replay(self, entry: TraceEntry, args: tuple, kwargs: dict, handles: list | None = None) -> Any:
        """An aten-level checked call; `handles` (if given) gets its handle map (weak references)."""
        lazy = self._lazy_modules(entry.key, kwargs)  # another model, still lazy: its materializing call runs eagerly
        if lazy:
            return self._run_materializing(entry.key, lazy, args, kwargs)
        record = entry.record
        variants = entry.variants if entry.variants is not None else ShapeVariants(entry.program)
        without_state = _optimizers_without_state(kwargs, self._function)
        # a keyword optimizer without the state it had, or a GradScaler that has not made its scale
        # yet (a new one, loaded from a checkpoint): this call creates that state, as the first did
        fresh_optimizer = bool(entry.stateful_optimizers & without_state) or any(
            isinstance(v, torch.amp.GradScaler) and v.is_enabled() and v._scale is None for v in kwargs.values())
        if entry.state_sizes and not fresh_optimizer:  # state of some parameters dropped: made again lazily
            now = dict(_state_sizes(kwargs, self._function))
            fresh_optimizer = any(now.get(name, 0) < size for name, size in entry.state_sizes)
        replayer = Replayer(
            entry.program, args, kwargs,
            # the first replay of a record that created state, or that read on the host state it then
            # changed (AveragedModel's first-call copy), records it again; so does, in the
            # automatic symbolic_shape mode, a size's first replay of a symbolic trace, should the
            # function dispatch what torch elides at concrete sizes (a full slice, a size query);
            # and a call whose optimizer lacks the state the record found, or has the state the
            # record created (two models trained in turn: the second one's first call replays the
            # first one's, and the first one's next call finds its own state)
            may_rerecord=(entry.replays == 0 and (
                (record.created_state and not record.rerecorded)
                or (entry.shape_trace is not None and self.options.symbolic_shape is None)
                or (not record.rerecorded and reads_state_it_changes(record)))
                or fresh_optimizer or bool(entry.fresh_optimizers - without_state)),
            external_names=ExternalNames(self._function, kwargs, settings=self.options.without_host),
            capture_as_const=self.options.capture_as_const,
            variants=variants, room=self.options.max_traces - self._trace_count(), max_traces=self.options.max_traces,
            optimizer_branches=OPTIMIZER_BRANCHES - entry.optimizer_branches,
        )
        if handles is not None:
            handles.append(replayer.handles)
        tracer = self._api_tracer(entry, replayer, args, kwargs)
        context = call_context_key()
        call = CallContext(self, replayer, self.options.capture_as_const)
        seen = Seen(optimizers=self.options.without_host)  # for a record this call makes (a re-record, a variant)
        scalers = ScalerStages(self._function, kwargs)  # this call's: its keywords may differ from the last
        scaler_stages = scalers.save(kwargs) if scalers else None
        try:
            with seen.watching(), traced_call(call):
                if tracer is None:
                    result = self._function(*args, **kwargs)
                else:
                    with tracer:
                        result = self._function(*args, **kwargs)
        except BaseException as error:
            replayer.abandon()  # what the function did before raising happens, as in an eager call
            if scaler_stages and isinstance(error, TraceMismatchError):
                ScalerStages.restore(scaler_stages)
            raise
        self._seen_in_call = seen
        try:
            new_record = replayer.finish(result)
        except TraceMismatchError:
            if scaler_stages:
                # the function would have gone on to scaler.update(): a scaler left between its step()
                # and update() would refuse every later step ("step() has already been called")
                ScalerStages.restore(scaler_stages)
            raise
        if new_record is not None:
            new_record.rng_calls = tuple(call.rng_calls)
            seen.store(new_record)
        if tracer is not None:
            dependency = rng_dependency(replace(entry.record, rng_calls=tuple(call.rng_calls)), after_first_draw=True)
            if dependency:
                tracer.trace.refuse(f"{dependency}, and the API level draws after the function has run")
        if replayer.program is not entry.program:  # a data-dependent size moved the call to another variant
            entry.program, entry.record = replayer.program, replayer.record
        if new_record is not None and replayer.new_variant:
            if new_record.created_state:
                # like a first recording: the variant made state the next call has (Adam's, made
                # lazily by the first step a GradScaler did not skip), so its first replay may record again
                new_record.rerecorded = False
            entry.program, entry.record = self._compile(new_record), new_record
            entry.variants = variants
            entry.handles = replayer.recorder.handles
            if replayer.replacing is not None:
                variants.replace(replayer.replacing, entry.program)
                self.stats.rerecords += 1
            else:
                variants.add(entry.program)
                if replayer.branched:
                    self.stats.branch_variants += 1
                else:
                    self.stats.shape_variants += 1
        elif new_record is not None:
            shape_trace = entry.shape_trace
            if shape_trace is not None and not (record.created_state and not record.rerecorded):
                # a size the symbolic trace did not fit (the automatic mode): its own static trace now
                self._static_families.add(shape_trace.family)
                shape_trace = None
            entries = self._traces[entry.key]
            try:
                program = self._compile(new_record, fused=shape_trace is None)
            except (KeyError, IndexError):
                # A re-record that began after an exclude_from_trace() block can miss the producer of
                # a value the block's cut made an input (the replay held it). The call itself ran and
                # is right; the next call of this signature records from its start instead.
                entries.remove(entry)
                if not entries:
                    del self._traces[entry.key]
                self._fast_call = self._fast_api = None
                return result
            if fresh_optimizer:  # like a first recording: the next call, with that state, may record again
                new_record.rerecorded = False
            stateful = _stateful_optimizers(kwargs, self._function)
            replaced = TraceEntry(entry.key, new_record, program, entry.grad_state, shape_trace=shape_trace,
                                  stateful_optimizers=stateful, fresh_optimizers=stateful & without_state,
                                  state_sizes=_state_sizes(kwargs, self._function),
                                  reached=entry.reached, reached_bits=entry.reached_bits,
                                  optimizer_branches=entry.optimizer_branches + (replayer.optimizer_branched is not None))
            entries[entries.index(entry)] = replaced
            self._prepare_host_free(replaced, replayer.recorder.handles, replayer.names, args, kwargs, result=result,
                                    live_graph=seen.live_graph)
            self.stats.rerecords += 1
        else:
            entry.replays += 1
            self.stats.checked_replays += 1
            variants.settle(replayer.program)
            if entry.fresh_optimizers - without_state:
                # an optimizer with state replayed the call that created it without a difference
                # (state of Python numbers only): the record serves such calls, none re-records
                entry.fresh_optimizers = frozenset()
            if replayer.other_literals:
                # made from Python data with other values than recorded (`y[mask] = s` with a new s):
                # right at the aten level, wrong in the program that has the recorded values built in
                entry.handles = replayer.handles
                if entry.host_free is not None:
                    entry.host_free.call = None
                self._fast_call = None
            elif replayer.host_reads_seen and not entry.record.host_reads and self.options.without_host:
                entry.host_free_error, entry.host_free, self._fast_call = HostDependencyError(
                    f"without_host=True cannot skip {self.__name__}() anymore: its call now reads values on the "
                    f"host that its recorded call did not ({replayer.host_reads_seen[0]}; BatchNorm with "
                    f"momentum=None reads its batch count), and a call without the function would freeze them. "
                    f"Trace without without_host."), None, None
                entry.handles = replayer.handles
            else:
                self._prepare_host_free(entry, replayer.handles, replayer.names, args, kwargs, replayer.scalars,
                                        result=result, live_graph=seen.live_graph)
            if tracer is not None and not replayer.other_literals:
                api_trace = tracer.finish(result)
                api_trace.live_graph = seen.live_graph
                self._prepare_api(entry, api_trace, replayer, args, kwargs, context)
        return result

    def _refuse_api(self, entry: TraceEntry, reason: str) -> None:
        """Keep this trace's checked calls at the aten level, saying why once."""
        entry.api_refused = reason
        self._warn_replay_level(f"checked calls of {self.__name__}() stay at the aten level (slower): {reason}")

    def _warn_misses(self, entry: TraceEntry, args: tuple, kwargs: dict) -> None:
        """Most calls of this trace ran the function: say which guard failed on this one, once."""
        why = entry.host_free.why_missed(args, kwargs) or "a guard of the program failed"
        where = user_location()
        warnings.warn_explicit(
            f"tracejit: {entry.host_free_misses} of {entry.host_free_calls} calls of {self.__name__}() with "
            f"without_host=True ran the function (slower than eager): {why}. Pass tensors that change on every "
            f"call as arguments (positional, or tensor keywords), not inside a keyword dict or an object, and "
            f"keep the objects and settings the program was bound to.", HostFreeMissWarning,
            where.filename or "<unknown>", where.line or 0)

    def _warn_rearranging(self, rearranged: list[str]) -> None:
        """Calls in a row rearranged containers, so every call ran the function: say so, once per
        traced function (the count restarts only after a call that rearranged none)."""
        where = user_location()
        warnings.warn_explicit(
            f"tracejit: {_CALLS_IN_A_ROW} calls in a row of {self.__name__}() with without_host=True ran the "
            f"function (slower than eager): each changed the items of a container it reaches "
            f"({'; '.join(rearranged[:3])}), which a call without the function would not do again. Keep "
            f"such histories outside the traced function (append what it returns), or trace without "
            f"without_host (checked calls keep them fast).", HostFreeMissWarning,
            where.filename or "<unknown>", where.line or 0)

    def _warn_replay_level(self, message: str) -> None:
        where = user_location()
        warnings.warn_explicit(f"tracejit: {message}", ReplayLevelWarning, where.filename or "<unknown>",
                               where.line or 0)

    def _api_tracer(self, entry: TraceEntry, replayer: Replayer, args: tuple, kwargs: dict) -> ApiTracer | None:
        if not self._api_level or entry.api_refused is not None or replayer.may_rerecord:
            return None
        if entry.shape_trace is not None and entry.replays == 0:
            return None  # a size's first call: noting it pays only if the size comes back (cheaper new sizes)
        refusal = record_refusal(entry.record)
        if refusal is not None:
            self._refuse_api(entry, refusal)
            return None
        return ApiTracer(replayer, entry.record, args, kwargs)

    @collector_paused()  # tracejit's own work, not the function's: see runtime/gc_pause.py
    def _prepare_api(self, entry: TraceEntry, trace, replayer: Replayer, args: tuple, kwargs: dict,
                     context: tuple) -> None:
        """After an aten-level replay that noted its torch-level calls: build the API-level check."""
        replayer.state = None  # what the aten-level program held for the call: not the function's
        torch.clear_autocast_cache()  # the caller's autocast region's casts are not the function's (Recorder.finish)
        if trace.refused is None and under_saved_tensor_hooks(entry.key[-1]):
            trace.refuse("the call runs under saved_tensors_hooks, whose Python runs in its forward and backward")
        if trace.refused is None:
            trace.refuse(_kept_values(entry.record, replayer.handles.live(), trace, kwargs, [trace]))
        if trace.refused is not None:
            self._refuse_api(entry, trace.refused)
            return
        live = replayer.handles.live()
        # the externals the checker holds (API-level references, verified by every matched call):
        # the program takes them from there instead of reaching them again
        slot_of = {id(ref()): slot for slot, ref in enumerate(trace.externals) if ref() is not None}
        external_slots = {h: slot_of[id(t)] for h, t in live.items()
                          if entry.record.tensors[h].kind is Kind.EXTERNAL and id(t) in slot_of}
        try:
            if entry.host_free is None:
                entry.host_free = self._host_free_runner(entry, read_exports(entry.record, held_after_calls(trace, trace.output)))
            entry.host_free.bind(live, args, kwargs, replayer.names, entry.grad_state, replayer.scalars,
                                 external_slots=external_slots, grad_owners=gradient_owners(trace, external_slots),
                                 reached=(entry.reached, entry.reached_bits), input_grads=input_grads(entry.key))
        except HostDependencyError as error:
            self._refuse_api(entry, f"the compiled program cannot run without the function: {error}")
            entry.host_free = None
            return
        except GuardFailure as failure:
            self._unbound_api(entry, str(failure))  # an external is gone already: try again on the next call
            return
        entry.api_unbound = 0
        if entry.host_free.unplaced:  # a literal kept in a list, say: every program run would miss
            self._refuse_api(entry, f"the function keeps {entry.host_free.unplaced[0]} beyond the call where "
                                    f"tracejit cannot find it")
            return
        trace.output_objects = None
        externals = {h: t for h, t in replayer.handles.live().items() if entry.record.tensors[h].kind is Kind.EXTERNAL}
        try:
            entry.api = ApiProgram(trace, entry.record, entry.host_free, trace.output, context, externals)
            entry.api.scalers = ScalerStages(self._function, kwargs) or None
            entry.api.schedulers = SchedulerStates(self._function, kwargs) or None
        except NotReplayable as reason:
            self._refuse_api(entry, str(reason))

    @collector_paused()  # tracejit's own work, not the function's: see runtime/gc_pause.py
    def _prepare_host_free(self, entry: TraceEntry, handles: HandleMap, names: ExternalNames, args: tuple,
                           kwargs: dict, scalars: list | None = None, result: Any = None,
                           live_graph: Callable[[torch.Tensor], bool] | None = None) -> None:
        """After a call that ran the function: (re)bind the program that runs without it."""
        entry.handles = handles  # to_fx() finds the external objects there
        if not self.options.without_host:
            return
        settings_error = self._refuse_setting_changes(entry.key, names.setting_changes())  # noted for the next call too
        if entry.provisional:
            return
        seen = self._seen_in_call
        error = refuse_python_state_changes(self._function, self.__name__, self._state_before, kwargs,
                                            seen.changes if seen else ())
        changes = names.python_changes() + (seen.data_assignments if seen else [])  # on any tensor, by line
        if error is None and changes:
            listed = "\n".join(f"    {change}" for change in changes[:5])
            error = HostDependencyError(
                f"without_host=True cannot skip {self.__name__}(): the traced call changes, by Python rather "
                f"than by torch ops, state that the program cannot change without the function:\n"
                f"{listed}\nWrite tensors in place instead (`with torch.no_grad(): p.clamp_(-c, c)` rather than "
                f"`p.data = p.data.clamp(-c, c)`), change requires_grad and settings outside the traced call, or "
                f"trace without without_host.")
        error = error or settings_error
        if error is not None:  # e.g. scheduler.step() inside the function: refuse, never freeze it
            entry.host_free_error, entry.host_free, self._fast_call = error, None, None
            return
        # A value changed once (the next call runs the function and tells), or containers the call
        # rearranged (`history.append(y)`, a window shifted): a call without the function would not
        # do it again, so the next call runs the function, and while every call does, every call
        # runs the function, as eager does
        rearranged = names.rearranged()
        if rearranged:
            entry.rearranging_calls += 1
            if entry.rearranging_calls == _CALLS_IN_A_ROW and not self._warned_rearranging:
                self._warned_rearranging = True  # once per traced function (each size's trace is an entry)
                self._warn_rearranging(rearranged)
        else:
            entry.rearranging_calls = 0
        if self._settings_changed.get(entry.key) or rearranged:
            if entry.host_free is None:
                try:  # what the program refuses (host reads) it refuses however the containers change
                    entry.host_free = self._host_free_runner(entry)
                except HostDependencyError as error:
                    entry.host_free_error, self._fast_call = error, None
                    return
            entry.host_free.call = None
            self._fast_call = None
            return
        if entry.host_free is None and live_graph is not None and _returns_graph(result, live_graph):
            where = user_location()
            retained = seen is not None and any(
                t.requires_grad and live_graph(t) and seen.retained_graph(t) for t in _tensors_of(result))
            if retained:  # `loss.backward(retain_graph=True); return loss`: the caller backpropagates again
                message = (
                    f"{self.__name__}() returns tensors that require grad whose autograd graph the call's own "
                    f"backward pass kept (retain_graph=True) for a backward pass after the call; with "
                    f"without_host=True later calls return them without an autograd graph (the call runs no "
                    f"autograd to keep one), so a backward pass through them after the call raises or does not "
                    f"reach the parameters. Run every backward pass inside the traced function (and return "
                    f"loss.detach()), or trace without without_host.")
            else:
                what = ("runs no backward pass itself" if not any(op.backward_of for op in entry.record.ops) else
                        "no backward pass inside the call used their autograd graph (a generator's output that "
                        "only a detached copy of went into the call's loss)")
                message = (
                    f"{self.__name__}() returns tensors that require grad and {what}; with without_host=True "
                    f"later calls return them without an autograd graph, so a backward pass after the call does "
                    f"not reach the parameters. Trace the whole training step (forward, backward and optimizer "
                    f"step), call it under torch.no_grad() for inference, or trace without without_host.")
            warnings.warn_explicit(f"tracejit: {message}", GradientWarning, where.filename or "<unknown>",
                                   where.line or 0)
        try:
            # before the program's own refusals: a PowerSGD hook's random draws are its state's doing
            refuse_stateful_comm_hooks(entry.record, kwargs)
            if under_saved_tensor_hooks(entry.key[-1]):
                raise HostDependencyError(
                    f"without_host=True cannot skip {self.__name__}(): it is called under "
                    f"torch.autograd.graph.saved_tensors_hooks, whose pack and unpack functions are Python that "
                    f"runs in the call's forward and backward. Enter them inside the traced function, or trace "
                    f"without without_host.")
            if entry.host_free is None:
                entry.host_free = self._host_free_runner(entry)
            entry.host_free.bind(handles.live(), args, kwargs, names, entry.grad_state, scalars,
                                 reached=(entry.reached, entry.reached_bits), input_grads=input_grads(entry.key))
            self._install_fast_call(entry)
        except HostDependencyError as error:
            entry.host_free_error = error
        except GuardFailure:
            entry.host_free.call = None  # some external is gone: the next call runs the function
            self._fast_call = None

    def _refuse_setting_changes(self, key: tuple, changes: list[tuple[str, Any, Any]]) -> HostDependencyError | None:
        """The error for a call that changed plain values it reaches by Python (a submodule's
        annealed float, a counter, an int step count in optimizer state) as the last call of its
        input signature that ran the function did: starting from the value that call left, it
        changed it again, and a call without the function would not. A value changed once
        (`model.eval()`, a flag set on the first call) is noted, and the trace is bound after the
        next call that leaves it as it is. Per signature: a value that flips with it (a bool
        keyword `train` passed to `model.train(train)`) is no counter."""
        last = self._settings_changed.get(key, {})
        self._settings_changed[key] = {name: [then, now] for name, then, now in changes}
        repeated = [f"{name}: {' -> '.join(repr(v) for v in (*last[name], now))}" for name, then, now in changes
                    if name in last and same_value(then, last[name][-1])]
        if not repeated:
            return None
        listed = "\n".join(f"    {change}" for change in repeated[:5])
        return HostDependencyError(
            f"without_host=True cannot skip {self.__name__}(): the traced call changes, by Python rather than by "
            f"torch ops, state that the program cannot change without the function, on every call:\n{listed}\n"
            f"Keep such a value in a tensor updated in place (`self.tau.mul_(0.8)`, a step count in a tensor), "
            f"change it outside the traced call and pass it as a keyword argument, or trace without without_host.")

    def _unbound_api(self, entry: TraceEntry, reason: str) -> None:
        """The API-level program could not be bound after this call. Once in a while that is the
        call's own business (a tensor reached for the first time); call after call it means every
        checked call stays at the aten level, which the user hears of, once per trace."""
        entry.api_unbound += 1
        if entry.api_unbound == _CALLS_IN_A_ROW:
            self._warn_replay_level(
                f"checked calls of {self.__name__}() stay at the aten level (slower): the torch API level "
                f"could not be bound after {_CALLS_IN_A_ROW} calls in a row ({reason}); it is tried again on "
                f"every call. Said once per trace.")

    @collector_paused()  # tracejit's own work, not the function's: see runtime/gc_pause.py
    def _host_free_runner(self, entry: TraceEntry, exports: frozenset[int] | None = None) -> HostFreeRunner:
        """Compile the trace's host-free program (raises HostDependencyError if it has none); with
        `exports` (the values it must leave when it runs at a host read), a checked call's."""
        started = CLOCK()
        checked = exports is not None
        graph = build_graph(entry.record, host_visible=False, capture_as_const=self.options.capture_as_const,
                            read_exports=exports or frozenset())
        options = self._compile_options if entry.shape_trace is None else self._unfused_options
        program, entry.history = compile_host_free(graph, options, self.__name__, self._profiler)
        runner = HostFreeRunner(entry.record, program, self._function, checked, self._gradient_state)
        if self._profiler is not None:
            self._profiler.compiled(CLOCK() - started)
        return runner

    @property
    def _fast_call(self) -> Callable | None:
        return self._fast_calls[0]

    @_fast_call.setter
    def _fast_call(self, call: None) -> None:
        """Forget both (a trace refused, evicted or bound again: no call of an older binding may run)."""
        assert call is None, "see _install_fast_call"
        self._fast_calls = self._fast_entries = (None, None)

    @property
    def _fast_api(self) -> TraceEntry | None:
        return self._fast_apis[0]

    @_fast_api.setter
    def _fast_api(self, entry: TraceEntry | None) -> None:
        latest = self._fast_apis[0]
        self._fast_apis = (None, None) if entry is None else (entry, latest if latest is not entry else self._fast_apis[1])

    def _install_fast_call(self, entry: TraceEntry) -> None:
        """Let the next call try this trace's generated call before anything else. Profiling and
        verify_every need the slow path's bookkeeping."""
        if self._profiler is None and self.options.verify_every is None:
            call = entry.host_free.call
            latest, (latest_call, before_call) = self._fast_entries[0], self._fast_calls
            if latest is entry:  # bound again: its new call, and the other trace's
                self._fast_calls = (call, before_call)
            else:
                self._fast_calls, self._fast_entries = (call, latest_call), (entry, latest)

    @collector_paused()  # tracejit's own work, not the function's: see runtime/gc_pause.py
    def _compile(self, record: Record, fused: bool = True) -> CheckedProgram:
        """The checked program of a record; `fused=False` (symbolic-shape specializations): no fused
        kernels, which are generated for fixed sizes."""
        started = CLOCK()
        graph = build_graph(record, host_visible=True, capture_as_const=self.options.capture_as_const)
        history = [("record", graph, 0.0)]
        options = self._compile_options if fused else self._unfused_options
        if options.fusion is not None and not self.options.record_only:  # record_only runs no kernel: build none
            result = optimize(graph, options)
            graph, history = result.graph, result.history
        kernels = compile_kernels(graph, options, self.__name__, "checked", history)
        program = CheckedProgram(record, graph, self._profiler, kernels)
        if self._profiler is not None:
            self._profiler.compiled(CLOCK() - started)
        return program

    # -- introspection --------------------------------------------------------------------------

    @property
    def records(self) -> list[Record]:
        """The current record of every input signature, oldest first."""
        return [entry.record for entry in self._entries()]

    def _no_profile_message(self) -> str:
        return (f"{self.__name__}() was traced without profiling; pass profiling=True to tracejit.trace to collect "
                f"a profile")

    @property
    def history(self) -> list:
        """(pass name, graph after it, seconds) for the most recent host-free compilation."""
        for entry in reversed(self._entries()):
            if entry.history:
                return entry.history
        return []

    def program_source(self) -> str:
        """The generated Python of the most recent without_host program."""
        for entry in reversed(self._entries()):
            if entry.host_free is not None:
                return entry.host_free.program.source
        raise RuntimeError(f"{self.__name__}() has no host-free program yet: trace with without_host=True "
                           f"and call it at least twice")

    def to_fx(self) -> torch.fx.GraphModule:
        """The most recent trace as a `torch.fx.GraphModule` (its host-free graph if it has one, else
        the graph checked replay runs), holding the external tensors it last used; see ir/to_fx.py."""
        entries = self._entries()
        if not entries:
            raise RuntimeError(f"{self.__name__}() has no trace yet: call it once before to_fx()")
        entry = entries[-1]
        graph = entry.host_free.program.graph if entry.host_free is not None else entry.program.graph
        record = entry.record
        live = entry.handles.live() if entry.handles is not None else {}
        externals = {h: t for h, t in live.items() if record.tensors[h].kind is Kind.EXTERNAL}
        inputs = [(self._arg_name(i), h) for i, h in enumerate(record.arg_handles)]
        inputs += list(record.kwarg_handles.items())
        return to_fx(graph, externals, inputs=inputs, output=record.output)

    def dump(self, file: Any, **options: Any) -> Any:
        """Write the traced graph for inference to `file` (a path or a binary file object), with its
        weights; `tracejit.load(file)` runs it without this function or the code defining it.

        Needs capture_as_const=True and one recorded call. Options (see docs/format.md): arg_names,
        output_names, append, keep_var_name, keep_opr_name, keep_param_name, optimize_for_inference,
        user_info, enable_metadata, input_data, repeat, no_assert, maxerr, enable_io16xc32,
        enable_ioc16. Returns a DumpInfo (inputs, outputs, op and parameter counts, file size).
        """
        from .serialize.dump import dump_trace

        return dump_trace(self, file, **options)

    def kernel_sources(self) -> dict[str, str]:
        """Generated source of every compiled fused kernel of this function, by kernel name."""
        sources = {}
        for entry in self._entries():
            programs = [entry.program] + ([entry.host_free.program] if entry.host_free is not None else [])
            for program in programs:
                for kernel in program.kernels.values():
                    if getattr(kernel, "source", None):
                        sources[kernel.__name__] = kernel.source
        return sources

    def listing(self) -> str:
        """The records as numbered op listings with source lines."""
        return "\n\n".join(record.listing() for record in self.records)

    def _arg_name(self, index: int) -> str:
        if index < len(self._arg_names):
            return self._arg_names[index]
        return f"arg{index}"


def _fill_stranded(stranded: dict[int, torch.Tensor], live: dict[int, torch.Tensor]) -> None:
    """Give the placeholders a diverged API-level run left in the function's hands the values the
    aten-level run of the same call computed for their handles (the function kept those too: the
    side effect happened twice, with the same values); one it did not compute again is NaN (0 for
    integers), never memory nobody wrote."""
    with torch.no_grad():
        for handle, tensor in stranded.items():
            value = live.get(handle)
            if (value is not None and value.shape == tensor.shape and value.dtype == tensor.dtype
                    and value.device == tensor.device):
                tensor.set_(value.detach())
            else:
                tensor.fill_(float("nan") if tensor.is_floating_point() or tensor.is_complex() else 0)


def _kept_values(record: Record, live: dict, trace, kwargs: dict, ours: list) -> str | None:
    """Why the API level cannot stand in for the call if it keeps computed values beyond the call
    other than its outputs and gradients (which the host-free program writes back), else None."""
    result = trace.output_objects
    internal = {id(t) for h, t in live.items() if record.tensors[h].kind is Kind.INTERNAL}
    returned = [t for t in _tensors_of(result) if id(t) in internal]
    outputs = {id(t) for t in returned} | {id(t._base) for t in returned if t._base is not None}
    containers = {id(c) for c in _containers_of(result)} | {id(live), id(returned)} | {id(o) for o in ours}
    for tensor in _tensors_of(result):
        # with a backward pass in the call, only what it did not free (a generator's output of which
        # only a detached copy went into the loss, a view of a parameter)
        if (tensor.requires_grad and id(tensor) in internal
                and (not trace.ran_backward or trace.live_graph is None or trace.live_graph(tensor))):
            return ("the function returns a tensor that requires grad (a backward pass outside the call "
                    "needs the autograd graph that only the aten level builds)")
    for tensor in returned:  # an output stored elsewhere too keeps its identity there
        for holder in gc.get_referrers(tensor):
            if id(holder) not in containers and not isinstance(holder, types.FrameType):
                return (f"the function keeps an output tensor beyond the call besides returning it "
                        f"(in a {type(holder).__name__})")
    grads = {id(p.grad) for module in kwargs.values() if isinstance(module, torch.nn.Module)
             for p in module.parameters() if p.grad is not None}
    # and those of parameters reached otherwise (a closure's model): the program writes them back
    # where they are, as it does a keyword module's
    grads |= {id(t.grad) for h, t in live.items()
              if record.tensors[h].kind is Kind.EXTERNAL and t.is_leaf and t.grad is not None}
    # and those of inputs that require grad (an adversarial step's): the program gives the call's
    # input the gradient it made (HostFreeRunner._input_gradients)
    grads |= {id(t.grad) for h, t in live.items()
              if record.tensors[h].kind in (Kind.ARG, Kind.KWARG) and t.is_leaf and t.requires_grad and t.grad is not None}
    kept_by_ddp_itself = kept_by_ddp(record, trace)  # DistributedDataParallel's, see runtime/ddp_stand_in.py
    for handle, tensor in live.items():
        info = record.tensors[handle]
        # A tensor in memory the call made, kept without an autograd graph (`history.append(loss.detach())`),
        # gets the program's tensor where the function put it (hostfree.KeptSlot); a placeholder
        # carries no autograd graph
        if (info.kind is Kind.INTERNAL and id(tensor) not in outputs and id(tensor) not in grads
                and handle not in kept_by_ddp_itself
                and (tensor.requires_grad or record.tensors[storage_root(record, handle)].kind is not Kind.INTERNAL)):
            what = "a tensor that requires grad" if tensor.requires_grad else "a view of a tensor it did not make"
            return (f"the function keeps t{handle}, {what} (made at {_producer_source(record, handle)}), beyond "
                    f"the call; the API level hands out placeholders for such values")
    return None


_STATIC = object()  # _record_symbolic: record this call static instead


def _keyword_optimizers(kwargs: dict, function: Callable) -> Iterator[tuple[str, torch.optim.Optimizer]]:
    """The keyword optimizers, those a keyword module holds as an attribute (`model.opt`), and
    those the function reaches as a global or closure variable (`O` re-created by running a
    notebook cell again), by name."""
    for name, root, value in roots_of(function, kwargs):
        name = name if root[0] == "kwarg" else f"{root[0]} {name}"
        if isinstance(value, torch.optim.Optimizer):
            yield name, value
        elif isinstance(value, torch.nn.Module):
            for attribute, held in vars(value).items():
                if isinstance(held, torch.optim.Optimizer):
                    yield f"{name}.{attribute}", held


def _stateful_optimizers(kwargs: dict, function: Callable) -> frozenset:
    """The optimizers (_keyword_optimizers) that hold state (after a call that ran the function)."""
    return frozenset(name for name, v in _keyword_optimizers(kwargs, function) if any(v.state.values()))  # a look up leaves {}


def _state_sizes(kwargs: dict, function: Callable) -> tuple[tuple[str, int], ...]:
    """(name, how many of its parameters hold state) of each optimizer _keyword_optimizers finds:
    the parameters of its groups, whose state holds a tensor (a replaced head's parameters leave
    their old state behind in `opt.state`; `momentum_buffer = None` is made again lazily)."""
    return tuple((name, sum(1 for group in v.param_groups for p in group["params"]
                            if any(isinstance(value, torch.Tensor) for value in v.state.get(p, {}).values())))
                 for name, v in _keyword_optimizers(kwargs, function))


def _optimizers_without_state(kwargs: dict, function: Callable) -> frozenset:
    """The optimizers (_keyword_optimizers) that hold no state. One that held state after the
    recorded call and holds none now (another model's optimizer than the one recorded with, one
    whose state was cleared) creates its state lazily in this call, as the recorded call did: the
    replay may record again from where it differs."""
    return frozenset(name for name, v in _keyword_optimizers(kwargs, function) if not any(v.state.values()))


def _drop_attempt(recorder: SymbolicRecorder, error: BaseException,
                  before: StateSnapshot) -> tuple[str | None, bool]:
    """Drop a failed symbolic-shape attempt that ran nothing on the real tensors: put back the state
    `before` holds, and return (None, True). If the attempt left a tensor it made where `before`
    does not reach, return its description, and whether the state was put back: not when that is
    seen first (the caller then runs what was recorded, so the tensor holds what an eager call that
    raised there computed); after, when the same tensor is also held elsewhere."""
    # The frames of the error hold the function's locals (the attempt's tensors only): kept, they
    # would count as kept. Clearing a frame is not enough: it still holds its function, whose
    # closure may hold them too (nn.Module._call_impl's `inner` keeps the forward's arguments in
    # cells). So the tracebacks go; where the error is raised on, a note keeps where it came from.
    chain, chained = [], error
    while chained is not None and all(chained is not seen for seen in chain):
        if chained.__traceback__ is not None:
            where = "".join(traceback.format_tb(chained.__traceback__)).rstrip()
            chained.add_note(f"tracejit: raised while recording with symbolic sizes, at:\n{where}")
            traceback.clear_frames(chained.__traceback__)
            chained.__traceback__ = None
        chain.append(chained)
        chained = chained.__cause__ or chained.__context__
    for tensor, grad, requires_grad in recorder.first_seen:
        before.add_leaf(tensor, grad, requires_grad)
    kept = recorder.left_behind(before.held_now())  # held elsewhere than in the state put back
    if kept is not None:
        return kept, False
    before.restore()
    return recorder.left_behind(), True  # the same tensor held twice, once where nothing puts it back


def _replace_returned_stand_ins(stand_ins: Any, result: Any) -> None:
    """A returned stand-in the function also kept (`meter.last = d; return d`) is, there too, the
    returned tensor, as in eager."""
    for fake, real in zip(tree_leaves(stand_ins), tree_leaves(result)):
        if is_fake(fake) and real is not fake:
            _swap_referents(fake, real)


def _swap_referents(old: Any, new: Any) -> None:
    """Put `new` wherever a list or dict (an object's attributes too) holds `old`."""
    for holder in gc.get_referrers(old):
        if isinstance(holder, list):
            holder[:] = [new if item is old else item for item in holder]
        elif isinstance(holder, dict):
            for key in [key for key, value in holder.items() if value is old]:
                holder[key] = new


def _replace_stand_ins(recorder: SymbolicRecorder) -> None:
    """After a dropped attempt whose record then ran for real: a stand-in of symbolic size the
    function left in a list or dict that nothing puts back (`box.inner.items.append(out.detach())`)
    is replaced there by the value the run computed, as an eager call that raised there leaves it."""
    for handle, tensor in recorder.handles.live().items():
        if not is_fake(tensor):
            continue
        try:
            real = recorder.computed(handle)
        except (RuntimeError, IndexError):
            continue
        if not is_fake(real):
            _swap_referents(tensor, real)


def _put_back_unwritten(recorder: Any, before: StateSnapshot | None) -> None:
    """After a symbolic recording whose run for real raised at some op: the Python state that holds
    placeholders of later ops (a `.grad` backward set, optimizer state a step made) gets what it
    held before the call, as an eager call that raised at that op leaves it; the values of the ops
    that ran stay."""
    if before is None or not isinstance(recorder, SymbolicRecorder):
        return
    for tensor, grad, requires_grad in recorder.first_seen:  # a closure's parameters, as first seen
        before.add_leaf(tensor, grad, requires_grad)
    before.restore_unwritten(recorder.unwritten_storages())


def _abandon(recorder: Any, error: BaseException) -> None:
    """Run what a failed recording recorded (the side effects of an eager call that raised there).
    If that fails too (the fake kernels mispredicted a layout the real ones then refuse), the
    call's own error is still the one raised, with a note."""
    try:
        recorder.abandon()
    except Exception as failure:  # noqa: BLE001 - the recording's error is the news
        error.add_note(f"tracejit: running the ops recorded before this error failed too ({type(failure).__name__}: "
                       f"{str(failure).splitlines()[0] if str(failure) else ''}): their side effects may be missing")


def _returns_graph(result: Any, live_graph: Callable[[torch.Tensor], bool]) -> bool:
    """The call returns tensors with autograd history that no backward pass of the call freed. A leaf
    has no graph to lose, nor has a view of a leaf that requires grad (`model[2].bias[1:]`): calls
    without the host make such views again with gradients on (HostFreeRunner._grad_mode_views)."""
    return any(t.requires_grad and live_graph(t) and not _view_of_leaf(t) for t in _tensors_of(result))


def _view_of_leaf(tensor: torch.Tensor) -> bool:
    base = tensor._base
    return base is not None and base.is_leaf and base.requires_grad


def _containers_of(value: Any) -> list:
    if isinstance(value, (list, tuple)):
        return [value, *(c for v in value for c in _containers_of(v))]
    if isinstance(value, dict):
        return [value, *(c for v in value.values() for c in _containers_of(v))]
    return []


def _tensors_of(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_of(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_of(v)]
    return []


def _producer_source(record: Record, handle: int) -> str:
    producer = record.tensors[handle].producer
    return str(record.ops[producer].source) if producer is not None else "?"


def _record_itself(record: Record) -> Record:
    return record


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
