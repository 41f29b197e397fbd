"""The numbers torch.optim's Adam, AdamW, Adagrad and Adamax pass to their ops when they read
`step` on the host.

Without `fused=True` or `capturable=True` (torch's default on the CPU), Adam reads each parameter's
step count with `.item()` and computes the bias corrections and the step size in Python, then
passes them to its ops as numbers (Adagrad its decayed learning rate, Adamax its bias-corrected
one). A stand-in for such a `step()` (runtime/stand_ins.py) must pass the same numbers: these
functions compute every number of one param group's update, in the order its ops take them,
with the formulas of torch.optim.adam (`_single_tensor_adam`, `_multi_tensor_adam`) and their
counterparts in torch.optim.adagrad and torch.optim.adamax. A stand-in uses one only after it
gave, bit for bit, every number the record holds for the update it stands for; another torch
version with other formulas is then a real step, never other numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def single_tensor_adam(group: dict, steps: list[float], decoupled: bool) -> list:
    """`_single_tensor_adam`, capturable=False: per parameter, in order."""
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    numbers: list = []
    for step in steps:
        numbers.append(1)  # step_t += 1
        if weight_decay != 0:
            numbers.append(1 - lr * weight_decay if decoupled else weight_decay)
        numbers += [1 - beta1, beta2, 1 - beta2]  # lerp_, mul_, addcmul_
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        numbers += [bias_correction2**0.5, eps, -step_size]  # div, add_, addcdiv_
    return numbers


def multi_tensor_adam(group: dict, steps: list[float], decoupled: bool) -> list:
    """`_multi_tensor_adam`, capturable=False, the parameters of one device and dtype."""
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    numbers: list = [1.0]  # _foreach_add_(steps, tensor(1.0), alpha=1.0)
    if weight_decay != 0:
        numbers.append(1 - lr * weight_decay if decoupled else weight_decay)
    numbers += [1 - beta1, beta2, 1 - beta2]  # _foreach_lerp_, _foreach_mul_, _foreach_addcmul_
    bias_correction1 = [1 - beta1**step for step in steps]
    bias_correction2 = [1 - beta2**step for step in steps]
    step_size = [(lr / bc) * -1 for bc in bias_correction1]
    numbers += [bc**0.5 for bc in bias_correction2]  # _foreach_div_
    numbers.append(eps)  # _foreach_add_
    numbers += step_size  # _foreach_addcdiv_
    return numbers


def single_tensor_adagrad(group: dict, steps: list[float], decoupled: bool) -> list:
    """`_single_tensor_adagrad` on dense gradients: per parameter, in order."""
    lr, lr_decay, eps, weight_decay = group["lr"], group["lr_decay"], group["eps"], group["weight_decay"]
    numbers: list = []
    for step in steps:
        numbers.append(1)  # step_t += 1
        if weight_decay != 0:
            numbers.append(weight_decay)  # grad.add(param, alpha=...)
        clr = lr / (1 + (step - 1) * lr_decay)
        numbers += [eps, -clr]  # std.add_(eps), param.addcdiv_(grad, std, value=-clr)
    return numbers


def multi_tensor_adagrad(group: dict, steps: list[float], decoupled: bool) -> list:
    """`_multi_tensor_adagrad` on dense gradients, the parameters of one device and dtype."""
    lr, lr_decay, eps, weight_decay = group["lr"], group["lr_decay"], group["eps"], group["weight_decay"]
    numbers: list = [1.0]  # _foreach_add_(steps, tensor(1.0), alpha=1.0)
    if weight_decay != 0:
        numbers.append(weight_decay)
    numbers.append(eps)  # _foreach_add_(std, eps)
    numbers += [-lr / (1 + (step - 1) * lr_decay) for step in steps]  # _foreach_mul(grads, minus_clr)
    return numbers


def single_tensor_adamax(group: dict, steps: list[float], decoupled: bool) -> list:
    """`_single_tensor_adamax`, capturable=False: per parameter, in order."""
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    numbers: list = []
    for step in steps:
        numbers.append(1)  # step_t += 1
        if weight_decay != 0:
            numbers.append(weight_decay)
        clr = lr / (1 - beta1**step)
        numbers += [1 - beta1, beta2, eps, -clr]  # lerp_, mul_, add_, addcdiv_
    return numbers


def multi_tensor_adamax(group: dict, steps: list[float], decoupled: bool) -> list:
    """`_multi_tensor_adamax`, capturable=False, the parameters of one device and dtype."""
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    numbers: list = [1.0]
    if weight_decay != 0:
        numbers.append(weight_decay)
    numbers += [1 - beta1, beta2, eps]  # _foreach_lerp_, _foreach_mul_, _foreach_add_
    numbers += [(lr / (1 - beta1**step)) * -1 for step in steps]  # _foreach_addcdiv_
    return numbers


Model = Callable[[dict, list, bool], list]
MODELS: dict[type, list[Model]] = {
    torch.optim.Adam: [single_tensor_adam, multi_tensor_adam],
    torch.optim.AdamW: [single_tensor_adam, multi_tensor_adam],
    torch.optim.Adagrad: [single_tensor_adagrad, multi_tensor_adagrad],
    torch.optim.Adamax: [single_tensor_adamax, multi_tensor_adamax],
}
# what each optimizer's numbers are computed from (its other settings are compared by value)
SETTINGS: dict[type, tuple[str, ...]] = {
    torch.optim.Adam: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.AdamW: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.Adagrad: ("lr", "lr_decay", "eps", "weight_decay"),
    torch.optim.Adamax: ("lr", "betas", "eps", "weight_decay"),
}


def decoupled(group: dict, optimizer_class: type) -> bool:
    return bool(group.get("decoupled_weight_decay", optimizer_class is torch.optim.AdamW))


def numbers(model: Model, groups: list[dict], steps: list[list[float]], optimizer_class: type) -> list:
    """Every number of a step() over `groups`, each with the step counts of its parameters that
    have a gradient (after this step's increment)."""
    found: list = []
    for group, group_steps in zip(groups, steps):
        if group_steps:
            found += model(group, group_steps, decoupled(group, optimizer_class))
    return found


def same_numbers(a: list, b: list) -> bool:
    """Equal in type and value, bit for bit (the sign of a zero too)."""
    return len(a) == len(b) and all(
        type(x) is type(y) and (x.hex() == y.hex() if type(x) is float else x == y) for x, y in zip(a, b))
