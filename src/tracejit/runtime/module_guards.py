"""Guards of a call without the host on the torch.nn modules the recorded call ran.

The program holds what the modules' forward did when the call was recorded: their mode, hooks and
settings decided which ops ran, and their submodules which layers. A call that skips the function
must find every module as it was, however the function reached it (a keyword argument, a
closure, a global, a helper function): the recording call noted each module whose forward ran
(`Record.modules_called`), and the generated call checks each of them and its submodules:

- `training`, and every setting that is an immutable value (`p`, `negative_slope`, `momentum`,
  `eps`, a user module's `heads`, a dtype, an enum member...), by identity, and every other plain
  value (a device, a `torch.Size`, a range or slice, a list or dict of numbers) by value: the recorded object, or the call runs the
  function (which re-binds the new object, so a setting set again to an equal value costs one
  checked call);
- no forward, forward-pre or backward hook of its own, and no `forward` assigned to the instance,
  beyond those the record ran with (a hook dict empty at binding is only looked at when a hook
  was registered anywhere since: see `hook_registered_since`);
- the same submodules under the same names (`model[1] = nn.Tanh()` is another module), and no
  global module hook beyond the recorded ones;
- for a DistributedDataParallel module, the same communication hooks and buffer hook (Python that
  runs around its collectives: one registered since computes other gradients) and the same Join
  configuration (a forward inside `Join([model])` issues Join's all-reduces too).

Settings held in mutable objects (a list, a dict, an object of the user's) are not compared; see
docs/guide.md ("without_host=True").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..record.ddp_calls import is_ddp
from ..record.module_calls import global_hook_dicts
from ..record.names import plain_copy, plain_value, same_value
from ..record.own_hooks import foreign
from .stand_ins import identity_checks, immutable

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# `_is_full_backward_hook` only says which kind the backward hooks are, which are compared themselves
_NOT_SETTINGS = frozenset({"_parameters", "_buffers", "_modules", "forward", "_is_full_backward_hook", *_HOOKS})


def guarded_modules(called: Iterable[weakref.ref]) -> list[torch.nn.Module]:
    """The modules the recorded call ran that are alive, and their submodules as they are now."""
    found: dict[int, torch.nn.Module] = {}
    for ref in called:
        module = ref()
        if module is not None:
            for sub in module.modules():
                found.setdefault(id(sub), sub)
    return list(found.values())


def module_guards(modules: list[torch.nn.Module], constant: Callable[[Any, str], str],
                  fail: Callable[[str, str], str], new_hooks: list[str]) -> list[str]:
    """Lines that fail unless every module (and torch.nn's global hooks) is as it is now. A module
    under another guarded one is reached through it (`md0['_modules']['1']`): one without
    parameters or buffers is checked by type (a replacement of the same type and settings computes
    the same), one with them by identity; the others are reached through a weak reference."""
    if not modules:
        return []
    lines = []
    _global_hooks_guard(constant, fail, lines, new_hooks)
    local: dict[int, str] = {}  # id(module) -> the local holding its __dict__
    parents = {id(child): (module, name) for module in modules for name, child in module._modules.items()
               if child is not None}
    for module in _parents_first(modules, parents):
        attributes = module.__dict__
        d = local[id(module)] = f"md{len(local)}"
        parent = parents.get(id(module))
        by_type = False  # another object of the same type may stand here
        if parent is not None and id(parent[0]) in local:
            child = f"{local[id(parent[0])]}['_modules'][{parent[1]!r}]"
            lines.append(f"mc = {child}")
            if _holds_tensors(module):  # the program reads its tensors: this very module
                same = f"mc is not {constant(weakref.ref(module), 'mr')}()"
            else:
                same = f"type(mc) is not {constant(type(module), 'mt')}"
                by_type = True
            lines.append(fail(same, f"{child} is another module"))
            lines.append(f"{d} = mc.__dict__")
        else:
            lines.append(f"{d} = {constant(weakref.ref(module), 'mr')}().__dict__")  # gone: AttributeError, a miss
        conditions = []
        for name in _HOOKS:
            hooks = attributes.get(name)
            if hooks:
                conditions.append(f"tuple({d}[{name!r}]) != {constant(tuple(hooks), 'hk')}")
            elif by_type:  # a replacement may carry hooks registered before binding (or deep-copied)
                conditions.append(f"{d}[{name!r}]")
            else:  # only a hook registered since can make it non-empty
                new_hooks.append(fail(f"{d}[{name!r}]", f"a hook was registered on the {type(module).__qualname__} module"))
        forward = attributes.get("forward")
        conditions.append(f"'forward' in {d}" if forward is None else f"{d}.get('forward') is not {constant(forward, 'fw')}")
        # a DDP module's own attributes are its reducer's bookkeeping: its state is the gradient
        # state's (signature._ddp_state); the module it wraps is guarded as any other
        settings = {} if is_ddp(module) else {key: value for key, value in attributes.items()
                                              if key not in _NOT_SETTINGS and immutable(value)}
        if settings:
            conditions.append(identity_checks(d, settings, constant))
        # a small numpy array it holds (`torch.tensor(self.w)` builds its values into the
        # program): compared by its bytes, as a keyword's or a global's is
        # and any other plain value (a device, a torch.Size, a range, a slice, a list or dict of
        # numbers), compared by value: changed in place too, and set again to an equal one (each
        # forward may make `self.device = x.device` anew)
        arrays = {} if is_ddp(module) else {key: value for key, value in attributes.items()
                                            if key not in _NOT_SETTINGS and key not in settings and plain_value(value)}
        if arrays:
            same = constant(same_value, "sv")
            conditions += [f"not {same}({d}.get({key!r}), {constant(plain_copy(value), 'arr')})"
                           for key, value in arrays.items()]
        if is_ddp(module):
            conditions += _ddp_python_state(d, attributes, constant)
        children = attributes["_modules"]
        conditions.append(f"len({d}['_modules']) != {len(children)}" if children else f"{d}['_modules']")
        conditions += [f"{d}['_modules'][{name!r}] is not None" for name, child in children.items() if child is None]
        # a parameter or buffer registered since, or one that was None given a tensor (a mask
        # buffer filled later, a bias added); an attribute set since that forward may read
        # (`getattr(self, "extra", None)`): the tensors themselves are externals, guarded as such
        for kind in ("_parameters", "_buffers"):
            held = attributes.get(kind)
            if isinstance(held, dict):
                conditions.append(f"len({d}[{kind!r}]) != {len(held)}")
                conditions += [f"{d}[{kind!r}][{name!r}] is not None" for name, value in held.items() if value is None]
        conditions.append(f"len({d}) != {len(attributes)}")
        what = "a communication hook, Join, " if is_ddp(module) else "mode, a setting, "
        lines.append(fail(" or ".join(conditions),
                          f"the {type(module).__qualname__} module changed ({what}hooks, forward or submodules)"))
    return lines


def _ddp_python_state(d: str, attributes: dict, constant: Callable[[Any, str], str]) -> list[str]:
    """Conditions true when what a DistributedDataParallel module runs in Python around its
    collectives differs from binding: its communication hooks (`register_comm_hook`, a list of
    (hook, state) pairs: a hook registered since computes other gradients than the recorded
    all-reduce), its buffer hook, and its Join configuration (`Join([model])` sets it, and a
    forward then issues Join's all-reduces, which the program does not have)."""
    hooks = tuple(map(tuple, attributes.get("_comm_hooks") or ()))
    conditions = [f"tuple(map(tuple, {d}.get('_comm_hooks') or ())) != {constant(hooks, 'ch')}" if hooks
                  else f"{d}.get('_comm_hooks')"]
    buffer_hook = attributes.get("buffer_hook")
    conditions.append(f"'buffer_hook' in {d}" if buffer_hook is None
                      else f"{d}.get('buffer_hook') is not {constant(buffer_hook, 'bh')}")
    join = attributes.get("_join_config")  # a NamedTuple of bools, compared by value
    conditions.append(f"{d}.get('_join_config') != {constant(join, 'jc')}")
    return conditions


def _holds_tensors(module: torch.nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _parents_first(modules: list[torch.nn.Module], parents: dict) -> list[torch.nn.Module]:
    """The modules in an order where a guarded parent comes before its children."""
    guarded = {id(m) for m in modules}
    depth = {}

    def level(module: torch.nn.Module) -> int:
        if id(module) not in depth:
            parent = parents.get(id(module))
            depth[id(module)] = 0 if parent is None or id(parent[0]) not in guarded else level(parent[0]) + 1
        return depth[id(module)]

    return sorted(modules, key=level)


def _global_hooks_guard(constant: Callable[[Any, str], str], fail: Callable[[str, str], str], lines: list[str],
                        new_hooks: list[str]) -> None:
    for hooks in global_hook_dicts():  # the user's: tracejit's own come and go with traced calls (record/own_hooks.py)
        expr, user_hooks = constant(hooks, "gh"), constant(foreign, "foreign")
        if foreign(hooks):
            lines.append(fail(f"{user_hooks}({expr}) != {constant(foreign(hooks), 'hk')}", "a global module hook was removed"))
        else:
            new_hooks.append(fail(f"{expr} and {user_hooks}({expr})", "a global module hook was registered"))
