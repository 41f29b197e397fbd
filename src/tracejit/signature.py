"""Input signatures: what makes two calls share a trace."""

from __future__ import annotations

import weakref

import torch


def tensor_key(tensor: torch.Tensor) -> tuple:
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.requires_grad)


def signature(args: tuple, kwargs: dict) -> tuple:
    """Shapes, strides, dtypes, devices and requires_grad of the tensor inputs, and the training
    flag of keyword modules (`model.eval()` selects a trace of its own)."""
    return (
        tuple(tensor_key(a) for a in args),
        tuple((name, tensor_key(v)) for name, v in sorted(kwargs.items()) if isinstance(v, torch.Tensor)),
        tuple(v.training for v in kwargs.values() if isinstance(v, torch.nn.Module)),
    )


_parameters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def gradient_state(kwargs: dict) -> tuple[int, ...]:
    """Which parameters of keyword modules require grad and which hold a `.grad`.

    This decides what autograd dispatches (a first gradient is stored, a later one accumulated
    with `add_`), so a step that accumulates gradients over several calls gets one trace per
    state instead of a mismatch. It costs ~0.4 us per parameter, so it is computed only for
    traces whose recorded call touched gradients.
    """
    states = []
    for module in kwargs.values():
        if isinstance(module, torch.nn.Module):
            params = _parameters.get(module)
            if params is None:  # walking module.parameters() each call would cost more
                params = _parameters[module] = tuple(module.parameters())
            state = 0
            for p in params:
                state = (state << 2) | (p.requires_grad << 1) | (p.grad is not None)
            states.append(state)
    return tuple(states)


def gradient_snapshot(kwargs: dict) -> list[tuple]:
    """Every parameter's .grad object, its version and requires_grad, to see what a call changed."""
    snapshot = []
    for module in kwargs.values():
        if isinstance(module, torch.nn.Module):
            for p in module.parameters():
                grad = p.grad
                snapshot.append((id(grad), grad._version if grad is not None else -1, p.requires_grad))
    return snapshot


def describe_signature(key: tuple, arg_names: list[str], grad_state: tuple | None = None) -> str:
    def one(k: tuple) -> str:
        shape, _, dtype, device, requires_grad = k
        grad = ", requires_grad" if requires_grad else ""
        return f"{device.type} {str(dtype).removeprefix('torch.')}{list(shape)}{grad}"

    positional, keyword, training = key
    parts = [f"{arg_names[i] if i < len(arg_names) else f'arg{i}'}: {one(k)}" for i, k in enumerate(positional)]
    parts += [f"{name}=: {one(k)}" for name, k in keyword]
    parts += ["training" if flag else "eval" for flag in training]
    if grad_state:
        parts += [f"gradient state {state:#x}" for state in grad_state]
    return "(" + ", ".join(parts) + ")"
