"""Where Python state holds a tensor a call made, so a host-free call can put its value there.

A host-run call leaves tensors it made in Python state: a first `.grad`, lazy optimizer state, a
module attribute (`self.last = out`). A call without the function must leave its values where the
function would: written into the object Python holds when that is the function's own (it keeps
references valid), assigned anew where the object belongs to someone else (a tensor an earlier
call returned, which must not change) or where Python holds none (`.grad` after zero_grad()).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..record.names import Locator, resolve


@dataclass(frozen=True)
class Holder:
    kind: str  # "grad" | "attr" | "buffer" | "state"
    owner: weakref.ref  # the parameter, module or optimizer
    key: Any = None  # attribute or buffer name; for "state" (parameter ref, state key)

    def assign(self, value: torch.Tensor, kwargs: dict | None = None) -> None:
        """Put `value` where this holder keeps its tensor, as `store` with no recorded object does."""
        owner = self.owner()
        if owner is None:
            return
        if self.kind == "grad":
            owner.grad = value
        elif self.kind == "state":
            param = self.key[0]()
            if param is not None:
                owner.state[param][self.key[1]] = value
        else:
            (owner.__dict__ if self.kind == "attr" else owner._buffers)[self.key] = value

    def store(self, value: str, recorded: str | None, src: Any) -> list[str]:
        """Lines that leave the tensor `value` where this holder keeps it: written into the tensor
        held now if that is `recorded()` (the object of the last host-run call), else assigned.
        `recorded` None: always assigned (the held tensor was returned by an earlier call)."""
        owner = src.constant(self.owner, "r")
        if self.kind == "grad":
            lines, read, assign = [f"p = {owner}()", "if p is not None:"], "p.grad", f"p.grad = {value}"
        elif self.kind == "state":
            param, key = self.key
            lines = [f"q = {owner}()", f"p = {src.constant(param, 'r')}()", "if q is not None and p is not None:",
                     "    d = q.state[p]"]
            read, assign = f"d.get({key!r})", f"d[{key!r}] = {value}"
        else:
            where = "__dict__" if self.kind == "attr" else "_buffers"
            lines = [f"m = {owner}()", "if m is not None:", f"    d = m.{where}"]
            read, assign = f"d.get({self.key!r})", f"d[{self.key!r}] = {value}"
        if recorded is None:
            return [*lines, f"    {assign}"]
        return [*lines, f"    o = {read}", f"    if o is not None and o is {recorded}(): o.copy_({value})",
                f"    elif o is not {value}: {assign}"]


@dataclass(frozen=True)
class Place:
    """A place the function reaches other than through a keyword module or optimizer (a global
    dict's entry, an attribute of a global module or of a keyword object of the user's class) where
    it leaves a tensor it made: a new tensor on every eager call, so it is always assigned anew."""
    locator: Locator
    function: Any  # the traced function, whose globals and closure cells the locator starts from
    kind: str = "place"

    def assign(self, value: torch.Tensor, kwargs: dict) -> None:
        container = resolve(Locator(self.locator.root, self.locator.steps[:-1]), self.function, kwargs)
        step, key = self.locator.steps[-1]
        if step == "item":
            container[key] = value
        else:
            (container.__dict__ if step == "attr" else container._buffers)[key] = value

    def store(self, value: str, container: str) -> list[str]:
        """The line that leaves `value` at the place, in the container the guards bound to `container`."""
        step, key = self.locator.steps[-1]
        target = {"item": f"{container}[{key!r}]", "attr": f"{container}.__dict__[{key!r}]",
                  "buffer": f"{container}._buffers[{key!r}]"}[step]
        return [f"{target} = {value}"]


def parameters_of(kwargs: dict) -> list[torch.Tensor]:
    """The parameters of the keyword modules and optimizers, each once."""
    found: dict[int, torch.Tensor] = {}
    for value in kwargs.values():
        if isinstance(value, torch.nn.Module):
            found.update((id(p), p) for p in value.parameters())
        elif isinstance(value, torch.optim.Optimizer):
            found.update((id(p), p) for group in value.param_groups for p in group["params"])
    return list(found.values())


def find_holders(kwargs: dict) -> dict[int, Holder]:
    """id(tensor) -> where keyword modules and optimizers hold it: `.grad` of a parameter, a module
    attribute or buffer, an optimizer state entry."""
    holders: dict[int, Holder] = {}
    for value in kwargs.values():
        if isinstance(value, torch.nn.Module):
            for module in value.modules():
                for param in module._parameters.values():
                    if param is not None and param.grad is not None:
                        holders.setdefault(id(param.grad), Holder("grad", weakref.ref(param)))
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        holders.setdefault(id(buffer), Holder("buffer", weakref.ref(module), name))
                for name, attr in vars(module).items():
                    if isinstance(attr, torch.Tensor):
                        holders.setdefault(id(attr), Holder("attr", weakref.ref(module), name))
        elif isinstance(value, torch.optim.Optimizer):
            for group in value.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        holders.setdefault(id(param.grad), Holder("grad", weakref.ref(param)))
            for param, state in value.state.items():
                for key, tensor in state.items():
                    if isinstance(tensor, torch.Tensor):
                        holders.setdefault(id(tensor), Holder("state", weakref.ref(value), (weakref.ref(param), key)))
    return holders
