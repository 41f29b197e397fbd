"""Where external tensors live: readable names and locators.

A *locator* is the chain of lookups that leads from a root the traced function can see (a
keyword argument, a global, a closure cell) to a tensor: `kwargs["model"]._modules["fc1"]
._parameters["weight"]`, or `kwargs["opt"].state[<param>]["exp_avg"]`. Names make messages and
listings clear; locators let `without_host` check, without running the function, that the
function would still reach the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Locator:
    root: tuple[str, Any]  # ("kwarg", name) | ("global", name) | ("cell", index)
    # ("module", child) | ("param", name) | ("buffer", name), and ("grad", None) after a param
    steps: tuple[tuple[str, Any], ...]
    state_of: Locator | None = None  # optimizer state: the parameter whose state dict holds it
    state_key: str | None = None

    def describe(self) -> str:
        kind, name = self.root
        text = {"kwarg": f"kwargs[{name!r}]", "global": f"globals()[{name!r}]", "cell": f"closure[{name}]"}[kind]
        if self.state_of is not None:
            return f"{text}.state[{self.state_of.describe()}][{self.state_key!r}]"
        for step, key in self.steps:
            text += {"module": f"._modules[{key!r}]", "param": f"._parameters[{key!r}]",
                     "buffer": f"._buffers[{key!r}]", "grad": ".grad"}[step]
        return text


class ExternalNames:
    def __init__(self, function: Callable, kwargs: dict):
        self._function = function
        self._kwargs = kwargs
        self._found: dict[int, tuple[str, Locator | None]] | None = None

    def name_of(self, tensor: torch.Tensor) -> str | None:
        entry = self._lookup().get(id(tensor))
        return entry[0] if entry else None

    def locator_of(self, tensor: torch.Tensor) -> Locator | None:
        entry = self._lookup().get(id(tensor))
        return entry[1] if entry else None

    def _lookup(self) -> dict[int, tuple[str, Locator | None]]:
        if self._found is None:
            self._found = self._collect()
        return self._found

    def _roots(self) -> list[tuple[str, tuple[str, Any], Any]]:
        return roots_of(self._function, self._kwargs)

    def _collect(self) -> dict[int, tuple[str, Locator | None]]:
        found: dict[int, tuple[str, Locator | None]] = {}
        roots = self._roots()
        for name, root, value in roots:
            if isinstance(value, torch.nn.Module):
                _walk_module(value, name, Locator(root, ()), found)
            elif isinstance(value, torch.Tensor):
                found.setdefault(id(value), (name, Locator(root, ())))
        for name, root, value in roots:
            if isinstance(value, torch.optim.Optimizer):
                for param, state in value.state.items():
                    owner_name, owner_locator = found.get(id(param), ("param", None))
                    for key, tensor in state.items():
                        if isinstance(tensor, torch.Tensor):
                            locator = Locator(root, (), owner_locator, key) if owner_locator else None
                            found.setdefault(id(tensor), (f"{name}.state[{owner_name}].{key}", locator))
        return found


def roots_of(function: Callable, kwargs: dict) -> list[tuple[str, tuple[str, Any], Any]]:
    """What the function reaches directly, as (name, root, value): its keyword arguments, the
    globals its code names and its closure cells."""
    roots = [(name, ("kwarg", name), value) for name, value in kwargs.items()]
    code = getattr(function, "__code__", None)
    if code is not None:
        globals_ = getattr(function, "__globals__", {})
        roots += [(n, ("global", n), globals_[n]) for n in code.co_names if n in globals_]
        closure = getattr(function, "__closure__", None) or ()
        for index, (name, cell) in enumerate(zip(code.co_freevars, closure)):
            try:
                roots.append((name, ("cell", index), cell.cell_contents))
            except ValueError:  # empty cell
                pass
    return roots


def root_expression(root: tuple[str, Any]) -> str:
    """The expression for a root in a generated call (`kw`, `GLOBALS` and `CELLS` in scope)."""
    kind, key = root
    return {"kwarg": f"kw[{key!r}]", "global": f"GLOBALS[{key!r}]", "cell": f"CELLS[{key}].cell_contents"}[kind]


def _walk_module(module: torch.nn.Module, prefix: str, locator: Locator, found: dict) -> None:
    for name, param in module._parameters.items():
        if param is not None:
            located = Locator(locator.root, (*locator.steps, ("param", name)))
            found.setdefault(id(param), (f"{prefix}.{name}", located))
            if param.grad is not None:  # a gradient accumulated over calls is read where it is now
                found.setdefault(id(param.grad), (f"{prefix}.{name}.grad", Locator(locator.root, (*located.steps, ("grad", None)))))
    for name, buffer in module._buffers.items():
        if buffer is not None:
            found.setdefault(id(buffer), (f"{prefix}.{name}",
                                          Locator(locator.root, (*locator.steps, ("buffer", name)))))
    for name, child in module._modules.items():
        if child is not None:
            _walk_module(child, f"{prefix}.{name}", Locator(locator.root, (*locator.steps, ("module", name))), found)
