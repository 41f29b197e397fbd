"""Readable names for external tensors ("model.fc1.weight", "opt.state[fc1.weight].exp_avg").

Names only make messages and listings clearer; nothing depends on finding one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class ExternalNames:
    def __init__(self, function: Callable, kwargs: dict):
        self._function = function
        self._kwargs = kwargs
        self._names: dict[int, str] | None = None

    def name_of(self, tensor: torch.Tensor) -> str | None:
        if self._names is None:
            self._names = self._collect()
        return self._names.get(id(tensor))

    def _roots(self) -> list[tuple[str, Any]]:
        roots = list(self._kwargs.items())
        code = getattr(self._function, "__code__", None)
        if code is not None:
            globals_ = getattr(self._function, "__globals__", {})
            roots += [(n, globals_[n]) for n in code.co_names if n in globals_]
            closure = getattr(self._function, "__closure__", None) or ()
            for name, cell in zip(code.co_freevars, closure):
                try:
                    roots.append((name, cell.cell_contents))
                except ValueError:  # empty cell
                    pass
        return roots

    def _collect(self) -> dict[int, str]:
        names: dict[int, str] = {}
        param_names: dict[int, str] = {}
        roots = self._roots()
        for root, value in roots:
            if isinstance(value, torch.nn.Module):
                for name, tensor in value.named_parameters():
                    names.setdefault(id(tensor), f"{root}.{name}")
                    param_names.setdefault(id(tensor), f"{root}.{name}")
                for name, tensor in value.named_buffers():
                    names.setdefault(id(tensor), f"{root}.{name}")
            elif isinstance(value, torch.Tensor):
                names.setdefault(id(value), root)
        for root, value in roots:
            if isinstance(value, torch.optim.Optimizer):
                for param, state in value.state.items():
                    owner = param_names.get(id(param), "param")
                    for key, tensor in state.items():
                        if isinstance(tensor, torch.Tensor):
                            names.setdefault(id(tensor), f"{root}.state[{owner}].{key}")
        return names
