"""DistributedDataParallel's forward answered as a whole in checked calls at the API level.

At the API level `loss.backward()` is answered without autograd running, so DDP's C++ reducer
never sees a backward pass. Running DDP's forward for real would still drive it: `_pre_forward`
tells the reducer a forward began (and may rebuild its buckets or broadcast buffers on real
tensors), `_post_forward` prepares it for a backward that then never comes. So a DDP call is
answered whole, like a torch.nn module (runtime/stand_ins.py), or the trace stays at the aten
level: the reducer keeps the end-of-iteration state the last call that ran autograd left, as it
does under `without_host` (docs/distributed.md), and the program runs the buffer broadcast, bucket
copies and all-reduces it recorded.

The generated check compares what decides the ops and collectives DDP issues: its class and
hooks, the grad mode, every plain attribute (`require_backward_grad_sync`, which `no_sync()`
flips; `require_forward_param_sync`; `forward_sync_buffers`; the bucket sizes; `_has_rebuilt_buckets`
...), its process group, no Join context and no buffer hook, and the wrapped module's whole
state with the torch.nn module check. The one attribute DDP's forward changes,
`require_forward_param_sync`, is written only once the program has computed the call
(`DeferredWrites`): a call that falls back to the aten level reruns the function from the state
it found.

Collectives the function issues itself (`dist.all_reduce(p.grad)`) do not pass through the
checker's TorchFunctionMode: at the API level they would run on placeholders, before the program.
`distributed_refusal` keeps any trace with such a collective at the aten level.
"""

from __future__ import annotations

import weakref
from _thread import get_ident
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..record.api import BACKWARD, ApiCall, RefKind
from ..record.collectives import is_collective
from ..record.module_calls import ModuleCall, ModuleState, global_hook_dicts
from ..record.own_hooks import any_foreign
from ..record.record import Kind, Record
from .api_match import FAIL, answer_expr, match_lines, template_refs
from .stand_ins import _MODULE_HOOKS, _PLAIN, _ForwardSource, _ForwardStandIn, _Unsupported

# DDP attributes that do not decide what a forward dispatches once the reducer is built (with the
# settings the refusals of record/ddp_calls.py exclude): C++ objects whose state the stand-in
# deliberately leaves alone, construction-time bucket layouts, and lists DDP rebuilds from the
# wrapped module (whose parameters and buffers the module check compares).
_NOT_FORWARD_STATE = frozenset({
    "reducer", "logger", "_bucket_config", "bucket_bytes_cap_list", "_module_parameters", "parameters_to_ignore",
    "modules_buffers", "named_module_buffers", "device", "_delay_all_reduce_params", "_delay_grad_views",
    "_mp_stream", "_submodule_to_event",
})
FORWARD_SYNC = "require_forward_param_sync"


class DeferredWrites:
    """Python attributes the stand-ins of one call change, written once the program has computed
    the call (a call that falls back to the aten level must find the state it started from)."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: list[tuple[dict, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self.pending.append((owner.__dict__, name, value))

    def clear(self) -> None:
        self.pending.clear()

    def apply(self) -> None:
        for attributes, name, value in self.pending:
            attributes[name] = value
        self.pending.clear()


class DdpForwardStandIn(_ForwardStandIn):
    """The callable put in a DDP module's `__dict__` as `forward` for one checked call. Unlike a
    torch.nn module's, it never runs the real forward when its check fails: `_pre_forward` could
    broadcast buffers for real and `_post_forward` would prepare the reducer for a backward the
    API level does not run. The call diverges instead, and runs at the aten level."""

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        checker = self.checker
        if checker is None:  # kept by the function and called after its call: the forward itself
            return self.owner().forward(*args, **kwargs)
        if checker.thread != get_ident():  # another thread's call of the module: not the checked one
            module = self.owner()
            return type(module).forward(module, *args, **kwargs)
        result = self.answer(checker, args, kwargs)
        if result is not FAIL:
            checker.stood_in_ddp += 1
            return result
        checker.diverge(f"DistributedDataParallel's forward at call #{checker.position} differs from the recorded "
                        f"one (its arguments, no_sync(), its settings or the state of the module it wraps)")


class DdpForwardSource(_ForwardSource):
    """Generates `answer(M, args, kwargs, A, E, P)` for a DDP call: FAIL unless DDP and the module
    it wraps have the recorded state, the grad mode is the recorded one and the arguments match;
    else the recorded result, with `require_forward_param_sync` set as `_post_forward` would."""

    def build(self, call: ModuleCall, number: int) -> Any:
        program = self.program
        namespace = program.namespace
        if "GLOBAL_HOOKS" not in namespace:  # torch.nn's global hook dicts, which it only ever mutates
            namespace["GLOBAL_HOOKS"] = global_hook_dicts()
        namespace.setdefault("GRAD_ENABLED", torch.is_grad_enabled)
        namespace.setdefault("ANY_FOREIGN", any_foreign)  # hooks of the user's, not tracejit's own
        self.fail_if("any(GLOBAL_HOOKS) and ANY_FOREIGN(GLOBAL_HOOKS)")
        self.fail_if(f"GRAD_ENABLED() is not {call.ddp.grad_enabled}")
        self.inner_checks(call)
        self.fail_if(f"len(args) != {len(call.args)} or kwargs.keys() != {program.constant(set(call.kwargs), 'k')}")
        for i, template in enumerate(call.args):
            self.lines += match_lines(f"args[{i}]", template, program)
        for key, template in call.kwargs.items():
            self.lines += match_lines(f"kwargs[{key!r}]", template, program)
        states = {id(state.module()): state for state in call.snapshot}
        self._ddp("M", call.snapshot[0], states)
        after = call.ddp.forward_sync_after
        if type(after) is not bool:
            raise _Unsupported(f"{FORWARD_SYNC} is a {type(after).__name__} after forward")
        if after is not call.snapshot[0].attributes.get(FORWARD_SYNC):
            self.lines.append(f"{program.constant(program.deferred_writes, 'writes')}.set(M, {FORWARD_SYNC!r}, {after})")
        return self._function(f"ddp_forward{number}_{call.start}", answer_expr(call.result, program))

    def _ddp(self, expr: str, state: ModuleState, states: dict) -> None:
        self.locals += 1
        d = f"d{self.locals}"
        self.lines.append(f"{d} = {expr}.__dict__")
        self.fail_if(f"type({expr}) is not {self.program.constant(DistributedDataParallel, 'C')}")
        self.fail_if(" or ".join(f"{d}[{name!r}]" for name in _MODULE_HOOKS))
        # a communication hook, a buffer hook or a Join context would run Python around the ops
        self.fail_if(f"{d}.get('_comm_hooks') or 'buffer_hook' in {d} or "
                     f"getattr({d}.get('_join_config'), 'enable', True) is not False")
        plain = {k: v for k, v in state.attributes.items() if type(v) in _PLAIN or type(v) is tuple and all(
            type(item) in _PLAIN for item in v)}
        keys = self.program.constant(tuple(plain), "k")
        self.lines.append(f"v = tuple(map({d}.get, {keys}))")
        self.fail_if(f"v != {self.program.constant(tuple(plain.values()), 'c')} or "
                     f"tuple(map(type, v)) != {self.program.constant(tuple(map(type, plain.values())), 'c')}")
        for key, value in sorted(state.attributes.items()):
            if key in plain or key in _NOT_FORWARD_STATE or key == "_join_config":
                continue
            if key == "process_group":  # the group its collectives were recorded on
                self.fail_if(f"{d}.get('process_group') is not {self.program.constant(weakref.ref(value), 'w')}()")
            else:
                raise _Unsupported(f"DistributedDataParallel.{key} is a {type(value).__name__}")
        self.fail_if(f"{d}['_parameters'] or {d}['_buffers']")
        inner = state.children.get("module")
        if tuple(state.children) != ("module",) or inner is None or inner() is None or id(inner()) not in states:
            raise _Unsupported("the module it wraps is gone")
        local = f"m{self.locals}"
        self.lines.append(f"{local} = {d}['_modules'].get('module')")
        self.fail_if(f"len({d}['_modules']) != 1 or {local} is not {self.program.constant(inner, 'w')}()")
        self._module(local, states[id(inner())], states)


def distributed_refusal(record: Record, calls: list[ApiCall], module_calls: list[ModuleCall]) -> str | None:
    """Why the API level cannot replay a trace under torch.distributed, or None: a DDP call it
    cannot answer whole (running its forward would drive the reducer for a backward that never
    comes), or a collective that no answered DDP call issues (the function would issue it itself,
    on placeholders)."""
    ddp_calls = [call for call in module_calls if call.ddp is not None]
    for call in ddp_calls:
        if call.refused is not None:
            where = calls[call.start].source if call.start < len(calls) else "?"
            return f"DistributedDataParallel at {where} cannot be answered whole: {call.refused}"
    collectives = [op for op in record.ops if is_collective(op.op)]
    if not collectives:
        return None
    forwards, backwards = _ddp_spans(calls, ddp_calls)
    covered = forwards + backwards
    for op in collectives:
        if not any(start <= op.index < end for start, end in covered):
            return (f"the collective {op.name} at {op.source} is issued by the function itself, not by a "
                    f"DistributedDataParallel call the API level answers whole (the only collectives it replays)")
    return None


def _ddp_spans(calls: list[ApiCall], ddp_calls: list[ModuleCall]) -> tuple[list, list]:
    """The aten spans of the DDP forwards (the buffer broadcast) and of the backward passes after the
    first of them (the reducer's bucket copies and all-reduces)."""
    forwards = [(calls[c.start].span[0], calls[c.end - 1].span[1]) for c in ddp_calls if c.end > c.start]
    if not ddp_calls:
        return forwards, []
    first = min(c.start for c in ddp_calls)
    return forwards, [c.span for c in calls[first:] if c.name.rsplit(".", 1)[-1] in BACKWARD]


def kept_by_ddp(record: Record, trace: Any) -> set[int]:
    """Handles of values DDP keeps beyond the call, out of the function's reach:

    - the views of the reducer's flat buckets it makes in backward (`bucket_views_out`), which it
      holds until the next backward that runs autograd. Only C++ can keep a value made inside
      `backward()` (Python code there refuses the API level); at the API level the reducer does
      not run, so it keeps the views of the last call that ran autograd, which alias the buckets
      the program writes in place;
    - the tensors DDP's collectives communicate and their views, made inside DDP's forward or the
      reducer's backward (the flat buffer of the buffer broadcast), which gloo's work object may
      still hold for a moment after the wait returned; unless the function sees them (the result
      of DDP's forward, or any call outside it).

    Empty unless the trace has a DDP call."""
    ddp_calls = [call for call in trace.module_calls if call.ddp is not None]
    if not ddp_calls:
        return set()
    forwards, backwards = _ddp_spans(trace.calls, ddp_calls)
    spans = forwards + backwards

    def root(info: Any) -> Any:
        while info.base is not None:
            info = record.tensors[info.base]
        return info

    def made_inside(info: Any, within: list) -> bool:
        return info.producer is not None and any(start <= info.producer < end for start, end in within)

    communicated = {root(record.tensors[h]).handle for op in record.ops if is_collective(op.op)
                    and any(start <= op.index < end for start, end in spans)
                    for h in (*op.inputs, *op.outputs, *op.mutated) if h is not None}
    inside_forwards = [(c.start, c.end) for c in ddp_calls]
    visible = template_refs([trace.output, *(c.result for c in ddp_calls)], RefKind.VALUE, set())
    for call in trace.calls:
        if not any(start <= call.index < end for start, end in inside_forwards):
            template_refs((call.args, call.kwargs, call.result), RefKind.VALUE, visible)
    kept = set()
    for info in record.tensors:
        if info.handle in visible:
            continue
        base = root(info)
        if base.handle in communicated and made_inside(info, spans):
            kept.add(info.handle)
        elif info.base is not None and base.kind is Kind.EXTERNAL and made_inside(info, backwards):
            kept.add(info.handle)
    return kept


def seal_ddp_spans(program: Any, trace: Any, program_slots: set[int]) -> set[int]:
    """Make the torch calls inside DDP forwards unmatchable, and return the external slots that only
    they use.

    The stand-in answers a DDP forward as a whole, so the checker never matches the calls inside
    it; if DDP's real forward ran instead (its `forward` replaced since the trace was noted), it
    must diverge before `_post_forward` prepares the reducer for a backward that never comes. And
    those calls hold DDP's temporaries (the flat buffer of the buffer broadcast), which are gone on
    the next call: they need not be alive, unless the program or a call outside the spans uses them."""
    spans = [(call.start, call.end) for call in trace.module_calls if call.ddp is not None and call.end > call.start]
    if not spans:
        return set()
    never = program._function("ddp_span_call", "args, kwargs, A, E, P, S", ["return FAIL"])
    inside, outside = set(), template_refs(trace.output, RefKind.EXTERNAL, set()) | program_slots
    for call in trace.calls:
        used = template_refs((call.args, call.kwargs, call.result), RefKind.EXTERNAL, set())
        if any(start <= call.index < end for start, end in spans):
            program.steps[call.index] = never
            inside |= used
        else:
            outside |= used
    return inside - outside

