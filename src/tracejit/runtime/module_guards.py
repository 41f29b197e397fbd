"""Guards of a call without the host on the torch.nn modules the recorded call ran.

The program holds what the modules' forward did when the call was recorded: their mode, hooks and
settings decided which ops ran, and their submodules which layers. A call that skips the function
must find every module as it was, however the function reached it (a keyword argument, a
closure, a global, a helper function): the recording call noted each module whose forward ran
(`Record.modules_called`), and the generated call checks each of them and its submodules:

- `training`, and every setting that is an immutable value (`p`, `negative_slope`, `momentum`,
  `eps`, a user module's `heads`...), by identity: the recorded object, or the call runs the
  function (which re-binds the new object, so a setting set again to an equal value costs one
  checked call);
- no forward, forward-pre or backward hook of its own, and no `forward` assigned to the instance,
  beyond those the record ran with;
- the same submodules under the same names (`model[1] = nn.Tanh()` is another module), and no
  global module hook beyond the recorded ones.

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
from .stand_ins import identity_checks, immutable

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_NOT_SETTINGS = frozenset({"_parameters", "_buffers", "_modules", "forward", *_HOOKS})


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
                  fail: Callable[[str, str], str]) -> list[str]:
    """Lines that fail unless every module (and torch.nn's global hooks) is as it is now."""
    if not modules:
        return []
    lines = [_global_hooks_guard(constant, fail)]
    for index, module in enumerate(modules):
        attributes = module.__dict__
        d = f"md{index}"
        lines.append(f"{d} = {constant(weakref.ref(module), 'mr')}().__dict__")  # gone: AttributeError, a miss
        conditions = []
        for name in _HOOKS:
            hooks = attributes.get(name)
            conditions.append(f"tuple({d}[{name!r}]) != {constant(tuple(hooks), 'hk')}" if hooks else f"{d}[{name!r}]")
        forward = attributes.get("forward")
        conditions.append(f"'forward' in {d}" if forward is None else f"{d}.get('forward') is not {constant(forward, 'fw')}")
        # a DDP module's own attributes are its reducer's bookkeeping: its state is the gradient
        # state's (signature._ddp_state); the module it wraps is guarded as any other
        settings = {} if is_ddp(module) else {key: value for key, value in attributes.items()
                                              if key not in _NOT_SETTINGS and immutable(value)}
        if settings:
            conditions.append(identity_checks(d, settings, constant))
        children = attributes["_modules"]
        conditions.append(f"len({d}['_modules']) != {len(children)}")
        conditions += [f"{d}['_modules'][{name!r}] is not " + ("None" if child is None else f"{constant(weakref.ref(child), 'mr')}()")
                       for name, child in children.items()]
        lines.append(fail(" or ".join(conditions),
                          f"the {type(module).__qualname__} module changed (mode, a setting, hooks, forward or submodules)"))
    return lines


def _global_hooks_guard(constant: Callable[[Any, str], str], fail: Callable[[str, str], str]) -> str:
    conditions = []
    for hooks in global_hook_dicts():
        expr = constant(hooks, "gh")
        conditions.append(f"tuple({expr}) != {constant(tuple(hooks), 'hk')}" if hooks else expr)
    return fail(" or ".join(conditions), "a global module hook was registered or removed")
