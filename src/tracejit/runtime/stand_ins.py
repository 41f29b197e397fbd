"""Optimizer methods answered as a whole in checked calls at the API level.

An optimizer's `step()` and `zero_grad()` are most of the Python a training step runs besides
the model: for `Adam(fused=True)` on a small MLP about 70 us of a 95 us checked call, spent in
torch.optim's own loops, profiler ranges and tensor-attribute reads, all of which the checker
matches one by one only to learn that the optimizer did what it did last time. For torch's own
optimizers (record/optimizer_calls.py) what those methods dispatch is decided by the optimizer's
Python state alone: its param groups (parameters and settings), its per-parameter state and its
defaults. So while a checked call runs, each such optimizer gets a stand-in for `step` and
`zero_grad` as instance attributes (removed when the call ends). A stand-in called where the
record has the method's span checks that state against a snapshot taken when the span was noted
(tensors by identity, numbers by type and value) and moves the checker past the span; the
settings the host-free program binds from `param_groups` (the learning rate, betas, momentum:
runtime/optimizer_settings.py) are passed as the call's numbers, as the optimizer would have
passed them. Adam and AdamW without `fused`/`capturable` read each step count with `.item()` and
compute their step sizes in Python: their numbers are computed from the settings and the step
counts (runtime/optimizer_numbers.py), with a formula that reproduced the record's numbers bit
for bit. Anything else (another state, arguments, hooks, a profiler recording ranges, host reads
of another optimizer) runs the real method, matched call by call as before.
"""

from __future__ import annotations

import enum
import functools
import types
import weakref
from _thread import get_ident
from dataclasses import replace
from typing import Any, Callable

import numpy as np
import torch

from ..record.api import ApiCall, CallKind, RefKind, TensorRef
from ..record.ddp_calls import is_ddp
from ..record.module_calls import CLASS_METHODS, ModuleCall, ModuleState, global_hook_dicts
from ..record.optimizer_calls import STEP, OptimizerCall, OptimizerSnapshot, profiler_enabled, step_hooks
from ..record.own_hooks import any_foreign
from .api_match import FAIL, answer_expr, match_lines, source_of
from .optimizer_numbers import MODELS, READS, SETTINGS, numbers, same_numbers, step_count
from .optimizer_settings import SettingBinding, find_bindings

_MISSING = object()
_PRIMITIVES = (bool, int, float, str, type(None))
_IMMUTABLE = (np.generic, torch.dtype, torch.layout, torch.memory_format, enum.Enum,
              types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.MethodDescriptorType,
              types.WrapperDescriptorType, functools.partial)
_PLAIN = frozenset({bool, int, str, type(None)})  # compared by value; floats keep the sign of a zero


class _Region:
    """One method call of the record that a stand-in may answer."""

    __slots__ = ("arguments", "check", "end", "source")

    def __init__(self, call: OptimizerCall, check: Any, source: str):
        self.end = call.end
        self.arguments = call.arguments
        self.check = check  # (O, E, A, S) -> bool; binds this call's numbers into S when it passes
        self.source = source


class _StandIn:
    """The callable put in an optimizer's `__dict__` for one checked call."""

    __slots__ = ("_wrapped_by_lr_sched", "checker", "kind", "optimizer", "owner", "real", "regions")

    def __init__(self, kind: str, regions: dict[int, _Region], owner: weakref.ref):
        self.kind = kind
        self.regions = regions  # checker position where the method's span starts -> region
        self.owner = owner
        self.checker = self.optimizer = self.real = None
        # an LR scheduler wraps step() to note that it was called: the stand-in takes its place
        self._wrapped_by_lr_sched = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        checker, optimizer, real = self.checker, self.optimizer, self.real
        if checker is None:  # kept by the function and called after its call: the method itself
            return getattr(self.owner(), self.kind)(*args, **kwargs)
        if checker.thread != get_ident():  # another thread's call of the optimizer: not the checked one
            return real(*args, **kwargs)
        region = checker.region(self.regions)
        if (region is not None and checker.diverged is None and not checker.continued and not profiler_enabled()
                and self._takes(args, kwargs, region)):
            steps = checker.steps_answered
            answered = steps.get(id(optimizer), 0)
            if region.check(optimizer, checker.externals, checker.inputs, checker.scalars, answered):
                if self._wrapped_by_lr_sched:
                    optimizer._opt_called = True
                checker.position = region.end
                checker.stood_in += 1
                if self.kind == STEP:
                    steps[id(optimizer)] = answered + 1
                return None
        return real(*args, **kwargs)

    def _takes(self, args: tuple, kwargs: dict, region: _Region) -> bool:
        if self.kind == STEP:
            return not args and not kwargs
        if args:  # zero_grad(set_to_none): the recorded flag, positional or by name
            return len(args) == 1 and not kwargs and args[0] is region.arguments[0]
        return kwargs.keys() <= {"set_to_none"} and kwargs.get("set_to_none", True) is region.arguments[0]


class StandIns:
    """The stand-ins of one API program, per optimizer; `install` before the function runs and
    `remove` after it."""

    def __init__(self, optimizers: list[tuple[weakref.ref, _StandIn, _StandIn]]):
        self.optimizers = optimizers

    def install(self, checker: Any) -> list:
        installed = []
        for ref, step, zero_grad in self.optimizers:
            optimizer = ref()
            if optimizer is None:
                continue
            attributes = optimizer.__dict__
            for name, stand_in, real in (("step", step, type(optimizer).step), ("zero_grad", zero_grad, type(optimizer).zero_grad)):
                if not stand_in.regions:
                    continue
                previous = attributes.get(name, _MISSING)
                scheduled = getattr(previous, "_wrapped_by_lr_sched", False) is True
                if previous is not _MISSING and not scheduled:
                    continue  # the user's own replacement: it runs, checked call by call
                stand_in.checker, stand_in.optimizer = checker, optimizer
                stand_in.real = previous if scheduled else real.__get__(optimizer)
                stand_in._wrapped_by_lr_sched = scheduled
                attributes[name] = stand_in
                installed.append((attributes, name, previous, stand_in))
        return installed

    @staticmethod
    def remove(installed: list) -> None:
        for attributes, name, previous, stand_in in installed:
            # out of reach first: a stand-in without its call finds the method in the attributes
            if attributes.get(name) is stand_in:  # the function may have replaced it meanwhile
                if previous is _MISSING:
                    del attributes[name]
                else:
                    attributes[name] = previous
            stand_in.checker = stand_in.optimizer = stand_in.real = None


def build_stand_ins(program: Any, calls: list[ApiCall], optimizer_calls: list[OptimizerCall],
                    objects: dict[int, torch.Tensor]) -> tuple[StandIns | None, dict[str, str]]:
    """The stand-ins of the optimizer calls the record allows, and why the others run for real."""
    refused: dict[str, str] = {}
    external_slots = {id(ref()): slot for slot, ref in enumerate(program.external_refs) if ref() is not None}
    located_at = {index: slot for slot, index in program.located.items()}
    by_optimizer: dict[int, tuple[weakref.ref, dict, dict]] = {}
    steps_of: dict[int, list[OptimizerCall]] = {}
    for call in optimizer_calls:
        if call.kind == STEP:
            steps_of.setdefault(id(call.optimizer()), []).append(call)
    for call in optimizer_calls:
        where = f"{call.kind}() at {calls[call.start].source}"
        optimizer = call.optimizer()
        # a step() that reads its step counts on the host may still be answered: see _host_read_numbers
        reason = call.refused or _span_refusal(calls, call, host_reads=call.kind == STEP,
                                               unflagging=call.kind != STEP)
        if optimizer is None or call.snapshot is None:
            reason = reason or "the optimizer is gone"
        if reason is not None:
            refused[where] = reason
            continue
        generator = _CheckSource(program, external_slots)
        try:
            spans = steps_of.get(id(optimizer), [call])
            order = (spans.index(call), len(spans)) if call.kind == STEP else (0, 1)
            check, source = generator.build(call, calls, located_at, objects, order)
        except _Unsupported as why:
            refused[where] = str(why)
            continue
        _, steps, zero_grads = by_optimizer.setdefault(id(optimizer), (call.optimizer, {}, {}))
        (steps if call.kind == STEP else zero_grads)[call.start] = _Region(call, check, source)
    for call in optimizer_calls:
        call.snapshot = None  # it holds the optimizer's tensors strongly
    optimizers = [(ref, _StandIn("step", steps, ref), _StandIn("zero_grad", zero_grads, ref))
                  for ref, steps, zero_grads in by_optimizer.values()]
    return (StandIns(optimizers) if optimizers else None), refused


def _span_refusal(calls: list[ApiCall], call: Any, host_reads: bool = False, unflagging: bool = False) -> str | None:
    """Why a call's span cannot be answered whole. `unflagging` (zero_grad): its
    `grad.requires_grad_(False)` on gradients that do not require grad (`set_to_none=False`) is
    a no-op the stand-in checks stays one (_CheckSource.build)."""
    if call.end <= call.start:
        return "its span did not close"
    for inner in calls[call.start:call.end]:
        if inner.kind is CallKind.HOST_READ and not host_reads:
            return f"it reads a tensor on the host ({inner.name} at {inner.source})"
        if inner.requires_grad is not None and not (unflagging and inner.requires_grad is False
                                                     and inner.name.endswith("requires_grad_")):
            return f"it calls {inner.name}"
    return None


def _gradients_requiring_grad(params: list) -> bool:
    """Whether a parameter's `.grad` requires grad (read past the checker: not a call of the function)."""
    with torch._C.DisableTorchFunction():
        return any(p.grad is not None and p.grad.requires_grad for p in params)


class _Unsupported(Exception):
    pass


_EXACT_COUNTS = 2.0**24  # float32 step counts stop counting past this


def _host_values(optimizer: Any, kind: type, with_grad: list[list[bool]], groups: list[dict],
                 increment: float) -> list[list]:
    """Per param group, what step() reads on the host of each parameter with a gradient (its step
    count, plus `increment` for the step about to happen, as `step_t.item()` after `step_t += 1`;
    and what READS names for optimizers of `kind`)."""
    read = READS.get(kind, step_count)
    values = []
    with torch._C.DisableTorchFunction():  # not a call of the traced function
        for group, flags in zip(groups, with_grad, strict=True):
            found = []
            for param, flag in zip(group["params"], flags, strict=True):
                if flag:
                    value = read(optimizer.state[param], group, increment)
                    if (value[0] if type(value) is tuple else value) >= _EXACT_COUNTS:
                        raise ValueError("step count beyond exact float32 counting")
                    found.append(value)
            values.append(found)
    return values


class _CheckSource:
    """Generates `check(O, E, A, S)` for one method call: the optimizer's state is the snapshot's."""

    def __init__(self, program: Any, external_slots: dict[int, int]):
        self.program = program
        self.external_slots = external_slots
        self.namespace: dict[str, Any] = {"HOOKS": step_hooks, "TENSOR": torch.Tensor,
                                          "NO_TORCH_FUNCTION": torch._C.DisableTorchFunction}
        self.lines: list[str] = []

    def constant(self, value: Any, prefix: str) -> str:
        name = f"{prefix}{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def fail_if(self, condition: str) -> None:
        self.lines.append(f"if {condition}: return False")

    def tensor(self, tensor: torch.Tensor) -> str:
        """An expression for the recorded object: its external slot, else a weak reference."""
        slot = self.external_slots.get(id(tensor))
        return f"E[{slot}]" if slot is not None else f"{self.constant(weakref.ref(tensor), 'w')}()"

    def same(self, expr: str, value: Any, what: str) -> None:
        if isinstance(value, torch.Tensor):
            self.fail_if(f"{expr} is not {self.tensor(value)}")
        elif value is None or type(value) is bool:
            self.fail_if(f"{expr} is not {value}")
        elif type(value) in (int, float, str):
            if type(value) is float and value != value:
                raise _Unsupported(f"{what} is NaN")
            self.fail_if(f"type({expr}) is not {type(value).__name__} or {expr} != {source_of(value, self.constant)}")
        elif type(value) is tuple and all(type(v) in _PRIMITIVES for v in value):
            local = f"t{len(self.lines)}"
            self.lines.append(f"{local} = {expr}")
            self.fail_if(f"type({local}) is not tuple or {local} != {self.constant(value, 'c')} or "
                         f"tuple(map(type, {local})) != {self.constant(tuple(map(type, value)), 'c')}")
        else:
            raise _Unsupported(f"{what} is a {type(value).__name__}")

    def plain(self, mapping: str, values: dict) -> dict:
        """Check the entries of `values` that are not floats or tensors (flags, ints, None, tuples
        of those) with one comparison of their values and one of their types; return the rest."""
        plain = {k: v for k, v in values.items() if type(v) in _PLAIN
                 or type(v) is tuple and all(type(item) in _PLAIN for item in v)}
        if plain:
            local = f"p{len(self.lines)}"
            self.lines.append(f"{local} = tuple(map({mapping}.get, {self.constant(tuple(plain), 'k')}))")
            self.fail_if(f"{local} != {self.constant(tuple(plain.values()), 'c')} or "
                         f"tuple(map(type, {local})) != {self.constant(tuple(map(type, plain.values())), 'c')}")
        return {k: v for k, v in values.items() if k not in plain}

    def _defaults(self, defaults: dict) -> None:
        """The defaults hold the recorded objects (all immutable: one C-level pass), or else the
        recorded values: the types and values are compared only when the objects differ."""
        start = len(self.lines)
        self.fail_if(f"D.keys() != {self.constant(set(defaults), 'k')}")
        for key, value in sorted(self.plain("D", defaults).items()):
            self.same(f"D.get({key!r})", value, f"defaults[{key!r}]")
        if not all(map(immutable, defaults.values())):
            return
        by_value = self.lines[start:]
        self.lines[start:] = [f"if len(D) != {len(defaults)} or {identity_checks('D', defaults, self.constant)}:",
                              *(f"    {line}" for line in by_value)]

    def build(self, call: OptimizerCall, calls: list[ApiCall], located_at: dict[int, int],
              objects: dict[int, torch.Tensor], order: tuple[int, int] = (0, 1)) -> tuple[Any, str]:
        """`order`: (which, of how many) step() spans of this optimizer the trace has."""
        snapshot: OptimizerSnapshot = call.snapshot
        computed = None  # the settings its numbers are computed from, when it reads step counts
        if call.kind == STEP:
            self.fail_if("HOOKS(O)")
            if any(inner.kind is CallKind.HOST_READ for inner in calls[call.start:call.end]):
                fill = self._host_read_numbers(call, calls, snapshot, order)
                self.namespace["FILL"] = fill
                computed, bindings = SETTINGS[snapshot.optimizer_class], {}
            else:
                bindings = self._bindings(call, calls, snapshot, objects)
        else:
            bindings = {}
        self.lines.append("D = O.defaults")
        self._defaults(snapshot.defaults)
        self.lines.append("G = O.param_groups")
        self.fail_if(f"len(G) != {len(snapshot.param_groups)}")
        written = []
        read = _read_keys(snapshot)
        for index, recorded in enumerate(snapshot.param_groups):
            group = {k: v for k, v in recorded.items() if k in read}
            self.lines.append(f"g = G[{index}]")
            self._group_keys(recorded, read)
            params = group["params"]
            self.lines.append("ps = g['params']")
            self.fail_if(f"len(ps) != {len(params)}")
            self.fail_if(" or ".join(f"ps[{i}] is not {self.tensor(p)}" for i, p in enumerate(params)) or "False")
            if call.kind != STEP:
                # zero_grad() reads nothing else of a group; with set_to_none=False it turns
                # requires_grad off on gradients that have it (or detaches them): not a no-op then
                self.namespace["FLAGGED"] = _gradients_requiring_grad
                self.fail_if("FLAGGED(ps)")
                continue
            on_device = group.get("fused") or group.get("capturable")
            tensor_setting = next((k for k, v in group.items() if k != "params" and isinstance(v, torch.Tensor)), None)
            if tensor_setting is not None and not on_device:
                # read with .item() or through tensor ops into Python numbers, by step(): a stand-in
                # would pass the recorded numbers while a scheduler fills the tensor in place
                raise _Unsupported(f"its {tensor_setting} is a tensor, which step() reads on the host")
            unbound = {k: v for k, v in group.items() if k != "params" and (index, k) not in bindings
                       and not (computed is not None and k in computed)}
            rest = {**self.plain("g", unbound), **{k: v for k, v in group.items() if k not in unbound}}
            for key, value in sorted(rest.items()):
                if key == "params":
                    continue
                bound = bindings.get((index, key))
                if computed is not None and key in computed:
                    self._computed_from(f"g[{key!r}]", value, key)
                elif bound is None:
                    self.same(f"g[{key!r}]", value, f"{key} of param group {index}")
                else:
                    written += self._bound(f"g[{key!r}]", value, bound, key)
        if call.kind == STEP:
            self._state(snapshot)
        located = [(slot, calls[position].args[0]) for position in range(call.start, call.end)
                   if (slot := located_at.get(position)) is not None]
        if located:  # gradients read where they are (api_replay._located_externals), not through the checker
            self.lines.append("with NO_TORCH_FUNCTION():")
            for slot, template in located:
                self.lines += [f"    v = {self._template_expr(template)}.grad",
                               "    if not isinstance(v, TENSOR): return False", f"    E[{slot}] = v"]
        if computed is not None:
            written.append("if not FILL(O, S, K): return False")
        # settings and state are read by subscript: a key missing since is a KeyError, a False
        body = ["try:", *(f"    {line}" for line in self.lines + written + ["return True"]),
                "except KeyError:", "    return False"]
        source = "def check(O, E, A, S, K):\n" + "".join(f"    {line}\n" for line in body)
        exec(compile(source, f"<tracejit stand-in {call.kind}>", "exec"), self.namespace)
        return self.namespace["check"], source

    def _group_keys(self, recorded: dict, read: frozenset) -> None:
        """The group has the keys step() and zero_grad() read that the recorded one had. Others
        are scheduler bookkeeping (`initial_lr`, which every LRScheduler adds when created, SWALR's
        `swa_lr`, OneCycleLR's `max_lr`) or the user's own (`name`): no optimizer reads them, and a
        scheduler created after the trace was noted must not turn the stand-in off for good."""
        keys = self.constant(set(recorded), "k")
        self.fail_if(f"g.keys() != {keys} and {self.constant(read, 'k')}.intersection(g) != "
                     f"{self.constant(read.intersection(recorded), 'k')}")

    def _computed_from(self, expr: str, value: Any, key: str) -> None:
        """A setting the numbers are computed from: any value of the recorded kind (weight decay:
        also its zeroness, at 0 the op that applies it is not there)."""
        if isinstance(value, tuple) and len(value) == 2 and all(type(v) is float for v in value):
            local = f"b{len(self.lines)}"
            self.lines.append(f"{local} = {expr}")
            self.fail_if(f"type({local}) is not tuple or len({local}) != 2 or type({local}[0]) is not float or "
                         f"type({local}[1]) is not float")
        elif type(value) in (float, int):
            zeroness = f" or {'' if value else 'not '}{expr} == 0" if key == "weight_decay" else ""
            self.fail_if(f"type({expr}) is not {type(value).__name__}{zeroness}")
        else:
            raise _Unsupported(f"{key} is a {type(value).__name__}")

    def _host_read_numbers(self, call: OptimizerCall, calls: list[ApiCall], snapshot: OptimizerSnapshot,
                           order: tuple[int, int]) -> Any:
        """`fill(O, S, K)` for a step() that reads its step counts on the host (Adam without fused or
        capturable): the numbers of its ops computed from the settings and the step counts
        (runtime/optimizer_numbers.py) with the model that reproduces, bit for bit, every number
        this span passed when the trace was noted. With several steps of the optimizer in one
        call (`order`: the k-th of n), the span's counts are those after k + 1 increments from
        the counts the call found: the state tensors hold those while the call runs (the program
        computes after it), so the stand-in answers the k-th span only when the call's stand-ins
        answered the k before it (K)."""
        which, spans = order
        record, program = self.program.record, self.program
        start, end = calls[call.start].span[0], calls[call.end - 1].span[1]
        slots = [program.scalar_offsets[op.index] + k for op in record.ops[start:end] for k in range(len(op.scalars))]
        recorded = [program.scalars[slot] for slot in slots]
        optimizer = call.optimizer()
        models = MODELS.get(snapshot.optimizer_class, [])
        if not models or optimizer is None:
            raise _Unsupported(f"it reads a tensor on the host, and tracejit does not compute "
                               f"{snapshot.optimizer_class.__qualname__}'s numbers")
        if spans > 1 and snapshot.optimizer_class in READS:
            raise _Unsupported(f"it is one of {spans} step() calls of a {snapshot.optimizer_class.__qualname__} in the "
                               f"call, whose state read on the host changes from one to the next")
        try:  # the counts after the noted call's increments, less the later spans': the ones its numbers came from
            counts = _host_values(optimizer, snapshot.optimizer_class, snapshot.with_grad, snapshot.param_groups,
                                  float(which + 1 - spans))
        except (KeyError, TypeError) as error:
            raise _Unsupported(f"its step counts cannot be read ({error})") from None
        model = next((m for m in models if same_numbers(
            numbers(m, snapshot.param_groups, counts, snapshot.optimizer_class), recorded)), None)
        if model is None:
            raise _Unsupported("it reads a tensor on the host, and no formula of runtime/optimizer_numbers.py "
                               "gives the numbers it passed")
        with_grad, kind = snapshot.with_grad, snapshot.optimizer_class

        def fill(optimizer: Any, scalars: list, answered: int) -> bool:
            if answered != which:  # an earlier step() ran for real: its increments are not counted here
                return False
            try:
                counts = _host_values(optimizer, kind, with_grad, optimizer.param_groups, float(which + 1))
            except (KeyError, TypeError, ValueError):
                return False
            values = numbers(model, optimizer.param_groups, counts, kind)
            if len(values) != len(slots):
                return False
            for slot, value in zip(slots, values):
                scalars[slot] = value
            return True

        return fill

    def _bindings(self, call: OptimizerCall, calls: list[ApiCall], snapshot: OptimizerSnapshot,
                  objects: dict[int, torch.Tensor]) -> dict[tuple[int, str], list[SettingBinding]]:
        """The settings whose values reach the program as numbers (runtime/optimizer_settings.py),
        among the aten ops of the method's span."""
        span = (calls[call.start].span[0], calls[call.end - 1].span[1])
        found: dict[tuple[int, str], list[SettingBinding]] = {}
        for binding in find_bindings(self.program.record, objects, [("O", snapshot)], self.program.scalars, span):
            found.setdefault((binding.group, binding.key), []).append(binding)
        return found

    def _bound(self, expr: str, value: Any, bindings: list[SettingBinding], key: str) -> list[str]:
        """Check a bound setting keeps its kind (a float, and for all but the learning rate the same
        zeroness: SGD skips its momentum ops at 0) and write it where the program reads it."""
        elements = {b.index for b in bindings}
        if isinstance(value, tuple):
            if elements != set(range(len(value))) or not all(isinstance(v, float) for v in value):
                self.same(expr, value, key)
                return []
            local = f"b{len(self.lines)}"
            self.lines.append(f"{local} = {expr}")
            self.fail_if(f"type({local}) is not tuple or len({local}) != {len(value)}")
            checks = [f"type({local}[{i}]) is not float or {'' if v else 'not '}{local}[{i}] == 0" for i, v in enumerate(value)]
            self.fail_if(" or ".join(checks))
            return [f"S[{b.slot}] = {'-' if b.sign < 0 else ''}{local}[{b.index}]" for b in bindings]
        if elements != {None} or not isinstance(value, float):
            self.same(expr, value, key)
            return []
        local = f"b{len(self.lines)}"
        self.lines.append(f"{local} = {expr}")
        zeroness = "" if key == "lr" else f" or {'' if value else 'not '}{local} == 0"
        self.fail_if(f"type({local}) is not float{zeroness}")
        return [f"S[{b.slot}] = {'-' if b.sign < 0 else ''}{local}" for b in bindings]

    def _state(self, snapshot: OptimizerSnapshot) -> None:
        """Each parameter's state holds the recorded tensors and numbers (fused Adam's `step` is a
        tensor the program increments; a lazily created state would mean other ops)."""
        self.lines.append("st = O.state")
        for index, group in enumerate(snapshot.param_groups):
            for i, param in enumerate(group["params"]):
                state = snapshot.state.get(param)
                self.lines.append(f"s = st.get({self.tensor(param)})")  # the parameter checked above
                if not state:
                    self.fail_if("s")
                    continue
                # as many entries as recorded, each the recorded one (a missing key: KeyError, False)
                self.fail_if(f"s is None or len(s) != {len(state)}")
                for key, value in sorted(state.items()):
                    self.same(f"s[{key!r}]", value, f"state {key!r}")

    def _template_expr(self, template: Any) -> str:
        if isinstance(template, TensorRef) and template.kind in (RefKind.EXTERNAL, RefKind.INPUT):
            return ("E" if template.kind == RefKind.EXTERNAL else "A") + f"[{template.key}]"
        raise _Unsupported("it reads the gradient of a tensor the trace computes")


def _read_keys(snapshot: OptimizerSnapshot) -> frozenset:
    """The param-group keys torch's optimizers read: their defaults, which add_param_group gives
    every group, and the parameters (torch/optim: no step() reads a key outside its defaults)."""
    return frozenset(snapshot.defaults) | {"params"}


class _ForwardStandIn:
    """The callable put in a torch.nn module's `__dict__` as `forward` for one checked call."""

    __slots__ = ("checker", "module", "owner", "real", "regions")

    def __init__(self, regions: dict[int, tuple[Any, int]], owner: weakref.ref):
        self.regions = regions  # checker position where the module's span starts -> (answer, end)
        self.owner = owner
        self.checker = self.module = self.real = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        checker = self.checker
        if checker is None:  # kept by the function and called after its call: the forward itself
            return self.owner().forward(*args, **kwargs)
        if checker.thread != get_ident():  # another thread's call of the module: not the checked one
            module = self.owner()
            return type(module).forward(module, *args, **kwargs)
        result = self.answer(checker, args, kwargs)
        return self.real(*args, **kwargs) if result is FAIL else result

    def answer(self, checker: Any, args: tuple, kwargs: dict) -> Any:
        """The recorded result, the checker moved past the module's span; FAIL where the record has
        no span of this module here or its state differs."""
        region = checker.region(self.regions)
        if region is None or checker.diverged is not None or checker.continued or profiler_enabled():
            return FAIL
        same_objects, same_values, end = region
        module, inputs, externals, placeholders = self.module, checker.inputs, checker.externals, checker.placeholders
        result = same_objects(module, args, kwargs, inputs, externals, placeholders)
        if result is FAIL:  # an attribute set again, to an equal value or not
            result = same_values(module, args, kwargs, inputs, externals, placeholders)
        if result is not FAIL:
            checker.position = end
            checker.stood_in_modules += 1
        return result


class ModuleStandIns:
    """The forward stand-ins of one API program, per module; `install` before the function runs
    and `remove` after it."""

    def __init__(self, modules: list[tuple[weakref.ref, _ForwardStandIn]]):
        self.modules = modules

    def install(self, checker: Any) -> list:
        installed = []
        for ref, stand_in in self.modules:
            module = ref()
            if module is None or "forward" in module.__dict__:
                continue
            stand_in.checker, stand_in.module = checker, module
            stand_in.real = type(module).forward.__get__(module)
            module.__dict__["forward"] = stand_in
            installed.append((module.__dict__, stand_in))
        return installed

    @staticmethod
    def remove(installed: list) -> None:
        for attributes, stand_in in installed:
            if attributes.get("forward") is stand_in:  # out of reach first, as StandIns.remove
                del attributes["forward"]
            stand_in.checker = stand_in.module = stand_in.real = None


def build_module_stand_ins(program: Any, calls: list[ApiCall], module_calls: list[ModuleCall]
                           ) -> tuple[ModuleStandIns | None, dict[str, str]]:
    """The forward stand-ins of the module calls the record allows, and why the others run."""
    from .ddp_stand_in import DdpForwardSource, DdpForwardStandIn  # they build on this module's classes

    _torch_names.clear()  # where torch's functions are now (one patched since the last program)
    refused: dict[str, str] = {}
    external_slots = {id(ref()): slot for slot, ref in enumerate(program.external_refs) if ref() is not None}
    by_module: dict[int, tuple[weakref.ref, dict]] = {}
    for call in module_calls:
        module = call.module()
        where = f"{type(module).__qualname__ if module is not None else 'module'} at {calls[call.start].source}" \
            if call.start < len(calls) else "a module call"
        reason = call.refused or (_span_refusal(calls, call) if call.end > call.start else "it makes no torch call")
        if module is None:
            reason = reason or "the module is gone"
        if reason is None:
            source = DdpForwardSource if call.ddp is not None else _ForwardSource
            try:
                same_values = source(program, external_slots).build(call, len(by_module))
                same_objects = source(program, external_slots, by_identity=True).build(call, len(by_module))
            except _Unsupported as why:
                reason = str(why)
        if reason is not None:
            refused[where] = call.refused = reason  # a DDP call's refusal keeps the trace at the aten level
            continue
        _, regions = by_module.setdefault(id(module), (call.module, {}))
        regions[call.start] = (same_objects, same_values, call.end)
    for call in module_calls:
        call.snapshot = []  # it holds the modules' tensors strongly
    modules = [(ref, (DdpForwardStandIn if is_ddp(ref()) else _ForwardStandIn)(regions, ref))
               for ref, regions in by_module.values()]
    return (ModuleStandIns(modules) if modules else None), refused


class _ForwardSource:
    """Generates `answer(M, args, kwargs, A, E, P)`: FAIL unless the arguments are the recorded
    ones and every module of the subtree has the recorded state; else the recorded result.

    Two checks are generated per module call. `by_identity` compares the modules' settings
    (immutable numbers, strings, tuples) with the recorded objects by identity, one `is` each: the
    usual case, where nothing was assigned since. The other compares them by
    type and value; it runs when the first fails, so setting an attribute to an equal value again
    costs speed, not the answer."""

    def __init__(self, program: Any, external_slots: dict[int, int], by_identity: bool = False):
        self.program = program
        self.external_slots = external_slots
        self.by_identity = by_identity
        self.lines: list[str] = []
        self.locals = 0

    def tensor(self, tensor: torch.Tensor) -> str:
        slot = self.external_slots.get(id(tensor))
        return f"E[{slot}]" if slot is not None else f"{self.program.constant(weakref.ref(tensor), 'w')}()"

    def fail_if(self, condition: str) -> None:
        self.lines.append(f"if {condition}: return FAIL")

    def same(self, expr: str, value: Any, what: str) -> None:
        if isinstance(value, torch.Tensor):
            self.fail_if(f"{expr} is not {self.tensor(value)}")
        elif value is None or type(value) is bool:
            self.fail_if(f"{expr} is not {value}")
        elif type(value) in (int, float, str) and value == value:
            self.fail_if(f"type({expr}) is not {type(value).__name__} or {expr} != {source_of(value, self.program.constant)}")
        elif type(value) in (tuple, list) and all(type(v) in (int, float, str, bool, type(None)) for v in value):
            constant = self.program.constant(value, "c")
            types = self.program.constant(tuple(map(type, value)), "c")
            self.fail_if(f"type({expr}) is not {type(value).__name__} or {expr} != {constant} or "
                         f"tuple(map(type, {expr})) != {types}")
        elif isinstance(value, _IMMUTABLE) and not isinstance(value, np.generic):
            # a function kept as a setting (TransformerEncoderLayer.activation): the same one
            self.fail_if(f"{expr} is not {self.program.constant(value, 'fn')}")
        else:
            raise _Unsupported(f"{what} is a {type(value).__name__}")

    def build(self, call: ModuleCall, number: int) -> Any:
        namespace = self.program.namespace
        if "GLOBAL_HOOKS" not in namespace:  # torch.nn's global hook dicts, which it only ever mutates
            namespace["GLOBAL_HOOKS"] = global_hook_dicts()
        namespace.setdefault("ANY_FOREIGN", any_foreign)  # hooks of the user's, not tracejit's own
        self.fail_if("any(GLOBAL_HOOKS) and ANY_FOREIGN(GLOBAL_HOOKS)")
        self.inner_checks(call)
        self.fail_if(f"len(args) != {len(call.args)} or kwargs.keys() != {self.program.constant(set(call.kwargs), 'k')}")
        for i, template in enumerate(call.args):
            self.lines += match_lines(f"args[{i}]", template, self.program)
        for key, template in call.kwargs.items():
            self.lines += match_lines(f"kwargs[{key!r}]", template, self.program)
        states = {id(state.module()): state for state in call.snapshot}
        self._module("M", call.snapshot[0], states, top=True)
        return self._function(f"forward{number}_{call.start}", answer_expr(call.result, self.program))

    def inner_checks(self, call: ModuleCall) -> None:
        self.lines += span_checks(self.program, self.program.calls[call.start:call.end])

    def _function(self, name: str, answer: str) -> Any:
        """The generated check, returning `answer` when it passes. The check by identity reads the
        settings by subscript: one deleted since is a KeyError, a FAIL there (the check by value,
        which runs next, decides)."""
        body = [*self.lines, f"return {answer}"]
        if self.by_identity:
            body = ["try:", *(f"    {line}" for line in body), "except KeyError:", "    return FAIL"]
            name += "_same_objects"
        return self.program._function(name, "M, args, kwargs, A, E, P", body)

    def _module(self, expr: str, state: ModuleState, states: dict, top: bool = False) -> None:
        self.locals += 1
        d = f"d{self.locals}"
        self.lines.append(f"{d} = {expr}.__dict__")
        hooks = " or ".join(f"{d}[{name!r}]" for name in _MODULE_HOOKS)
        replaced = "" if top else f" or 'forward' in {d}"
        cls = type(state.module())
        # an attribute set since may shadow a method the forward calls (`conv._conv_forward = ...`);
        # `forward` is the stand-in itself (or, below the top, a replaced forward: failed above).
        # Looked at only when the dict grew: a tag (`torch.compile` sets `_is_torch_compile`) is not one
        self.program.namespace.setdefault("SHADOWS", _shadows)
        keys = self.program.constant(state.keys, "ks")
        self.fail_if(f"type({expr}) is not {self.program.constant(cls, 'C')} or {hooks}{replaced} "
                     f"or len({d}) - ('forward' in {d}) != {len(state.keys)} and SHADOWS({d}, {keys}, type({expr}))")
        methods = CLASS_METHODS.get(cls)
        if methods:  # torch's own methods still (not patched on the class since the call was noted)
            owner = self.program.constant(cls, "cl")
            self.fail_if(" or ".join(f"{owner}.{name} is not {self.program.constant(function, 'fm')}"
                                     for name, function in methods.items()))
        if self.by_identity:
            self._same_objects(d, state)
        else:
            self._same_values(d, state)
        for kind, named in (("_parameters", state.parameters), ("_buffers", state.buffers)):
            if not named:
                self.fail_if(f"{d}[{kind!r}]")
                continue
            local = f"{kind[1]}{self.locals}"
            self.lines.append(f"{local} = {d}[{kind!r}]")
            self.fail_if(f"len({local}) != {len(named)}")
            for name, tensor in named.items():
                self.same(f"{local}[{name!r}]", tensor, f"{kind[1:-1]} {name}")
        if not state.children:
            self.fail_if(f"{d}['_modules']")
            return
        # a Sequential runs its children in this order
        self.fail_if(f"tuple({d}['_modules']) != {tuple(state.children)!r}")
        for name, ref in state.children.items():
            child = ref()
            if child is None or id(child) not in states:
                raise _Unsupported("a submodule is gone")
            local = f"m{self.locals}_{len(self.lines)}"
            self.lines.append(f"{local} = {d}['_modules'][{name!r}]")
            self.fail_if(f"{local} is not {self.program.constant(ref, 'w')}()")
            self._module(local, states[id(child)], states)

    def _same_objects(self, d: str, state: ModuleState) -> None:
        """The settings are the recorded objects (immutable ones: see immutable)."""
        values = {}
        for key, value in state.attributes.items():
            if not immutable(value):
                raise _Unsupported(f"{type(state.module()).__qualname__}.{key} is a {type(value).__name__}")
            values[key] = value
        if values:
            self.fail_if(identity_checks(d, values, self.program.constant))

    def _same_values(self, d: str, state: ModuleState) -> None:
        # its settings (in_features, eps, p, inplace, padding...): values and their types at once
        plain = {k: v for k, v in state.attributes.items() if type(v) in _PLAIN or type(v) is tuple and all(
            type(item) in _PLAIN for item in v)}
        if plain:
            keys = self.program.constant(tuple(plain), "k")
            self.lines.append(f"v = tuple(map({d}.get, {keys}))")
            self.fail_if(f"v != {self.program.constant(tuple(plain.values()), 'c')} or "
                         f"tuple(map(type, v)) != {self.program.constant(tuple(map(type, plain.values())), 'c')}")
        for key, value in sorted(state.attributes.items()):
            if key not in plain:
                self.same(f"{d}.get({key!r})", value, f"{type(state.module()).__qualname__}.{key}")


def span_checks(program: Any, inner: list[ApiCall], strict: bool = False) -> list[str]:
    """Lines that FAIL a span of calls answered whole where its calls would dispatch otherwise: under
    another autocast state, default dtype or set of attention kernels (the function may switch
    them, unseen by the checker), or with one of the torch functions or Tensor methods they called
    rebound since (`F.gelu = mine`, `torch.Tensor.to = mine`). `strict`: a call of a function torch
    does not hold under its name now (wrapped before the trace was noted, so the wrapper's Python
    ran in the span) raises ValueError, the span is not answered whole."""
    if not inner:
        return []
    attention = next((c for c in inner if c.attention is not None), None)
    lines = [program.autocast_check(inner[0].autocast),
             *program.context_checks(replace(inner[0], attention=attention and attention.attention))]
    bound, operators = [], False
    for call in {id(c.func): c for c in inner if type(c.func) is not _DESCRIPTOR_METHOD}.values():
        places = torch_names(call.func)
        bound += [f"{program.constant(names, 'ns')}.get({name!r}) is not {program.constant(call.func, 'fn')}"
                  for names, name in places]
        method = tensor_method(call.func)
        if method is not None:
            program.namespace.setdefault("TENSOR_CLASS", torch.Tensor)
            bound.append(f"TENSOR_CLASS.{method} is not {program.constant(call.func, 'fn')}")
            operators = True
        elif strict and not places and call.kind in (CallKind.COMPUTE, CallKind.VIRTUAL):
            raise ValueError(f"it calls {call.name}, which torch does not hold under that name now")
    if operators:
        # `a + b` reaches the checker as Tensor.add, `k / t` as Tensor.__rdiv__: the operator's own
        # binding on torch.Tensor (`torch.Tensor.__add__ = mine`) is what Python calls
        if strict and _FOREIGN_OPERATORS:
            raise ValueError(f"torch.Tensor.{_FOREIGN_OPERATORS[0]} is not torch's")
        program.namespace.setdefault("TENSOR_DICT_GET", vars(torch.Tensor).get)
        program.namespace.setdefault("OPERATOR_NAMES", _OPERATOR_NAMES)
        program.namespace.setdefault("OPERATORS", _OPERATORS)
        bound.append("tuple(map(TENSOR_DICT_GET, OPERATOR_NAMES)) != OPERATORS")
    if bound:
        lines.append(f"if {' or '.join(bound)}: return FAIL")
    return lines


_OPERATOR_NAMES = tuple(f"__{name}__" for stem in (
    "add", "sub", "mul", "truediv", "div", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift")
    for name in (stem, f"r{stem}", f"i{stem}")) + tuple(f"__{name}__" for name in (
        "neg", "pos", "abs", "invert", "lt", "le", "gt", "ge", "eq", "ne", "getitem", "setitem"))
_OPERATORS = tuple(map(vars(torch.Tensor).get, _OPERATOR_NAMES))  # as torch defines them (None: TensorBase's)
_FOREIGN_OPERATORS = [name for name, op in zip(_OPERATOR_NAMES, _OPERATORS, strict=True)
                      if op is not None and getattr(op, "__objclass__", None) is not torch._C.TensorBase
                      and not (getattr(op, "__module__", None) or "").startswith("torch")]


_DESCRIPTOR_METHOD = type(torch.Tensor.grad.__get__)  # `p.grad` reaches the checker as the property's __get__


def tensor_method(function: Any) -> str | None:
    """The name under which torch.Tensor holds `function` now, if it is one of its methods."""
    name = getattr(function, "__name__", None)
    if isinstance(name, str) and name.isidentifier() and getattr(torch.Tensor, name, None) is function:
        return name
    return None


def identity_checks(mapping: str, values: dict, constant: Callable[[Any, str], str]) -> str:
    """A condition true unless `mapping` holds exactly these objects under these keys (a key
    missing raises KeyError: the caller's). One `is` per key, inline: a fifth of the time of one
    C-level pass over a tuple (which builds two map objects) for the handful of settings a module
    or optimizer has."""
    return " or ".join(f"{mapping}[{key!r}] is not {value if value is None or type(value) is bool else constant(value, 'c')}"
                       for key, value in values.items())


def _shadows(attributes: dict, recorded: frozenset, cls: type) -> bool:
    """Whether an attribute set on the instance since it was recorded hides one of its class."""
    return any(key not in recorded and key != "forward" and hasattr(cls, key) for key in attributes)


_TORCH_NAMESPACES = (torch.nn.functional, torch, torch.linalg)
_torch_names: dict[int, list[tuple[dict, str]]] = {}


def torch_names(function: Any) -> list[tuple[dict, str]]:
    """Where torch.nn.functional, torch and torch.linalg hold `function` now, as (namespace dict, name)."""
    if not _torch_names:
        for namespace in _TORCH_NAMESPACES:
            for name, value in vars(namespace).items():
                if callable(value) and not isinstance(value, type):
                    _torch_names.setdefault(id(value), []).append((vars(namespace), name))
    # an id may have been reused since the map was made: only places holding this very object
    return [(names, name) for names, name in _torch_names.get(id(function), ()) if names.get(name) is function]


def immutable(value: Any) -> bool:
    """Numbers (numpy's scalars too), strings, None, dtypes, layouts, enum members (one object
    each) and tuples of them, and functions (an activation held as `self.act = torch.tanh`, a
    method, a `functools.partial`): the same object is the same value and type, and the same
    function computes the same. (A device, a `torch.Size`, a range is made anew by code that
    sets it to an equal value: module_guards compares such plain values by value.)"""
    if type(value) is tuple:
        return all(map(immutable, value))
    return type(value) in _PRIMITIVES or isinstance(value, _IMMUTABLE)


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
