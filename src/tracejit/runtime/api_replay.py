"""Checked replay at the torch API level: the function runs and is checked, the program computes.

Once a trace has replayed at the aten level (record/api.py noting its torch-level calls), a call
runs the function under an `ApiChecker`, a `TorchFunctionMode` that matches each torch-level call
by position (same function, tensors wired to the same objects and values, Python numbers equal)
and answers it without computing: a value the trace computes is answered with a *placeholder*
(a tensor of the recorded layout over a shared scratch buffer, never read), an input or external
with the object itself, a metadata query or a `.grad` read with what it returned when recorded;
a `.grad` write is not performed. Nothing is dispatched to aten and no autograd graph is built.

Only when the whole function has run and matched does the host-free program (runtime/hostfree.py)
run, with its own guards: so a call that diverges has changed no tensor, and falls back to the
aten-level replay, which either follows the new path (a changed Python number, a re-record) or
raises its precise `TraceMismatchError`. The price of that fallback is that the function's own
Python side effects happen twice in such a call.

The learning rates the host-free program binds from `param_groups` are checked against the
numbers the optimizer passes; every other number must equal the recorded one.
"""

from __future__ import annotations

import operator
import sys
import weakref
from _thread import get_ident
from typing import Any

import numpy as np
import torch
from torch._C import _pop_torch_function_stack as POP_MODE
from torch._C import _push_on_torch_function_stack as PUSH_MODE
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import TraceMismatchError
from ..record.amp import ScalerStages
from ..record.api import (
    ARRAY_READS,
    RUN_FOR_REAL,
    ApiCall,
    ApiTrace,
    CallKind,
    RecordedNode,
    RefKind,
    TensorRef,
    array_in_use,
    function_name,
)
from ..record.autocast_keys import outside_autocast
from ..record.calls import rebuild_call, scalar_slot_names
from ..record.modes import HOST_READ_METHODS, CallContext, enter_api_checked_call, leave_api_checked_call
from ..record.reads import read_slice, storage_root
from ..record.record import HostRead, Kind, Record, math_bits
from ..record.recorder import version_of
from ..record.schedulers import SchedulerStates
from ..signature import attention_backends, autocast_state, call_context_key
from .api_match import FAIL, Numbers, answer_expr, match_lines, same_literal, template_refs
from .codegen import with_recorded_grad_mode
from .ddp_stand_in import DeferredWrites, distributed_refusal, seal_ddp_spans
from .early_finish import (
    METADATA_CALLS,
    Finished,
    autograd_query,
    draws_random,
    hand_over,
    pure_tail_start,
    read_where_it_is,
    take_back,
)
from .function_stand_ins import build_function_stand_ins
from .hostfree import MISS, HostFreeRunner
from .program import scalar_layout
from .realize import _store_outputs
from .stand_ins import build_module_stand_ins, build_stand_ins


class ApiDiverged(BaseException):  # noqa: N818 - control flow, not an error the user sees
    """Raised through the user's function when a call differs: unwinds it without computing.
    A BaseException, so that `except Exception` in the function does not swallow it."""


class ApiInterrupted(Exception):  # noqa: N818 - carries the function's own exception
    """The function raised a BaseException that is not an Exception (KeyboardInterrupt, SystemExit)
    during a checked call at the API level, where nothing was computed yet: the call runs at the
    aten level for eager's effects, and `raised` goes on (see trace._replay_api)."""

    def __init__(self, raised: BaseException, why: str):
        super().__init__(why)
        self.raised = raised


class ApiProgram:
    """The generated checks and answers of one trace's torch-level calls, and its placeholders."""

    def __init__(self, trace: ApiTrace, record: Record, runner: HostFreeRunner, output: Any, context: tuple,
                 externals: dict[int, torch.Tensor]):
        self.record = record
        self._batch: list[str] | None = None  # sources compiled together (see the steps below)
        self.external_objects = {h: weakref.ref(t) for h, t in externals.items()}  # by handle, for run_op_by_op
        # handle -> the call's slot in E: a gradient read where it is (located) or a rebound tensor
        # is there, not where the traced call found it (_bind_leaves)
        handle_of = {id(t): h for h, t in externals.items()}
        self.external_slot_of = {handle_of[id(obj)]: slot for slot, ref in enumerate(trace.externals)
                                 if (obj := ref()) is not None and id(obj) in handle_of}
        self.external_slot_of.update({handle: slot for slot, handle in trace.external_handles.items()})
        self.runner = runner
        self.context = context
        self.autocast = context[2] or context[4]  # autocast on for cpu or cuda (signature.call_context_key)
        self.external_refs = list(trace.externals)
        self.nones = (None,) * len(self.external_refs)
        # captured constants must not change (the aten level names the one that did); literals are
        # the record's own copies, which nobody else gets (`literal`)
        self.constants = [(weakref.ref(t), record.constant_versions[h], record.constant_storage.get(h, 0))
                          for h, t in record.constants.items() if h in record.constant_versions]
        self.literals: dict[int, torch.Tensor] = {}  # handle -> this call's copy of a literal
        self.literals_requiring_grad = frozenset(trace.literals_requiring_grad)
        self.calls = trace.calls
        self.funcs = [call.func for call in trace.calls]
        self.placeholders = _placeholders(record, trace, output)
        self.placeholder_values = list(self.placeholders.values())  # kept_placeholders' one C-level pass
        self.placeholder_handles = {id(t): h for h, t in self.placeholders.items()}
        self.off_record_readers: dict[tuple, Any] = {}  # (aten position, handle, func) -> _Reader
        self.namespace: dict[str, Any] = {"FAIL": FAIL, "EMPTY": {}, "SAME_LITERAL": same_literal,
                                          "TENSOR": torch.Tensor, "LIT": self.literal}
        self.locals = 0
        self.scalars = list(runner.bound_scalars)
        self.scalar_offsets, recorded_scalars = scalar_layout(record)
        self.last_backward = max((i for i, op in enumerate(record.ops) if op.backward_of), default=-1)
        # groups of forward slots one backward slot is linked to (`lam * x` and `lam * loss`): they
        # must hold one value when the program runs (checked in run_checked)
        self.agreeing: list[tuple[int, ...]] = []
        self.backward_links = _backward_links(record, self.scalar_offsets, recorded_scalars, self.scalars,
                                              self.last_backward, self.agreeing)
        self.located = _located_externals(trace.calls)
        # the program draws the call's random numbers after the function ran: the function must not
        # have moved the generator meanwhile (checked around it, see run_checked)
        self.draws = any(map(draws_random, record.ops))
        self.sources: list[str] = []
        self.checking_args: tuple | None = None  # the call being checked, for host reads
        self.checking_kwargs: dict | None = None
        self.reads_host = any(call.kind is CallKind.HOST_READ for call in trace.calls)  # _Reader needs the call
        self.read_kinds = [call.kind is CallKind.HOST_READ for call in trace.calls]
        self.scalers: ScalerStages | None = None  # the GradScalers the function reaches (set by the trace)
        self.schedulers: SchedulerStates | None = None  # and the LR schedulers (record/schedulers.py)
        self.call_context: CallContext | None = None  # the thread's context while a call runs, reused
        self.read_slices: dict = {}  # slice -> values, within one call
        # host reads after which only the record's pure tail runs: the program runs at the first
        # one this call makes (runtime/early_finish.py)
        self.finish_from = pure_tail_start(record)
        # the values the calls after such a read hand out (a `.grad` read included): their
        # placeholders get the program's values whether or not the function holds them yet
        first = next((call.index for call in trace.calls if call.kind is CallKind.HOST_READ and call.read is not None
                      and call.read[0] >= self.finish_from), len(trace.calls))
        tail_values: set[int] = set()
        for call in trace.calls[first + 1:]:
            if call.kind is not CallKind.REAL:
                template_refs(call.result, RefKind.VALUE, tail_values)
        self.tail_values = frozenset(tail_values)
        self.read_exports = runner.program.graph.read_exports | {
            h for h in runner.program.graph.escaped if record.tensors[storage_root(record, h)].kind is Kind.INTERNAL}
        self.finished: Finished | None = None  # this call's, once its program ran at a read
        self._finishable: tuple | None = None  # (the runner's early handles, whether the reads find them)
        self.finish_error: BaseException | None = None  # what the program raised when it ran at a read
        self.call_generator: torch.Tensor | None = None  # the generator's state when the call began
        # plain tensors the function reaches anew on every call (the next batch of an iterator)
        self.rebind_meta, self.rebind_at = _rebindable(trace, record, runner, set(self.located))
        self._rebinding: frozenset = frozenset()  # the slots the step being generated binds
        self.namespace["REBIND"] = self.rebind
        # one compile for the steps of all calls: a thousand small ones cost more than the code
        self._batch = []
        names = [self._step(call) for call in trace.calls]
        batch, self._batch = self._batch, None
        exec(compile("".join(batch), "<tracejit api steps>", "exec"), self.namespace)
        self.steps = [self.namespace[name] for name in names]
        # optimizer.step()/zero_grad() answered as a whole where the optimizer's state allows
        self.stand_ins, self.stand_ins_refused = build_stand_ins(self, trace.calls, trace.optimizer_calls, externals)
        # and torch.nn modules' forward, where the modules' state allows (DistributedDataParallel's
        # too: its state changes are written once the program has run, runtime/ddp_stand_in.py)
        self.deferred_writes = DeferredWrites()
        self.module_stand_ins, refused = build_module_stand_ins(self, trace.calls, trace.module_calls)
        self.stand_ins_refused.update(refused)
        # and torch.nn.utils' gradient clipping, where its arguments are the recorded ones
        self.function_stand_ins, refused = build_function_stand_ins(self, trace.calls, trace.function_calls)
        self.stand_ins_refused.update(refused)
        refusal = distributed_refusal(record, trace.calls, trace.module_calls)
        if refusal is not None:
            raise _NotReplayable(refusal)
        # external objects a call may find gone: gradients read where they are, DDP's temporaries
        self.may_be_gone = (set(self.located) | set(self.rebind_meta)
                            | seal_ddp_spans(self, trace, set(runner.external_slots.values())))
        self.checker = ApiChecker(self)
        # a tensor returned as it was found (`return y, queue.pop(0)`, `torch.get_rng_state()`):
        # the function's own object, which the program hands back
        passed = _passed_through(trace, record, runner, output, set(self.located))
        self.rebind_meta.update(passed)
        self.may_be_gone |= set(passed)
        self._rebinding = frozenset(passed)
        self.check_output = self._function("check_output", "value, A, E, P", match_lines("value", output, self) +
                                           ["return True"])
        self._rebinding = frozenset()

    # -- code generation ------------------------------------------------------------------------

    def constant(self, value: Any, prefix: str = "c") -> str:
        name = f"{prefix}{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def local(self) -> str:
        self.locals += 1
        return f"v{self.locals}"

    def literal(self, handle: int, recorded: torch.Tensor) -> torch.Tensor:
        """The answer for a literal (`torch.tensor(data)`): a copy of the recorded value made by the
        call that creates it, as eager makes a tensor on every call, and the same object afterwards."""
        made = self.literals.get(handle)
        if made is None:
            with torch._C.DisableTorchFunction():  # tracejit's copy, no call of the function
                made = self.literals[handle] = recorded.clone()
            if handle in self.literals_requiring_grad:  # torch.tensor(data, requires_grad=True)
                made.requires_grad_(True)
        return made

    def _function(self, name: str, params: str, body: list[str]) -> Any:
        source = f"def {name}({params}):\n" + "".join(f"    {line}\n" for line in body)
        self.sources.append(source)
        if self._batch is not None:  # compiled with the others (see __init__)
            self._batch.append(source)
            return name
        exec(compile(source, f"<tracejit api {name}>", "exec"), self.namespace)
        return self.namespace[name]

    def _step(self, call: ApiCall) -> Any:
        name = f"call{call.index}"
        params = "args, kwargs, A, E, P, S"
        if call.kind is CallKind.REAL:
            run = f"return {self.constant(call.func, 'f')}(*args, **kwargs)"
            if call.args is not None:  # `_set_grad_enabled(mode)`: the recorded mode
                return self._function(name, params, [f"if kwargs or args != {call.args!r}: return FAIL", run])
            return self._function(name, params, [run])
        if call.index in self.located.values():
            # a gradient read where it is: whichever tensor `p.grad` holds now stands for the recorded
            # one in the rest of the call (the host-free program binds gradients by place too)
            slot = call.result.key
            body = ["if len(args) != 1 or kwargs: return FAIL", *match_lines("args[0]", call.args[0], self),
                    f"v = {self.constant(call.func, 'f')}(args[0])",
                    "if not isinstance(v, TENSOR): return FAIL", f"E[{slot}] = v", "return v"]
            return self._function(name, params, body)
        if call.requires_grad is not None:
            # recorded as a no-op: it stays one while the tensor has the flag already
            body = [f"if len(args) != {len(call.args)}: return FAIL"]
            for i, template in enumerate(call.args):
                body += match_lines(f"args[{i}]", template, self)
            for key, template in call.kwargs.items():
                body += [f"if {key!r} not in kwargs: return FAIL", *match_lines(f"kwargs[{key!r}]", template, self)]
            body += [f"if len(kwargs) != {len(call.kwargs)} or args[0].requires_grad is not {call.requires_grad}: "
                     f"return FAIL", "return args[0]"]
            return self._function(name, params, body)
        if call.kind is CallKind.HOST_READ:
            # the read may come from a call other than the recorded one (a call that logged with
            # numpy() while the record did not): the record's refusal of arrays in use, for it too
            what = HOST_READ_METHODS.get(_short(call.name))
            if what in ARRAY_READS and array_in_use(self.record, HostRead(*call.read, what, call.source)):
                raise _NotReplayable(f"the host takes {what} of t{call.read[1]} at {call.source}, an array over its "
                                     f"memory, which the program reads, returns or keeps after the function ran")
            reader = self.constant(_Reader(self, call), "read")
            body = [f"if len(args) != {len(call.args)}: return FAIL"]
            for i, template in enumerate(call.args):
                body += match_lines(f"args[{i}]", template, self)
            return self._function(name, params, [*body, f"return {reader}(args, kwargs, S)"])
        body = [f"if len(args) != {len(call.args)}: return FAIL", self.autocast_check(call.autocast),
                *self.context_checks(call)]
        if call.kwargs:
            body.append(f"if kwargs.keys() != {self.constant(set(call.kwargs), 'k')}: return FAIL")
        else:
            body.append("if kwargs: return FAIL")
        numbers = Numbers(self._direct_slots(call), self.backward_links)
        self._rebinding = self.rebind_at.get(call.index, frozenset())
        for i, template in enumerate(call.args):
            numbers.key = ("arg", i)
            body += match_lines(f"args[{i}]", template, self, numbers)
        for key, template in call.kwargs.items():
            numbers.key = ("kw", key)
            body += match_lines(f"kwargs[{key!r}]", template, self, numbers)
        self._rebinding = frozenset()
        body.append(f"return {answer_expr(call.result, self)}")
        return self._function(name, params, body)

    def rebind(self, tensor: Any, inputs: list, externals: list, slot: int) -> bool:
        """At its first use in a call, a plain external (see _rebindable) may be another tensor of
        the recorded layout, in memory of its own: the program reads it from `externals` (the
        host-free runner's E). One in the memory of an input or another external (which the
        program may write) is a divergence."""
        handle, meta, inference = self.rebind_meta[slot]
        if (type(tensor) is not torch.Tensor or tensor.requires_grad or tensor._base is not None
                or tensor.shape != meta.shape or tensor.stride() != meta.stride or tensor.dtype != meta.dtype
                or tensor.device != meta.device or tensor.is_inference() is not inference
                or math_bits(tensor) != meta.math_bits):
            return False
        memory = tensor.untyped_storage().data_ptr()
        for other in (*inputs, *externals):
            if (isinstance(other, torch.Tensor) and other is not externals[slot]
                    and other.untyped_storage().data_ptr() == memory):
                return False
        externals[slot] = tensor
        self.external_objects[handle] = weakref.ref(tensor)  # for run_op_by_op and host reads
        return True

    def autocast_check(self, recorded: tuple | None) -> str:
        """The line that fails a call made under another autocast state than recorded: entering
        `torch.autocast` (or another dtype) inside the function changes what a call dispatches,
        and the mode never sees the switch."""
        if recorded is None:
            self.namespace["ANY_AUTOCAST"] = torch._C._is_any_autocast_enabled
            return "if ANY_AUTOCAST(): return FAIL"
        self.namespace["AUTOCAST"] = autocast_state
        return f"if AUTOCAST() != {self.constant(recorded, 'ac')}: return FAIL"

    def context_checks(self, call: ApiCall) -> list[str]:
        """Lines that fail a call made under another default dtype, or an attention call under other
        attention kernels, than recorded: the function may switch them itself, unseen by the mode."""
        self.namespace["DEFAULT_DTYPE"] = torch.get_default_dtype
        lines = [f"if DEFAULT_DTYPE() is not {self.constant(call.default_dtype, 'dd')}: return FAIL"]
        if call.attention is not None:
            self.namespace["ATTENTION"] = attention_backends
            lines.append(f"if ATTENTION() != {self.constant(call.attention, 'at')}: return FAIL")
        return lines

    def _direct_slots(self, call: ApiCall) -> dict:
        """Where the Python numbers of `call` go when it binds one aten op directly
        (`x.add_(y, alpha=a)` is aten.add_ with the dynamic scalar `alpha`): each top-level number
        argument whose schema name is that of one dynamic scalar slot holding the same value in
        the traced call. Anything else is matched exactly."""
        start, end = call.span
        if call.kind is not CallKind.COMPUTE:
            return {}
        if end - start == 2 and self.record.ops[start].op is _SCALAR_TENSOR:
            return self._wrapped_number_slot(call)
        if _short(call.name) in _RDIV and self.record.ops[start].op is _RECIPROCAL and all(
                op.op is _DETACH for op in self.record.ops[start + 1:end - 1]):
            # `k / t` is `t.reciprocal() * k` (torch/_tensor.py; with grad, autograd saves the
            # reciprocal: a detach between them): the number is the mul's
            start = end - 1
        elif end - start != 1:
            return {}
        before_backward = start < self.last_backward
        if before_backward and self.backward_links is None:
            # Autograd saves such a number for a backward op (`loss * scale` multiplies the
            # gradient by `scale`), which the API level does not see: the program would compute
            # backward with the traced value. Before the last backward, numbers are matched exactly
            # (a new one runs the call at the aten level, where backward gets it) unless
            # _backward_links found every backward op that takes them.
            return {}
        op = self.record.ops[start]
        if not isinstance(op.op, torch._ops.OpOverload) or _direct_name(call.name) != op.op._schema.name.split("::")[-1]:
            return {}
        names = scalar_slot_names(op.op, op.statics)
        offset = self.scalar_offsets[start]
        seen = self.scalars[offset:offset + len(names)]  # what the op got in the traced call
        schema = [a.name for a in op.op._schema.arguments]
        slots = {}
        arguments = [(("arg", i), schema[i] if i < len(schema) else None, v) for i, v in enumerate(call.args)]
        arguments += [(("kw", k), k, v) for k, v in call.kwargs.items()]
        for key, name, value in arguments:
            indexes = [i for i, n in enumerate(names) if n == name]
            if type(value) in _NUMBERS and len(indexes) == 1:
                items = [(key, value)]
            elif type(value) in (list, tuple) and value and len(indexes) == len(value) and all(
                    type(v) in (int, float) for v in value):
                items = [((*key, j), v) for j, v in enumerate(value)]  # a ScalarList: one slot each
            else:
                continue
            for (item_key, item), index in zip(items, indexes):
                # a numpy float64 (a learning rate computed with numpy) reaches the op as a float
                if type(seen[index]) is _AS_PASSED.get(type(item), type(item)) and seen[index] == item:
                    slots[item_key] = offset + index
        if before_backward:  # only the numbers seen to change, with the backward slots that changed with them
            slots = {key: slot for key, slot in slots.items() if len(key) == 2 and slot in self.backward_links}
        return slots

    def _wrapped_number_slot(self, call: ApiCall) -> dict:
        """`torch.where(c, x, k)`: the number becomes a tensor (aten.scalar_tensor) that the one op
        named like the call takes. With one number among the arguments, holding the value that
        op got in the traced call, that number is the scalar_tensor's slot."""
        start = call.span[0]
        # before backward only a mul's or div's number is ever linked (_backward_links): this one is matched
        if start < self.last_backward or _direct_name(call.name) != self.record.ops[start + 1].op._schema.name.split("::")[-1]:
            return {}
        numbers = [(("arg", i), v) for i, v in enumerate(call.args) if type(v) in (int, float)]
        numbers += [(("kw", k), v) for k, v in call.kwargs.items() if type(v) in (int, float)]
        offset = self.scalar_offsets[start]
        if len(numbers) != 1 or self.scalar_offsets[start + 1] != offset + 1:
            return {}
        (key, value), seen = numbers[0], self.scalars[offset]
        return {key: offset} if type(seen) is type(value) and seen == value else {}

    # -- per call -------------------------------------------------------------------------------

    def constants_changed(self) -> bool:
        for ref, version, storage in self.constants:
            tensor = ref()
            if tensor is None or version_of(tensor) != version or (storage and tensor.untyped_storage().data_ptr() != storage):
                return True
        return False

    def leaf_handle(self, tensor: torch.Tensor, inputs: list, externals: list) -> int | None:
        """The handle of an input or external the call holds (ApiChecker._off_record), or None."""
        record = self.record
        for handle, arg in zip(record.arg_handles, self.checking_args or ()):
            if arg is tensor:
                return handle
        for name, handle in record.kwarg_handles.items():
            if (self.checking_kwargs or {}).get(name) is tensor:
                return handle
        for handle, slot in self.external_slot_of.items():
            if slot < len(externals) and externals[slot] is tensor:
                return handle
        return next((h for h, ref in self.external_objects.items() if ref() is tensor), None)

    def read_off_record(self, func: Any, handle: int, position: int, args: tuple, kwargs: dict,
                        scalars: list) -> Any:
        """A host read at checker position `position` that the record does not have (ApiChecker._off_record)."""
        at = self.calls[position].span[0] if position < len(self.calls) else len(self.record.ops)
        key = (at, handle, func)
        reader = self.off_record_readers.get(key)
        if reader is None:
            try:
                reader = _Reader(self, ApiCall(-1, func, _name(func), CallKind.HOST_READ, (at, at), None, {}, None,
                                               None, read=(at, handle)))
            except _NotReplayable as why:
                raise ApiDiverged(str(why)) from None
            self.off_record_readers[key] = reader
        try:
            return reader(args, kwargs, scalars)
        except KeyError:  # not made by this point of the record (a tensor kept from another call)
            raise ApiDiverged(f"a host read of t{handle} before the record makes it") from None

    def can_finish(self) -> bool:
        """Whether the program may run at this call's first read after which only the pure tail
        runs: every read after it (recorded) finds its value in what the program leaves, and the
        call has neither diverged, nor moved the generator, nor passed disagreeing numbers."""
        checker, early = self.checker, self.runner.early
        if checker.diverged is not None or not early.handles:
            return False
        if self._finishable is None or self._finishable[0] is not early.handles:
            record = self.record
            self._finishable = (early.handles, all(
                (call.read[1] in early.handles or read_where_it_is(record, call.read[1]))
                and not (call.read_requires_grad and _short(call.name) in _TEXT_READS)  # see _Reader.textual
                for call in self.calls
                if call.kind is CallKind.HOST_READ and call.read is not None and call.read[0] >= self.finish_from))
        if not self._finishable[1] or (self.agreeing and _disagreeing(self.agreeing, checker.scalars)):
            return False
        # the program runs in the caller's context: not inside an autocast, inference_mode or
        # default dtype the function entered (grad mode it sets itself)
        if call_context_key()[1:] != self.context[1:]:
            return False
        generator = self.call_generator
        return generator is None or torch.equal(torch.default_generator.get_state(), generator)

    def finish_early(self, source: str) -> None:
        """Run the program at the host read at `source` (runtime/early_finish.py); on a guard that
        fails, the call goes on as before and the program runs after it (and misses again)."""
        checker, runner = self.checker, self.runner
        runner.early.on = True
        try:
            with torch._C.DisableTorchFunction():
                output = runner.call(self.checking_args, self.checking_kwargs, checker.scalars, checker.externals)
        except BaseException as error:
            self.finish_error = error  # raised for the call, as after the function (no aten-level rerun)
            raise
        finally:
            runner.early.on = False
            values, runner.early.values = runner.early.values, None
        if output is MISS:
            return
        if self.deferred_writes.pending:
            self.deferred_writes.apply()
        self.finished = Finished(output, values or {}, list(checker.scalars),
                                 hand_over(self.placeholders, values or {}, self.tail_values), source)

    def value_after_finish(self, handle: int) -> torch.Tensor:
        """A value the host reads once the program ran: the program's, or an input or external as
        it is now (the tail after the read writes none)."""
        value = self.finished.values.get(handle)
        if value is not None:
            return value
        if read_where_it_is(self.record, handle):
            env = _bind_leaves(self, self.checking_args, self.checking_kwargs, [handle], self.checker.externals)
            if env is not None:
                return env[handle]
        raise ApiDiverged(f"a host read of t{handle}, which the program that ran at the read at "
                          f"{self.finished.source} does not leave (the traced call did not read it there)")

    def externals(self) -> list | None:
        """The external objects of this call; None if one the call needs is gone (a gradient read
        where it is need not be the recorded object: its reading call binds it)."""
        objects = list(map(operator.call, self.external_refs))
        if any(map(operator.is_, objects, self.nones)) and any(
                o is None and slot not in self.may_be_gone for slot, o in enumerate(objects)):
            return None
        return objects

    def kept_placeholders(self) -> dict[int, torch.Tensor]:
        """Placeholders something outside the checker still holds (the function kept a value the
        traced call did not), by handle. Each is handed over to its holder: it gets storage of its
        own and the program a new placeholder for later calls."""
        placeholders = self.placeholders
        # held by the dict, placeholder_values and getrefcount's argument: by nothing else
        if max(map(sys.getrefcount, self.placeholder_values), default=0) <= 3:
            return {}
        kept = {}
        for handle in placeholders:
            if sys.getrefcount(placeholders[handle]) > 3:
                kept[handle] = placeholders[handle]
        handles = self.placeholder_handles
        for handle, tensor in kept.items():
            meta = self.record.tensors[handle].meta
            placeholders[handle] = fresh = tensor.detach()  # same layout over the scratch buffer
            del handles[id(tensor)]
            handles[id(fresh)] = handle
            tensor.set_(torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=meta.device))
        self.placeholder_values = list(placeholders.values())
        return kept


def _rebindable(trace: ApiTrace, record: Record, runner: HostFreeRunner,
                located: set[int]) -> tuple[dict[int, tuple[int, Any]], dict[int, frozenset]]:
    """The external slots a call may bind to other tensors than recorded, with the handle and
    layout of each, and the call (its first use) that binds them. The function may reach a new
    tensor on every call where the trace holds the first one (`x, y = next(batches)`), which the
    aten level binds as it comes; matched by identity, each such call left the API level and ran
    the function a second time, its `next()` included. Only tensors the program reads and nothing
    else knows: no parameter or tensor requiring grad, no view, not written by the program, no
    gradient read where it is, never handed out as a call's result."""
    handle_of = {slot: handle for handle, slot in runner.external_slots.items()}
    written = {h for op in record.ops for h in (*op.outputs, *op.mutated) if h is not None}
    kept_views = runner.program.hoisted_roots
    answered = set()
    for call in trace.calls:
        template_refs(call.result, RefKind.EXTERNAL, answered)
    meta, first_use, seen = {}, {}, set()
    for call in trace.calls:
        used = template_refs((call.args, call.kwargs), RefKind.EXTERNAL, set()) - seen
        seen |= used
        for slot in used:
            handle = handle_of.get(slot)
            obj = trace.externals[slot]()
            if (call.kind is not CallKind.COMPUTE or handle is None or obj is None or type(obj) is not torch.Tensor
                    or obj.requires_grad or obj._base is not None or slot in located or slot in answered
                    or handle in written or handle in kept_views or record.tensors[handle].base is not None
                    or record.tensors[handle].kind is not Kind.EXTERNAL):
                continue
            meta[slot] = (handle, record.tensors[handle].meta, obj.is_inference())
            first_use.setdefault(call.index, set()).add(slot)
    return meta, {index: frozenset(slots) for index, slots in first_use.items()}


def _passed_through(trace: ApiTrace, record: Record, runner: HostFreeRunner, output: Any,
                    located: set[int]) -> dict[int, tuple[int, Any, bool]]:
    """The external slots the call returns untouched (`return y, queue.pop(0)`): no torch call
    takes or answers them and no op reads or writes them, so a later call may return another
    tensor there (rebound as _rebindable's are, when the output is checked)."""
    handle_of = {slot: handle for handle, slot in runner.external_slots.items()}
    used = set()
    for call in trace.calls:
        template_refs((call.args, call.kwargs, call.result), RefKind.EXTERNAL, used)
    touched = {h for op in record.ops for h in (*op.inputs, *op.outputs, *op.mutated) if h is not None}
    passed = {}
    for slot in template_refs(output, RefKind.EXTERNAL, set()) - used - located:
        handle = handle_of.get(slot)
        obj = trace.externals[slot]()
        if (handle is None or handle in touched or obj is None or type(obj) is not torch.Tensor or obj.requires_grad
                or obj._base is not None or record.tensors[handle].base is not None
                or record.tensors[handle].kind is not Kind.EXTERNAL):
            continue
        passed[slot] = (handle, record.tensors[handle].meta, obj.is_inference())
    return passed


def _located_externals(calls: list[ApiCall]) -> dict[int, int]:
    """external slot -> the call that introduces it by reading a `.grad` (`opt.zero_grad()` at the
    start of a step reads the previous step's gradients, which it then frees: the recorded objects
    are gone on the next call, and `p.grad` holds that call's)."""
    seen: set[int] = set()
    located = {}
    for call in calls:
        result = call.result
        if (call.kind is CallKind.VIRTUAL and call.name.endswith("grad.__get__") and isinstance(result, TensorRef)
                and result.kind is RefKind.EXTERNAL and result.key not in seen
                and not template_refs((call.args, call.kwargs), RefKind.EXTERNAL, set()) & {result.key}):
            located[result.key] = call.index
        seen |= template_refs((call.args, call.kwargs, result), RefKind.EXTERNAL, set())
    return located


def gradient_owners(trace: ApiTrace, external_slots: dict[int, int]) -> dict[int, int]:
    """gradient handle -> handle of the parameter whose `.grad` the function read it as. A gradient
    the call freed (`zero_grad()` after a step that accumulated into it) is gone by now: it goes by
    the handle the tracer noted while it was alive, and the program reads it where it is (hostfree)."""
    handle_of = {slot: handle for handle, slot in external_slots.items()}
    gone = {slot: handle for slot, handle in trace.external_handles.items() if trace.externals[slot]() is None}
    grad_of = {**gone, **handle_of}
    owners = {}
    for call in trace.calls:
        result, args = call.result, call.args
        if (call.kind is CallKind.VIRTUAL and call.name.endswith("grad.__get__") and isinstance(result, TensorRef)
                and result.kind is RefKind.EXTERNAL and args and isinstance(args[0], TensorRef)
                and args[0].kind is RefKind.EXTERNAL and result.key in grad_of and args[0].key in handle_of):
            owners[grad_of[result.key]] = handle_of[args[0].key]
    return owners


class _Reader:
    """Answers a host read (`step.item()`, `bool(flag)`): the value is computed when it is read, by
    the slice of the record that leads to it, with this call's numbers so far; inputs the slice
    writes in place are copied first, so the program that runs after the call finds them untouched."""

    def __init__(self, program: ApiProgram, call: ApiCall):
        record = program.record
        position, handle = call.read
        self.position = position
        self.func = call.func
        # a repr() of a tensor requiring grad: eager prints `grad_fn=<NllLossBackward0>` (or
        # `requires_grad=True`), which a value computed without autograd has not
        self.textual = _short(_name(call.func)) in _TEXT_READS and call.read_requires_grad
        self.handle = handle
        self.ops, _ = read_slice(record, position, handle)
        self.draws = any(draws_random(record.ops[i]) for i in self.ops)
        if self.draws:
            # The program draws the call's random numbers in record order from where the generator
            # stands after the function: the slice draws every random op before the read in that
            # order, from there, and puts the generator back (a loss behind dropout, logged)
            ops = set(self.ops)
            for index in range(position):
                op = record.ops[index]
                if draws_random(op):
                    if not _default_cpu_generator(record, op):
                        raise _NotReplayable(f"the host reads t{handle}, which depends on the random op {op.name} "
                                             f"at {op.source}, and {op.name} at {op.source} draws from a generator "
                                             f"of its own or on a device")
                    for output in op.outputs + op.mutated:
                        if output is not None:
                            ops.update(read_slice(record, index + 1, output)[0])
            self.ops = sorted(ops)
        self.leaves = sorted({h for i in self.ops for h in record.ops[i].inputs if record.tensors[h].kind is not Kind.INTERNAL}
                             | ({handle} if record.tensors[handle].kind is not Kind.INTERNAL else set()))
        # the leaves in memory the slice writes, directly or through a view (`x[0].add_(1)`,
        # `buf.data.add_(1)`): every one that shares that memory, so the slice sees its own writes
        written = {storage_root(record, h) for i in self.ops for h in record.ops[i].mutated}
        self.copied = [h for h in self.leaves if storage_root(record, h) in written]
        self.program = program
        self.offsets = program.scalar_offsets
        self.key = (tuple(self.ops), tuple(self.leaves))
        self.finishing = call.index >= 0 and position >= program.finish_from  # a recorded read after which the tail runs
        self.source = call.source

    def __call__(self, args: tuple, kwargs: dict, scalars: list) -> Any:
        program = self.program
        if self.textual and not (len(args) > 1 and args[1]):  # format(t, ".4f") prints the number alone
            raise ApiDiverged(f"repr() of t{self.handle}, which requires grad: the aten level prints eager's text")
        if program.finished is None and self.finishing and program.can_finish():
            program.finish_early(self.source)
        if program.finished is not None:
            return self.func(program.value_after_finish(self.handle), *args[1:], **kwargs)
        # Reads that need the same slice in one call share its run (foreach Adam reads every
        # step count after one _foreach_add_): the numbers it used cannot have changed since.
        env = program.read_slices.get(self.key)
        if env is None:
            env = self._run(scalars)
            program.read_slices[self.key] = env
        return self.func(env[self.handle], *args[1:], **kwargs)

    def _run(self, scalars: list) -> dict:
        record = self.program.record
        env = _bind_leaves(self.program, self.program.checking_args, self.program.checking_kwargs, self.leaves,
                           self.program.checker.externals)
        if env is None:
            raise ApiDiverged("an object the trace uses is gone")
        generator = torch.default_generator.get_state() if self.draws else None
        try:
            with torch.no_grad(), _disable_current_modes(), torch._C.DisableTorchFunction(), outside_autocast():
                _copy_memory(env, self.copied)
                for index in self.ops:
                    op = record.ops[index]
                    values = scalars[self.offsets[index]:self.offsets[index] + len(op.scalars)]
                    call_args, call_kwargs = rebuild_call(op.statics, [env[h] for h in op.inputs], values)
                    _store_outputs(op, op.op(*call_args, **call_kwargs), env)
        finally:
            if generator is not None:
                torch.default_generator.set_state(generator)
        return env


# reads whose answer is a Python value: not numpy() or __array__ (an array over the reader's copy
# would not see the program's writes, nor the program its own), nor repr() and format() (computed
# without grad, they would lose the `grad_fn=` eager prints), which diverge as before
_TEXT_READS = frozenset({"__repr__", "__format__", "__str__"})
_OFF_RECORD_READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__"})


def _default_cpu_generator(record: Record, op: Any) -> bool:
    """A random op on the CPU drawing from torch's default generator (no `generator=` of its own)."""
    def generators(value: Any) -> bool:
        if isinstance(value, torch.Generator):
            return True
        if isinstance(value, (list, tuple)):
            return any(map(generators, value))
        if isinstance(value, dict):
            return any(map(generators, value.values()))
        return False
    written = [h for h in (*op.outputs, *op.mutated) if h is not None]
    return not generators(op.statics) and all(record.tensors[h].meta.device.type == "cpu" for h in written)


def _copy_memory(env: dict, handles: list[int]) -> None:
    """Points each of `handles` at a copy of its memory, with its own size, strides and offset:
    tensors that share memory share the copy, so a write through one is read through another.
    Only the bytes they span are copied (a counter's view of a large buffer copies the counter)."""
    groups: dict[int, list[int]] = {}
    for handle in handles:
        groups.setdefault(env[handle].untyped_storage().data_ptr(), []).append(handle)
    for members in groups.values():
        spans = [_byte_span(env[h]) for h in members]
        low = min(first for first, _ in spans) // 16 * 16  # aligned for every element size
        high = max(end for _, end in spans)
        storage = env[members[0]].untyped_storage()
        copy = torch.empty((0,), dtype=torch.uint8, device=env[members[0]].device).set_(
            storage, low, (high - low,)).clone().untyped_storage()
        for handle in members:
            tensor = env[handle]
            size = tensor.element_size()
            env[handle] = torch.empty((0,), dtype=tensor.dtype, device=tensor.device).set_(
                copy, (tensor.storage_offset() * size - low) // size, tensor.size(), tensor.stride())


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The first byte of the storage a tensor reads and the one past its last (for a strided view
    with nonnegative strides, as views are)."""
    size = tensor.element_size()
    first = tensor.storage_offset() * size
    if tensor.numel() == 0:
        return first, first
    last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.size(), tensor.stride()))
    return first, (last + 1) * size


def _bind_leaves(program: ApiProgram, args: tuple, kwargs: dict, handles: Any, externals: Any = ()) -> dict | None:
    """handle -> tensor for the inputs, externals and constants among `handles`; None if an
    external is gone. `externals` is the call's E: what it holds now (a gradient the call read
    where it is, `p.grad` replaced since the trace was noted) stands for the recorded object."""
    record = program.record
    slot_of = program.external_slot_of if externals else {}
    env = {}
    inputs = {h: a for h, a in zip(record.arg_handles, args)}
    inputs.update((h, kwargs[name]) for name, h in record.kwarg_handles.items())
    for handle in handles:
        if handle in inputs:
            env[handle] = inputs[handle]
        elif handle in record.constants:  # a literal: the record's copy stays as recorded
            env[handle] = record.constants[handle].clone() if record.tensors[handle].literal else record.constants[handle]
        else:
            slot = slot_of.get(handle)
            if slot is not None and slot < len(externals) and isinstance(externals[slot], torch.Tensor):
                env[handle] = externals[slot]
                continue
            ref = program.external_objects.get(handle)
            env[handle] = ref() if ref is not None else None
            if env[handle] is None:
                return None
    return env


class _NotReplayable(Exception):
    """The API level cannot replay this trace (the message says why)."""


# dunder methods and the aten ops they bind
_DUNDERS = {"__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__rsub__": "rsub",
            "__isub__": "sub_", "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "__truediv__": "div",
            "__itruediv__": "div_", "__pow__": "pow", "__ipow__": "pow_", "__floordiv__": "floor_divide",
            "__and__": "bitwise_and", "__or__": "bitwise_or", "__xor__": "bitwise_xor", "__eq__": "eq",
            "__rdiv__": "mul", "__rtruediv__": "mul"}  # the second op of their span (_direct_slots)
_SCALAR_TENSOR = torch.ops.aten.scalar_tensor.default
_RECIPROCAL, _DETACH = torch.ops.aten.reciprocal.default, torch.ops.aten.detach.default
_RDIV = ("__rdiv__", "__rtruediv__")


# The backward nodes known to take their forward op's number as it is: MulBackward0 multiplies
# the gradient by the `other` of `x * k`, DivBackward0 divides it by that of `x / k`
_SAME_NUMBER_BACKWARD = {"mul": "MulBackward0", "div": "DivBackward0"}


def _backward_links(record: Record, offsets: list[int], recorded: list, now: list, last_backward: int,
                    agreeing: list) -> dict | None:
    """Which backward ops take the numbers forward ops took, seen from two calls: the recorded one
    and the one the API level is built from. A number of a forward `mul` or `div` that changed
    between them (`loss * w` with a new `w`) is linked to the slots of its kind of backward node
    (MulBackward0, DivBackward0) that changed from the same value to the same value. Returns forward
    slot -> its backward slots, for those numbers; None when any other backward slot changed: two
    equal pairs of values are no proof of one number (PowBackward's `k - 1` can move as a loss
    weight does), so then no number before the last backward is passed on, and a new one runs its
    call at the aten level. A backward slot that matches several forward numbers (mixup's `lam`
    scales the input, which needs no gradient, and the loss) is linked to each, and the group is
    appended to `agreeing`: a call passes them on only while they hold one value."""
    if last_backward < 0:
        return {}
    owner = [i for i, op in enumerate(record.ops) for _ in op.scalars]
    changed = [slot for slot, (a, b) in enumerate(zip(recorded, now, strict=True))
               if type(a) is not type(b) or a != b]

    def kind(slot: int) -> str | None:
        op = record.ops[owner[slot]]
        name = op.op._schema.name.split("::")[-1] if isinstance(op.op, torch._ops.OpOverload) else None
        return _SAME_NUMBER_BACKWARD.get(name) if owner[slot] < last_backward and not op.backward_of else None

    forward = [s for s in changed if kind(s) is not None]
    links: dict[int, list[int]] = {slot: [] for slot in forward}
    for slot in changed:
        node = record.ops[owner[slot]].backward_of
        if not node:
            continue
        same = [f for f in forward if kind(f) == node and type(recorded[f]) is type(recorded[slot])
                and recorded[f] == recorded[slot] and now[f] == now[slot]]
        if not same:
            return None
        for forward_slot in same:
            links[forward_slot].append(slot)
        if len(same) > 1 and tuple(same) not in agreeing:
            agreeing.append(tuple(same))
    return {slot: tuple(found) for slot, found in links.items()}


def _disagreeing(groups: list[tuple[int, ...]], scalars: list) -> bool:
    """Whether the forward numbers of one backward slot hold other values in this call."""
    for group in groups:
        first = scalars[group[0]]
        if any(type(scalars[slot]) is not type(first) or scalars[slot] != first for slot in group[1:]):
            return True
    return False


def _direct_name(name: str) -> str:
    short = name.rsplit(".", 1)[-1]
    return _DUNDERS.get(short, short)


def visible_values(trace: ApiTrace, output: Any) -> set[int]:
    """The handles of the values the function sees at the API level (each gets a placeholder)."""
    handles: set = set()
    for call in trace.calls:
        if call.kind is not CallKind.REAL:
            template_refs((call.args, call.kwargs, call.result), RefKind.VALUE, handles)
    template_refs(output, RefKind.VALUE, handles)
    return handles


def held_after_calls(trace: ApiTrace, output: Any) -> set[int]:
    """The values the function's own code may still hold late in the call: those of the calls it
    makes itself, and what module forwards, optimizer methods and clipping it calls return, not
    the values those compute inside (gone with their frames, unless kept in state: escaped)."""
    inside: set[int] = set()
    for span in (*trace.module_calls, *trace.optimizer_calls, *trace.function_calls):
        inside.update(range(span.start, span.end))
    handles: set = set()
    for call in trace.calls:
        if call.kind is not CallKind.REAL and call.index not in inside:
            template_refs((call.args, call.kwargs, call.result), RefKind.VALUE, handles)
    for span in (*trace.module_calls, *trace.function_calls):
        template_refs(span.result, RefKind.VALUE, handles)
    template_refs(output, RefKind.VALUE, handles)
    return handles


def _placeholders(record: Record, trace: ApiTrace, output: Any) -> dict[int, torch.Tensor]:
    """One placeholder per value the function sees: its recorded layout over one scratch buffer per
    device and dtype, as large as the largest of them (they are never read or written)."""
    handles = visible_values(trace, output)
    spans: dict[tuple, int] = {}
    for handle in handles:
        meta = record.tensors[handle].meta
        span = 1 + sum((size - 1) * stride for size, stride in zip(meta.shape, meta.stride) if size > 0)
        key = (meta.device, meta.dtype)
        spans[key] = max(spans.get(key, 0), span if all(meta.shape) else 0)
    scratch = {key: torch.empty(max(span, 1), dtype=key[1], device=key[0]) for key, span in spans.items()}
    placeholders = {}
    for handle in sorted(handles):
        meta = record.tensors[handle].meta
        placeholders[handle] = scratch[(meta.device, meta.dtype)].as_strided(meta.shape, meta.stride)
    return placeholders


class ApiChecker(TorchFunctionMode):
    """Matches and answers the torch-level calls of one call (see module docstring)."""

    def __init__(self, program: ApiProgram):
        super().__init__()
        self.steps = program.steps
        self.funcs = program.funcs
        self.count = len(program.steps)
        # the flag each recorded `torch._C._set_grad_enabled(flag)` passed (None for other calls)
        self.grad_modes = [call.args[0] if call.kind is CallKind.REAL and call.args else None for call in program.calls]
        self.program = program
        self.placeholders = program.placeholders
        self.derived: dict[int, weakref.ref] = {}
        self.start([], [])

    def start(self, inputs: list, externals: list) -> ApiChecker:
        """Ready for one call (the program's one checker serves its calls one after the other)."""
        self.inputs = inputs
        self.externals = externals
        self.scalars = list(self.program.scalars)  # the numbers this call passes to the program
        self.position = 0
        self.thread = get_ident()  # the stand-ins answer this thread's calls only
        self.diverged: str | None = None
        self.stood_in = 0  # optimizer methods answered as a whole (runtime/stand_ins.py)
        self.steps_answered: dict[int, int] = {}  # id(optimizer) -> its step() calls answered so far
        self.stood_in_modules = 0  # torch.nn module calls answered as a whole
        self.stood_in_ddp = 0  # of which DistributedDataParallel calls (runtime/ddp_stand_in.py)
        self.stood_in_functions = 0  # gradient clipping calls (runtime/function_stand_ins.py)
        self.continued = False  # the rest of the call runs eagerly (_after_finish)
        if self.derived:
            self.derived = {}  # id -> what it computes from the program's values (weakly)
        return self

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.continued:
            return self._after_finish(func, args, kwargs or {})
        position = self.position
        if self.diverged is not None and _short(_name(func)) in RUN_FOR_REAL:
            return func(*args, **(kwargs or {}))  # unwinding: `finally` blocks restore grad mode
        same_function = False
        if position < self.count and self.diverged is None:
            recorded = self.funcs[position]
            same_function = func is recorded or func == recorded
            if same_function:
                answer = self.steps[position](args, kwargs or {}, self.inputs, self.externals, self.placeholders,
                                              self.scalars)
                if answer is not FAIL:
                    self.position = position + 1
                    return answer
        if self.diverged is None:
            answer = self._off_record(func, args, kwargs or {}, position)
            if answer is not FAIL:
                return answer
            if self.program.finished is not None:
                if _name(func) in METADATA_CALLS:  # a placeholder has the recorded metadata
                    with _WITHOUT_MODES():
                        return func(*args, **(kwargs or {}))
                # The program ran at a read: the state is eager's at this point, and every value the
                # function holds is real (early_finish.hand_over). The rest of the call runs eagerly.
                self.continued = True
                return self._after_finish(func, args, kwargs or {})
        if _short(_name(func)) in RUN_FOR_REAL:
            # An exception the function raises (a KeyError inside optimizer.step()) runs `finally`
            # blocks that restore grad mode: they must restore it, and the exception must go on,
            # so the divergence is noted without raising (the next torch call raises it).
            self.diverged = self.diverged or f"call #{position} {_name(func)} is not the recorded call"
            return func(*args, **(kwargs or {}))
        if position >= self.count:
            self.diverge(f"an extra call {_name(func)} after the {self.count} recorded ones")
        call = self.program.calls[position]
        if same_function:
            self.diverge(f"call #{position} {call.name} has other arguments than recorded at {call.source}")
        self.diverge(f"call #{position} is {_name(func)}, recorded {call.name} at {call.source}")

    def _after_finish(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A torch call after the program ran at a read and the call went otherwise than recorded:
        run for real, on the values the placeholders hold. Their autograd history is not eager's
        (they have none, nor has what is computed from them here), so autograd's attributes of
        one, and its text (`grad_fn=<...>`), raise; a forward of the parameters has eager's."""
        name = _name(func)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        without_history = [t for t in tensors if self._without_history(t)]
        if without_history and (autograd_query(name) or (_short(name) in _TEXT_READS and not (len(args) > 1 and args[1]))):
            self.diverge(f"{name} of a value the program computed without autograd")
        with _WITHOUT_MODES():
            result = func(*args, **kwargs)
        if without_history:
            for value in (result if isinstance(result, (tuple, list)) else (result,)):
                if isinstance(value, torch.Tensor):
                    self.derived[id(value)] = weakref.ref(value)
        return result

    def _without_history(self, tensor: torch.Tensor) -> bool:
        """A placeholder holding the program's value, or a value computed from one after it ran."""
        handle = self.program.placeholder_handles.get(id(tensor))
        if handle is not None and self.placeholders.get(handle) is tensor:
            return True
        derived = self.derived.get(id(tensor))  # (a WeakSet would compare tensors with ==)
        return derived is not None and derived() is tensor

    def _off_record(self, func: Any, args: tuple, kwargs: dict, position: int) -> Any:
        """A host read the record does not have (`loss.item()` logged every 100th call) of a value
        the call computed, an input or an external: answered with the value at this point,
        computed as a recorded read's is (_Reader), without moving. Or the recorded call after host
        reads this call skips (the traced call logged, this one does not): a read changes no
        tensor, so the call goes on there. FAIL otherwise."""
        if _short(_name(func)) in _OFF_RECORD_READS and args and isinstance(args[0], torch.Tensor):
            handle = self.program.placeholder_handles.get(id(args[0]))
            if handle is None or self.placeholders[handle] is not args[0]:
                handle = self.program.leaf_handle(args[0], self.inputs, self.externals)
            if handle is not None:
                try:
                    return self.program.read_off_record(func, handle, position, args, kwargs, self.scalars)
                except ApiDiverged as why:
                    self.diverge(str(why))
            return FAIL
        after = self._past_reads(position)
        if after == position or after == self.count or not (func is self.funcs[after] or func == self.funcs[after]):
            return FAIL
        answer = self.steps[after](args, kwargs, self.inputs, self.externals, self.placeholders, self.scalars)
        if answer is not FAIL:
            self.position = after + 1
        return answer

    def region(self, regions: dict) -> Any:
        """The stand-in region (keyed by the position its span starts at) here, or after the
        recorded host reads here, which this call may skip (_off_record); None if neither."""
        region = regions.get(self.position)
        if region is not None or self.position >= self.count or not self.program.read_kinds[self.position]:
            return region
        return regions.get(self._past_reads(self.position))

    def _past_reads(self, position: int) -> int:
        """The first position from `position` on that is not a recorded host read."""
        read_kinds = self.program.read_kinds
        while position < self.count and read_kinds[position]:
            position += 1
        return position

    def diverge(self, why: str) -> None:
        if self.diverged is None:
            self.diverged = why
        raise ApiDiverged(self.diverged)

    # the handler protocol of a traced call (modes.Handler): none of these happen in a matching call
    def on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.continued:
            return func(*args, **kwargs)
        self.diverge(f"aten op {func} dispatched outside a recorded torch call")

    def on_host_read(self, tensor: torch.Tensor, what: str) -> None:
        if not self.continued:
            self.diverge(f"a host read {what} the record does not have")

    def on_excluded_block(self) -> None:
        if self.program.finished is not None:  # eager code, after the program ran: the rest runs eagerly
            self.continued = True
        if not self.continued:
            self.diverge("an exclude_from_trace() block the record does not have")


# Two ways into the checker that cost more than its own work, shortened while a checked call runs
# (installed around the function, and only acting on the thread whose innermost mode is the
# checker: a mode the function entered itself, or another thread, get torch's way):
# - torch's functions written in Python (F.relu, F.cross_entropy, Tensor.backward) reach a mode
#   through torch.overrides.handle_torch_function, which finds the overloaded arguments and pops
#   the mode in a contextlib block: 1.3 us more than a C function reaching the same mode. Their
#   modules' binding of it goes straight to the checker;
# - torch.no_grad() and the like set grad mode through torch._C._set_grad_enabled, a C function
#   the mode sees (1.5 us each way). Where the record has that call next it runs without the mode.
_PYTHON_API_MODULES = (torch.nn.functional, torch._tensor)
_TORCH_HANDLER = torch.overrides.handle_torch_function
_STACK_DEPTH = torch._C._len_torch_function_stack
_STACK_AT = torch._C._get_function_stack_at


def _handle_at_api_level(public_api: Any, relevant_args: Any, *args: Any, **kwargs: Any) -> Any:
    depth = _STACK_DEPTH()
    if depth:
        mode = _STACK_AT(depth - 1)
        if type(mode) is ApiChecker:
            POP_MODE()  # as torch does: the checker's own torch calls do not come back to it
            try:
                result = mode.__torch_function__(public_api, (), args, kwargs)
            finally:
                PUSH_MODE(mode)
            if result is not NotImplemented:
                return result
    return _TORCH_HANDLER(public_api, relevant_args, *args, **kwargs)


_REAL_SET_GRAD = torch._C._set_grad_enabled
_WITHOUT_MODES = torch._C.DisableTorchFunction


def _set_grad_enabled_at_api_level(mode: bool) -> None:
    depth = _STACK_DEPTH()
    if depth:
        checker = _STACK_AT(depth - 1)
        if type(checker) is ApiChecker:
            position = checker.position
            if (checker.diverged is None and position < checker.count and checker.funcs[position] is _REAL_SET_GRAD
                    and checker.grad_modes[position] is mode):
                with _WITHOUT_MODES():  # half the cost of taking the checker off the stack and back
                    _REAL_SET_GRAD(mode)
                checker.position = position + 1
                return
            POP_MODE()
            try:
                return checker.__torch_function__(_REAL_SET_GRAD, (), (mode,), {})
            finally:
                PUSH_MODE(checker)
    return _REAL_SET_GRAD(mode)


# (namespace, name, torch's function, the shorter way) for each binding replaced during a call
_FAST_PATHS = ((torch._C.__dict__, "_set_grad_enabled", _REAL_SET_GRAD, _set_grad_enabled_at_api_level),
               *((module.__dict__, "handle_torch_function", _TORCH_HANDLER, _handle_at_api_level)
                 for module in _PYTHON_API_MODULES))


def _install_fast_paths() -> list:
    installed = []
    for path in _FAST_PATHS:
        namespace, name, torchs, shorter = path
        if namespace.get(name) is torchs:  # not if replaced by others
            namespace[name] = shorter
            installed.append(path)
    return installed


def _remove_fast_paths(installed: list) -> None:
    for namespace, name, torchs, shorter in installed:
        if namespace.get(name) is shorter:
            namespace[name] = torchs


# the Python numbers passed on to the program: numpy's float64 is a float, which torch passes on as one
_NUMBERS = (int, float, np.float64)
_AS_PASSED = {np.float64: float}


def _name(func: Any) -> str:
    return function_name(func)


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


# Fallbacks decided before the function runs: the aten level then runs it for the first time.
CONSTANT_CHANGED = "a captured constant changed"
EXTERNAL_FREED = "an object the trace uses was freed"
BEFORE_THE_FUNCTION = frozenset({CONSTANT_CHANGED, EXTERNAL_FREED})


def run_checked(program: ApiProgram, trace: Any, args: tuple, kwargs: dict, inputs: list) -> tuple[Any, str | None]:
    """Run `function` under the checker, then the host-free program. Returns (result, None), or
    (None, why) when the call must run at the aten level instead (nothing was computed)."""
    externals = program.externals()  # the call's context is the program's: it is part of the signature
    if program.constants and program.constants_changed():
        return None, CONSTANT_CHANGED
    if externals is None:
        return None, EXTERNAL_FREED
    checker = program.checker.start(inputs, externals)
    deferred = program.deferred_writes
    if deferred.pending:
        deferred.clear()
    program.checking_args, program.checking_kwargs = args, kwargs  # for host reads (_Reader), recorded or not
    generator = program.call_generator = torch.default_generator.get_state() if program.draws else None
    scaler_stages = program.scalers.save(kwargs) if program.scalers else None
    scheduler_states = program.schedulers.save() if program.schedulers else None
    stand_ins = program.stand_ins.install(checker) if program.stand_ins is not None else None
    module_stand_ins = program.module_stand_ins.install(checker) if program.module_stand_ins is not None else None
    function_stand_ins = (program.function_stand_ins.install(checker) if program.function_stand_ins is not None
                          else None)
    context = program.call_context
    if context is None or context.trace is not trace:
        context = program.call_context = CallContext(trace, checker, trace.options.capture_as_const)
    context.excluded = 0
    outer = pushed = failure = interrupted = raised = result = None
    handlers = _install_fast_paths()
    try:
        outer = enter_api_checked_call(context)
        PUSH_MODE(checker)  # what `with checker:` does, without its two Python frames each way
        pushed = checker
        result = trace._function(*args, **kwargs)
    except ApiDiverged as why:  # the checker's, or a reader's (which the checker has not noted)
        failure = checker.diverged or str(why) or "the call diverged"
    except Exception as error:  # noqa: BLE001 - the aten level reruns the call and raises it for real
        failure = f"the function raised {type(error).__name__}"
        raised = error
    except BaseException as error:  # KeyboardInterrupt, SystemExit, the user's own: as above, and it goes on
        failure = f"the function raised {type(error).__name__}"
        interrupted = raised = error
    finally:
        if pushed is not None:
            POP_MODE()
        checker.inputs = checker.externals = ()  # the call's tensors: the checker outlives the call
        _remove_fast_paths(handlers)
        leave_api_checked_call(outer)
        if stand_ins:
            program.stand_ins.remove(stand_ins)
        if module_stand_ins:
            program.module_stand_ins.remove(module_stand_ins)
        if function_stand_ins:
            program.function_stand_ins.remove(function_stand_ins)
        program.checking_args = program.checking_kwargs = None
        if program.read_slices:
            program.read_slices = {}
        if program.literals:
            program.literals.clear()
    if program.finish_error is not None:
        error, program.finish_error = program.finish_error, None
        program.finished = program.call_generator = None
        raise error
    finished = program.finished
    if finished is not None:
        program.finished = program.call_generator = None
        return _end_finished(program, trace, finished, result, failure, raised, inputs, externals), None
    if failure is not None:  # the checker is off the mode stack now: it would answer torch.equal
        _restore_generator(generator)
    elif generator is not None and _restore_generator(generator):
        failure = "the function changed the random number generator's state (torch.manual_seed, set_rng_state)"
    elif checker.diverged is not None:
        failure = checker.diverged  # the function swallowed ApiDiverged
    elif checker.position != checker.count and not all(program.read_kinds[checker.position:]):
        # (recorded host reads at the end, after the last call this one made, are passed over)
        call = program.calls[checker.position]
        failure = f"the call ended before call #{checker.position} {call.name} at {call.source}"
    elif program.check_output(result, inputs, externals, program.placeholders) is not True:
        failure = "the function returned other values than recorded"
    elif program.agreeing and _disagreeing(program.agreeing, checker.scalars):
        failure = "numbers that were equal when traced and reach one backward op differ in this call"
    if failure is not None:
        if scaler_stages:  # the aten level runs the function again, from the scalers' stages before this run
            ScalerStages.restore(scaler_stages)
        if scheduler_states:  # ...and from the schedulers' (a schedule stepped twice runs ahead for good)
            SchedulerStates.restore(scheduler_states)
        if interrupted is not None:
            raise ApiInterrupted(interrupted, failure) from None
        return None, failure
    del result
    kept = program.kept_placeholders()
    slots = program.runner.kept_slots
    if kept and kept.keys() <= slots.keys():  # kept as the traced call kept them: the program fills them
        for handle, tensor in kept.items():
            slots[handle].tensor = tensor
        try:
            output = program.runner.call(args, kwargs, checker.scalars, externals)
        finally:
            for handle in kept:
                slots[handle].tensor = None
        if output is not MISS:
            kept = {}
    else:
        output = MISS if kept else program.runner.call(args, kwargs, checker.scalars, externals)
    if kept:
        # The function kept values the traced call did not (a list it appends to on some calls;
        # the host-free program may not even compute them), or the program's guards failed after
        # the function had kept them (a rerun of the function would leave them unfilled). This
        # call runs the record op by op.
        output = run_op_by_op(program, args, kwargs, checker.scalars, kept, externals)
        if output is MISS:
            raise TraceMismatchError(
                f"{trace.__name__}() kept {', '.join(f't{h}' for h in kept)} beyond the call, which the "
                f"traced call did not, and an object the trace uses is gone: the call cannot be completed")
        deferred.apply()
        return output, None
    if output is MISS:
        return None, "a guard of the compiled program failed"
    if deferred.pending:
        deferred.apply()
    _count_stand_ins(trace.stats, checker)
    return output, None


def _count_stand_ins(stats: Any, checker: ApiChecker) -> None:
    if checker.stood_in:
        stats.optimizer_stand_ins += checker.stood_in
    if checker.stood_in_modules:
        stats.module_stand_ins += checker.stood_in_modules
        if checker.stood_in_ddp:
            stats.ddp_stand_ins += checker.stood_in_ddp
    if checker.stood_in_functions:
        stats.function_stand_ins += checker.stood_in_functions


def _end_finished(program: ApiProgram, trace: Any, finished: Finished, result: Any, failure: str | None,
                  raised: BaseException | None, inputs: list, externals: list) -> Any:
    """The end of a call whose program ran at a host read: its effects are done, so a call that
    went on otherwise than recorded raises instead of running again at the aten level."""
    checker = program.checker
    own = False  # the function's result is the call's: it went on otherwise than recorded
    try:
        if raised is not None and not isinstance(raised, ApiDiverged):
            raise raised  # the function's own exception, after the effects eager had made by then
        if failure is None:
            if checker.diverged is not None:
                failure = checker.diverged
            # Otherwise than recorded, but eagerly from the read on, on real values: the function's
            # result (the placeholders in it hold the program's values) is eager's
            own = (checker.continued
                   or checker.position != checker.count and not all(program.read_kinds[checker.position:])
                   or program.check_output(result, inputs, externals, program.placeholders) is not True
                   or checker.scalars != finished.scalars)
    finally:
        take_back(program, finished.handed)
    output = result if own else finished.output
    del result
    # what the function keeps besides the values the program left in its placeholders: gone (each
    # gets memory of its own, and the program new placeholders)
    kept = program.kept_placeholders()
    if kept and failure is None:
        failure = f"the function keeps {', '.join(f't{h}' for h in kept)} beyond the call, which the traced call did not"
    if failure is not None:
        raise TraceMismatchError(
            f"{trace.__name__}() diverged from its trace after its compiled program ran at the host read at "
            f"{finished.source}: {failure}. The program runs at a call's last host read when the torch calls "
            f"after it only compute what the call returns; they must then be the recorded ones "
            f"(docs/guide.md, 'Host reads').")
    trace.stats.early_runs += 1
    _count_stand_ins(trace.stats, checker)
    return output


def _restore_generator(state: torch.Tensor | None) -> bool:
    """Put the generator back where the call found it, for the aten-level rerun; True if the
    function had moved it (the checker answers random ops without drawing)."""
    if state is None or torch.equal(torch.default_generator.get_state(), state):
        return False
    torch.default_generator.set_state(state)
    return True


def run_op_by_op(program: ApiProgram, args: tuple, kwargs: dict, scalars: list,
                 kept: dict[int, torch.Tensor], externals: Any = ()) -> Any:
    """Run the record op by op with this call's numbers, leaving each kept value in the tensor the
    function holds; write escaped values back as the host-free program does. MISS if an object
    the trace uses is gone."""
    record = program.record
    leaves = [info.handle for info in record.tensors if info.kind is not Kind.INTERNAL]
    bound = _bind_leaves(program, args, kwargs, leaves, externals)
    if bound is None:
        return MISS
    env: list = [None] * len(record.tensors)
    for handle, tensor in bound.items():
        env[handle] = tensor
    offsets = program.scalar_offsets
    with torch.no_grad(), _disable_current_modes(), torch._C.DisableTorchFunction(), outside_autocast():
        for op in record.ops:
            values = scalars[offsets[op.index]:offsets[op.index] + len(op.scalars)]
            call_args, call_kwargs = rebuild_call(op.statics, [env[h] for h in op.inputs], values)
            _store_outputs(op, with_recorded_grad_mode(op.op, op.op, op.grad_enabled)(*call_args, **call_kwargs), env)
            for handle in op.outputs:
                if handle in kept and record.tensors[handle].producer == op.index:
                    kept[handle].copy_(env[handle])
                    env[handle] = kept[handle]
        for handle, ref in getattr(program.runner, "escaped_objects", {}).items():
            holder = ref()
            if holder is not None and holder is not env[handle]:
                holder.copy_(env[handle])
        for handle, where in getattr(program.runner, "assigned_holders", {}).items():
            where.assign(env[handle], kwargs)
    return _output_value(record.output, env)


def _output_value(spec: Any, env: list) -> Any:
    if spec.kind == "tensor":
        return env[spec.handle]
    if spec.kind == "none":
        return None
    return spec.build([_output_value(child, env) for child in spec.children])


NotReplayable = _NotReplayable

__all__ = ["ApiChecker", "ApiDiverged", "ApiInterrupted", "ApiProgram", "NotReplayable", "RecordedNode",
           "call_context_key", "run_checked"]
