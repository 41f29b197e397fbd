"""The param_groups settings of keyword optimizers in a host-free call.

A call without the function does not see `param_groups`: the numbers the optimizer passed to its
ops are dynamic scalars of the program (the flat list `s`). A setting whose slots are known is
read from `param_groups` on every call and written into them (a *binding*): `lr` of torch.optim's
optimizers, and for the fused ops and torch's SGD the settings schedulers change (`OneCycleLR` cycles momentum or
beta1). Every other setting, the groups and their parameters are guarded: a changed one makes the
call a checked one, which runs the function and records the new numbers.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.optim.optimizer as optimizer_module

from ..record.calls import scalar_slot_names
from ..record.names import plain_copy, plain_value, root_expression, roots_of, same_value
from ..record.own_hooks import foreign
from ..record.record import Record
from ..record.regions import in_optimizer_step
from .program import scalar_layout

_PRIMITIVES = (bool, int, float, str, type(None))
_LR_ADDS = frozenset({"add_", "_foreach_add_"})  # SGD's param.add_(update, alpha=-lr)
# The scalar arguments of the fused optimizer ops (`_fused_adam_`, `_fused_sgd_`, ...) that are settings.
_FUSED_SLOTS = {"beta1": ("betas", 0), "beta2": ("betas", 1), "eps": ("eps", None),
                "weight_decay": ("weight_decay", None), "momentum": ("momentum", None),
                "dampening": ("dampening", None)}
_ADDS = frozenset({"add", "_foreach_add", "_foreach_add_"})


@dataclass(frozen=True)
class SettingBinding:
    slot: int  # index in the flat scalar list
    owner: str  # an expression for the optimizer in generated code (`kw['opt']`)
    group: int  # index in param_groups
    key: str  # the setting: "lr", "momentum", "betas", ...
    index: int | None = None  # the element of a tuple setting (betas)
    sign: float = 1.0

    def expression(self) -> str:
        element = "" if self.index is None else f"[{self.index}]"
        sign = "-" if self.sign < 0 else ""
        return f"{sign}{self.owner}.param_groups[{self.group}][{self.key!r}]{element}"


def reached_optimizers(function: Any, kwargs: dict) -> list[tuple[str, torch.optim.Optimizer]]:
    """The optimizers the function reaches directly (keyword arguments in keyword order, then its
    globals and closure cells), each once, with the expression that reaches it in a generated call
    (`kw['opt']`, `CELLS[0].cell_contents`)."""
    return reached(function, kwargs, torch.optim.Optimizer)


def reached(function: Any, kwargs: dict, kind: type) -> list[tuple[str, Any]]:
    """The objects of `kind` the function reaches directly, as reached_optimizers."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    keyword = [(("kwarg", name), value) for name, value in sorted(kwargs.items())]
    others = [(root, value) for _, root, value in roots_of(function, {})]
    for root, value in keyword + others:
        if isinstance(value, kind) and id(value) not in seen:
            seen.add(id(value))
            found.append((root_expression(root), value))
    return found


# What decides the numbers and ops of a GradScaler's calls besides its tensors
_SCALER_SETTINGS = ("_enabled", "_growth_factor", "_backoff_factor", "_growth_interval")


def scaler_guards(function: Any, kwargs: dict, updated: tuple, constant: Any, fail: Any) -> list[str]:
    """Lines that fail unless every torch.amp.GradScaler the function reaches directly, or whose
    update() the recorded call ran (`updated`, weak references: reached through a helper object),
    has its recorded settings: `set_growth_factor()` and the like between calls make the call a
    checked one, which passes the new numbers to the program (they were frozen)."""
    scalers = reached(function, kwargs, torch.amp.GradScaler)
    known = {id(scaler) for _, scaler in scalers}
    scalers += [(f"{constant(ref, 'sr')}()", ref()) for ref in updated if ref() is not None and id(ref()) not in known]
    lines = []
    for expr, scaler in scalers:
        if not scaler.__dict__.get("_enabled"):  # disabled: it has no other settings (nor state)
            lines.append(fail(f"{expr}._enabled", f"the GradScaler {expr} was enabled"))
            continue
        settings = {name: scaler.__dict__.get(name) for name in _SCALER_SETTINGS}
        lines.append(fail(f"({', '.join(f'{expr}.{name}' for name in settings)}) != "
                          f"{constant(tuple(settings.values()), 'sc')}", f"the settings of the GradScaler {expr} changed"))
    return lines


def optimizer_hook_guards(optimizers: list[tuple[str, Any]], constant: Any, fail: Any, new_hooks: list[str]) -> list[str]:
    """Lines that fail unless the optimizers' step hooks (their own and torch.optim's global ones)
    and any `step` assigned to the instance (an LR scheduler's wrapper) are the recorded ones:
    `register_step_post_hook` after recording adds code that `step()` would run. Hook dicts empty
    now go to `new_hooks` (only a hook registered since can fill them)."""
    if not optimizers:
        return []
    lines = []
    user_hooks = constant(foreign, "foreign")  # tracejit's own come and go with traced calls
    for hooks in (optimizer_module._global_optimizer_pre_hooks, optimizer_module._global_optimizer_post_hooks):
        expr = constant(hooks, "gh")
        if foreign(hooks):
            lines.append(fail(f"{user_hooks}({expr}) != {constant(foreign(hooks), 'hk')}",
                              "a global optimizer hook was removed"))
        else:
            new_hooks.append(fail(f"{expr} and {user_hooks}({expr})", "a global optimizer hook was registered"))
    for expr, optimizer in optimizers:
        attributes = optimizer.__dict__
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
            hooks = attributes.get(name)
            if hooks:
                lines.append(fail(f"tuple({expr}.{name}) != {constant(tuple(hooks), 'hk')}", f"a step hook of {expr} was removed"))
            else:
                new_hooks.append(fail(f"{expr}.{name}", f"a step hook was registered on {expr}"))
        step = attributes.get("step")
        if step is None:
            condition = f"'step' in {expr}.__dict__"
        else:
            try:
                condition = f"{expr}.__dict__.get('step') is not {constant(weakref.ref(step), 'sw')}()"
            except TypeError:  # not weakly referable: compared by identity of a strong reference
                condition = f"{expr}.__dict__.get('step') is not {constant(step, 'sw')}"
        lines.append(fail(condition, f"step() of {expr} is another function now"))
    return lines


@dataclass
class _Group:
    owner: str
    index: int
    settings: dict
    params: set[int]  # ids of its parameters
    buffers: set[int]  # ids of its momentum buffers
    sgd: bool  # torch.optim.SGD itself: its ops are known (see _sgd_setting)
    momentum_buffers: bool  # SGD or RMSprop: `buf.mul_(momentum)` on their momentum buffers
    # a class of torch.optim: where its ops take the learning rate is known. An optimizer of the
    # user's own (a subclass too) may compute other numbers from it (Lion's `p.mul_(1 - lr * wd)`),
    # which would stay frozen while a bound `lr` followed the schedule: its lr is guarded instead
    torch_own: bool


def find_bindings(record: Record, objects: dict[int, torch.Tensor], optimizers: list[tuple[str, Any]],
                  scalars: list, span: tuple[int, int] | None = None) -> list[SettingBinding]:
    """The scalar slots that carry a setting of a param group of `optimizers` ((expression,
    optimizer) pairs), for the values a call just used (`scalars`: the flat list of its dynamic
    scalars); `span` limits them to the ops of one step() [start, end)."""
    groups = _groups(optimizers)
    if not groups:
        return []
    owner_of = {pid: group for group in groups for pid in group.params}
    offsets, _ = scalar_layout(record)
    found = []
    for op in record.ops if span is None else record.ops[span[0]:span[1]]:
        if not op.scalars or not in_optimizer_step(op.regions):
            continue
        ids = {h: id(objects[h]) for h in (*op.inputs, *op.mutated) if h in objects}
        group = next((owner_of[ids[h]] for h in op.inputs if h in ids and ids[h] in owner_of), None)
        if group is None:
            group = next((g for g in groups for h in op.inputs if h in ids and ids[h] in g.buffers), None)
        if group is None:
            continue
        name = op.op._schema.name.split("::")[-1]
        observed = scalars[offsets[op.index]:offsets[op.index] + len(op.scalars)]
        slots = list(zip(scalar_slot_names(op.op, op.statics), observed))
        for k, (key, index, sign) in _slot_settings(op, name, slots, ids, group):
            found.append(SettingBinding(offsets[op.index] + k, group.owner, group.index, key, index, sign))
    return _unambiguous(found, record, objects, groups, scalars)


def _groups(optimizers: list[tuple[str, Any]]) -> list[_Group]:
    groups = []
    for name, optimizer in optimizers:
        for index, group in enumerate(optimizer.param_groups):
            params = {id(p) for p in group["params"]}
            buffers = {id(state["momentum_buffer"]) for p in group["params"]
                       if isinstance((state := optimizer.state.get(p, {})).get("momentum_buffer"), torch.Tensor)}
            kind = getattr(optimizer, "optimizer_class", type(optimizer))  # a snapshot names its class
            groups.append(_Group(name, index, group, params, buffers, kind is torch.optim.SGD,
                                 kind in (torch.optim.SGD, torch.optim.RMSprop), kind.__module__.startswith("torch.optim.")))
    return groups


def _slot_settings(op: Any, name: str, slots: list, ids: dict, group: _Group):
    """(slot index, (key, element, sign)) for each slot of `op` that carries a setting of `group`."""
    fused = name.startswith("_fused_")
    writes_param = any(ids.get(h) in group.params for h in op.mutated)
    lr = group.settings.get("lr") if group.torch_own else None
    for k, (slot, value) in enumerate(slots):
        if not isinstance(value, float):
            continue
        if isinstance(lr, float) and value in (lr, -lr) and (
                slot == "lr" if fused else (writes_param and slot in ("alpha", "value"))):
            if lr == 0.0:
                # A warm-up from 0: the sign is the zero's own (SGD passes alpha=-lr, so -0.0). The
                # fused ops' `lr` slot is unambiguous; an SGD-style `alpha` only when it is the update
                # of the parameter by -lr itself (the add_ of SGD), not a derived step size.
                if fused or (slot == "alpha" and name in _LR_ADDS):
                    yield k, ("lr", None, math.copysign(1.0, value))
            else:
                yield k, ("lr", None, 1.0 if value == lr else -1.0)
            continue
        setting = _FUSED_SLOTS.get(slot) if fused else _sgd_setting(op, name, slot, ids, group)
        if setting is not None and _setting_value(group.settings, *setting) == value:
            yield k, (*setting, 1.0)


def _sgd_setting(op: Any, name: str, slot: str, ids: dict, group: _Group) -> tuple[str, None] | None:
    """torch.optim.SGD passes momentum to `buf.mul_(momentum)` and, with nesterov, to
    `grad.add(buf, alpha=momentum)`; weight decay to `grad.add(param, alpha=weight_decay)` (the
    `_foreach_` forms alike). Nothing else of its arithmetic is matched: `1 - dampening` stays
    guarded. RMSprop with momentum passes it to `buf.mul_(momentum)` too (OneCycleLR cycles it)."""
    mutated = {ids.get(h) for h in op.mutated}
    if (group.momentum_buffers and name in ("mul_", "_foreach_mul_") and slot in ("other", "scalar") and mutated
            and mutated <= group.buffers):
        return "momentum", None
    if not group.sgd:
        return None
    read = {ids.get(h) for h in op.inputs} - mutated
    if name in _ADDS and slot == "alpha" and not mutated & (group.buffers | group.params):
        if read & group.buffers:
            return "momentum", None
        if read & group.params:
            return "weight_decay", None
    return None


def _setting_value(settings: dict, key: str, index: int | None) -> Any:
    value = settings.get(key)
    if index is not None:
        value = value[index] if isinstance(value, tuple) and index < len(value) else None
    return value


def _unambiguous(found: list[SettingBinding], record: Record, objects: dict, groups: list[_Group],
                 scalars: list) -> list[SettingBinding]:
    """Keep the bindings of a setting only where no other slot of its group's optimizer ops holds
    its value: a use of it these patterns do not know (torch's foreach SGD passes
    `alpha=1 - dampening`, which is momentum's value for momentum 0.9 and dampening 0.1) would
    stay frozen while the bound ones follow. The learning rate keeps its own, older rules."""
    bound = {b.slot for b in found}
    offsets, _ = scalar_layout(record)
    # the optimizer ops with numbers: the objects each touches, and its slots
    steps = [({id(objects[h]) for h in (*op.inputs, *op.mutated) if h in objects}, offsets[op.index], len(op.scalars))
             for op in record.ops if op.scalars and in_optimizer_step(op.regions)]
    by_index = {(g.owner, g.index): g for g in groups}
    free_values: dict[tuple, set] = {}  # (owner, group) -> |x| of the floats in its ops' unbound slots

    def values_of(key: tuple) -> set:
        if key not in free_values:
            group = by_index[key]
            members = group.params | group.buffers
            free_values[key] = {abs(scalars[slot]) for touched, start, count in steps if not touched.isdisjoint(members)
                                for slot in range(start, start + count)
                                if slot not in bound and isinstance(scalars[slot], float)}
        return free_values[key]

    ambiguous = {(b.owner, b.group, b.key) for b in found
                 if b.key != "lr" and abs(scalars[b.slot]) in values_of((b.owner, b.group))}
    return [b for b in found if (b.owner, b.group, b.key) not in ambiguous]


def stepped_optimizers(record: Record, objects: dict[int, torch.Tensor], optimizers: list[tuple[str, Any]]) -> set[str]:
    """The optimizers (by expression) whose `step()` ran ops on their parameters in the record. The
    settings of the others reach no op: the accumulating calls of a gradient-accumulation loop (no
    step) must not miss because a scheduler changed the learning rate."""
    params = {id(p): name for name, optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    stepped = set()
    for op in record.ops:
        if in_optimizer_step(op.regions):
            stepped.update(params[id(objects[h])] for h in (*op.inputs, *op.mutated)
                           if h in objects and id(objects[h]) in params)
    return stepped


def setting_guards(optimizers: list[tuple[str, Any]], bindings: list[SettingBinding], src: Any, fail: Any,
                   stepped: set[str], read: frozenset = frozenset()) -> list[str]:
    """Every setting of every param group of the keyword optimizers that is not bound (maximize,
    nesterov, amsgrad, dampening, ...) is what the program was built with, and so are the groups
    and their parameters (add_param_group, a new params list). A bound setting other than the
    learning rate stays a float, nonzero where it was: SGD skips its momentum and weight decay
    ops at 0, so its zeroness is part of the record, and a bound learning rate stays a number.
    Settings of an optimizer that did not step (`stepped`) are not guarded, but for the keys the
    function may read itself (`read`); its groups and parameters are (`zero_grad()` walks them)."""
    lines = []
    bound: dict[tuple, set] = {}
    for b in bindings:
        bound.setdefault((b.owner, b.group, b.key), set()).add(b.index)
    for name, optimizer in optimizers:
        groups = f"{name}.param_groups"
        lines.append(fail(f"len({groups}) != {len(optimizer.param_groups)}", f"{name} has other param groups"))
        for index, group in enumerate(optimizer.param_groups):
            ids = src.constant(tuple(id(p) for p in group["params"]), "ids")
            lines.append(fail(f"PARAM_IDS({groups}[{index}]['params']) != {ids}",
                              f"param group {index} of {name} has other parameters"))
            for key, value in sorted(group.items()):
                if name not in stepped and key not in read:  # the function itself may read `read`
                    continue
                setting = f"{groups}[{index}][{key!r}]"
                elements = bound.get((name, index, key), set())
                what = f"{key} of param group {index} of {name}"
                if key == "params":
                    continue
                if key == "lr" and elements:  # read as a number on every call: a tensor there is another op
                    lines.append(fail(f"isinstance({setting}, TENSOR)", f"{what} is a tensor now"))
                elif elements and _fully_bound(value, elements):
                    lines += _bound_value_guards(setting, value, fail, what)
                else:
                    lines += _unbound_guards(setting, value, src, fail, what, elements)
    return lines


def _unbound_guards(setting: str, value: Any, src: Any, fail: Any, what: str, bound: set = frozenset()) -> list[str]:
    """A setting the program has built in: a number, string or flag (or a tuple of them) is the
    recorded value. A tensor setting (`lr=torch.tensor(0.01)` of a fused step, tensor betas) is an
    external the program reads where record/names.py finds it (`param_groups[i][key]`), or a
    number torch reads from it that is bound, and stays a tensor: a setting that switches between
    a tensor and a number (either way) runs other ops or is read elsewhere, so the call runs the
    function. Checked before any comparison by value, which a tensor would answer with a tensor.
    The `bound` elements of a tuple (OneCycleLR's float beta1 beside a tensor beta2) keep their
    kind only, as _bound_value_guards says. Any other value is compared as a plain value, or is
    the same object."""
    if isinstance(value, torch.Tensor):
        return [fail(f"not isinstance({setting}, TENSOR)", f"{what} is not a tensor anymore")]
    if isinstance(value, _PRIMITIVES):
        return [fail(f"isinstance(v := {setting}, TENSOR) or v != {src.constant(value, 'hp')}", f"{what} changed")]
    if not isinstance(value, tuple) or not all(isinstance(v, (*_PRIMITIVES, torch.Tensor)) for v in value):
        # a list (`etas=[0.5, 1.2]`), a numpy number (a schedule's np.float32 lr), anything else:
        # by value when it is a plain value (changed in place too), else the same object
        if plain_value(value):
            return [fail(f"not {src.constant(same_value, 'same')}({setting}, {src.constant(plain_copy(value), 'hp')})",
                         f"{what} changed")]
        return [fail(f"{setting} is not {src.constant(value, 'hp')}", f"{what} is another object")]
    checks = ["type(v) is not tuple", f"len(v) != {len(value)}"]
    for i, v in enumerate(value):
        if isinstance(v, torch.Tensor):
            checks.append(f"not isinstance(v[{i}], TENSOR)")
        elif i in bound and isinstance(v, float):
            checks.append(f"type(v[{i}]) is not float or {'' if v else 'not '}v[{i}] == 0")
        else:
            checks.append(f"isinstance(v[{i}], TENSOR) or v[{i}] != {src.constant(v, 'hp')}")
    return [f"v = {setting}", fail(" or ".join(checks), f"{what} changed")]


def _fully_bound(value: Any, elements: set) -> bool:
    if isinstance(value, tuple):
        return elements == set(range(len(value))) and all(isinstance(v, float) for v in value)
    return elements == {None} and isinstance(value, float)


def _bound_value_guards(setting: str, value: Any, fail: Any, what: str) -> list[str]:
    if isinstance(value, tuple):
        checks = ["type(v) is not tuple", f"len(v) != {len(value)}"]
        checks += [f"type(v[{i}]) is not float or {'' if v else 'not '}v[{i}] == 0" for i, v in enumerate(value)]
    else:
        checks = [f"type(v) is not float or {'' if value else 'not '}v == 0"]
    return [f"v = {setting}", fail(" or ".join(checks), f"{what} is not a float of the same zeroness anymore")]


def param_ids(params: list) -> tuple:
    return tuple(id(p) for p in params)
