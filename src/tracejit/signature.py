"""Input signatures: what makes two calls share a trace."""

from __future__ import annotations

import weakref

import torch


def tensor_key(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor.device, tensor.requires_grad)


def signature(args: tuple, kwargs: dict) -> tuple:
    """Shapes, strides, dtypes, devices and requires_grad of the tensor inputs, plus the training
    flag and gradient state of keyword modules.

    Which parameters require grad and which already hold a `.grad` decide what autograd
    dispatches (a first gradient is stored, a later one accumulated with `add_`), so a step that
    accumulates gradients over several calls gets one trace per state instead of a mismatch;
    `model.eval()` likewise selects a trace of its own.
    """
    return (
        tuple(tensor_key(a) for a in args),
        tuple((name, tensor_key(v)) for name, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor)),
        tuple(_grad_state(v) for v in kwargs.values() if isinstance(v, torch.nn.Module)),
    )


_parameters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _grad_state(module: torch.nn.Module) -> int:
    # Walking module.parameters() costs ~15 us per call on a small model; the list is cached
    # per module (a replaced parameter is caught by the checks on externals instead).
    params = _parameters.get(module)
    if params is None:
        params = _parameters[module] = tuple(module.parameters())
    state = module.training
    for p in params:
        state = (state << 2) | (p.requires_grad << 1) | (p.grad is not None)
    return state


def describe_signature(key: tuple, arg_names: list[str]) -> str:
    def one(k: tuple) -> str:
        shape, _, dtype, device, requires_grad = k
        grad = ", requires_grad" if requires_grad else ""
        return f"{device.type} {str(dtype).removeprefix('torch.')}{list(shape)}{grad}"

    positional, keyword, grad_states = key
    parts = [f"{arg_names[i] if i < len(arg_names) else f'arg{i}'}: {one(k)}" for i, k in enumerate(positional)]
    parts += [f"{name}=: {one(k)}" for name, k in keyword]
    parts += [f"module training/gradient state {state:#x}" for state in grad_states]
    return "(" + ", ".join(parts) + ")"
