"""The numbers torch.optim's Adam and AdamW pass to their ops when they read `step` on the host.

Without `fused=True` or `capturable=True` (torch's default on the CPU), Adam reads each parameter's
step count with `.item()` and computes the bias corrections and the step size in Python, then
passes them to its ops as numbers. A stand-in for such a `step()` (runtime/stand_ins.py) must pass
the same numbers: these functions compute every number of one param group's update, in the order
its ops take them, with the formulas of torch.optim.adam (`_single_tensor_adam`,
`_multi_tensor_adam`). A stand-in uses one only after it gave, bit for bit, every number the
record holds for the update it stands for; another torch version with other formulas is then a
real step, never other numbers.
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


Model = Callable[[dict, list, bool], list]
MODELS: dict[type, list[Model]] = {
    torch.optim.Adam: [single_tensor_adam, multi_tensor_adam],
    torch.optim.AdamW: [single_tensor_adam, multi_tensor_adam],
}
SETTINGS = ("lr", "betas", "eps", "weight_decay")  # what the numbers are computed from


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
