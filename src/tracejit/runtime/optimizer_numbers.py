"""The numbers torch.optim's Adam, AdamW, Adagrad, Adamax and NAdam pass to their ops when they
read `step` on the host.

Without `fused=True` or `capturable=True` (torch's default on the CPU), Adam reads each parameter's
step count with `.item()` and computes the bias corrections and the step size in Python, then
passes them to its ops as numbers (Adagrad its decayed learning rate, Adamax its bias-corrected
one; NAdam its momentum terms, from its `mu_product` state too). A stand-in for such a `step()`
(runtime/stand_ins.py) must pass the same numbers: these functions compute every number of one
param group's update, in the order its ops take them, with the formulas of torch.optim.adam
(`_single_tensor_adam`, `_multi_tensor_adam`) and their counterparts in torch.optim.adagrad,
torch.optim.adamax and torch.optim.nadam. A stand-in uses one only after it gave, bit for bit,
every number the record holds for the update it stands for; another torch version with other
formulas is then a real step, never other numbers.
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


def nadam_mu(group: dict, step: float) -> float:
    """NAdam's momentum coefficient at `step` (mu; at step + 1 it is mu_next)."""
    return group["betas"][0] * (1.0 - 0.5 * (0.96 ** (step * group["momentum_decay"])))


def single_tensor_nadam(group: dict, steps: list[tuple[float, float]], decoupled: bool) -> list:
    """`_single_tensor_nadam`, capturable=False: per parameter, in order; each step count with the
    parameter's `mu_product` after this step's update."""
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    numbers: list = []
    for step, mu_product in steps:
        numbers.append(1)  # step_t += 1
        if weight_decay != 0:
            numbers.append(1 - lr * weight_decay if decoupled else weight_decay)
        mu, mu_next = nadam_mu(group, step), nadam_mu(group, step + 1)
        numbers += [mu, 1 - beta1, beta2, 1 - beta2, 1 - beta2**step, eps]  # mu_product *= mu ... denom.add_
        mu_product_next = mu_product * mu_next
        numbers += [-lr * (1.0 - mu) / (1.0 - mu_product), (-lr * mu_next) / (1.0 - mu_product_next)]
    return numbers


def multi_tensor_nadam(group: dict, steps: list[tuple[float, float]], decoupled: bool) -> list:
    """`_multi_tensor_nadam`, capturable=False, the parameters of one device and dtype."""
    lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    numbers: list = [1.0]
    if weight_decay != 0:
        numbers.append(1 - lr * weight_decay if decoupled else weight_decay)
    numbers += [1 - beta1, beta2, 1 - beta2]  # _foreach_lerp_, _foreach_mul_, _foreach_addcmul_
    numbers += [nadam_mu(group, step) for step, _ in steps]  # _foreach_mul_(mu_products, mus)
    numbers += [(1 - beta2**step) ** 0.5 for step, _ in steps]  # _foreach_div_
    numbers.append(eps)
    numbers += [(lr * (1.0 - nadam_mu(group, step)) / (1.0 - product)) * -1 for step, product in steps]
    numbers += [(lr * nadam_mu(group, step + 1) / (1.0 - product * nadam_mu(group, step + 1))) * -1
                for step, product in steps]
    return numbers


def step_count(state: dict, group: dict, increment: float) -> float:
    """What step() reads of a parameter's state: its step count after `step_t += 1`."""
    return torch._C.TensorBase.item(state["step"]) + increment


def nadam_reads(state: dict, group: dict, increment: float) -> tuple[float, float]:
    """The step count, and `mu_product` after `mu_product *= mu` (computed by the same op on the
    state tensor's dtype, so that it rounds as step() would)."""
    step = step_count(state, group, increment)
    product = state["mu_product"]
    if increment:
        product = torch.mul(product, nadam_mu(group, step))
    return step, torch._C.TensorBase.item(product)


Model = Callable[[dict, list, bool], list]
MODELS: dict[type, list[Model]] = {
    torch.optim.Adam: [single_tensor_adam, multi_tensor_adam],
    torch.optim.AdamW: [single_tensor_adam, multi_tensor_adam],
    torch.optim.Adagrad: [single_tensor_adagrad, multi_tensor_adagrad],
    torch.optim.Adamax: [single_tensor_adamax, multi_tensor_adamax],
    torch.optim.NAdam: [single_tensor_nadam, multi_tensor_nadam],
}
# what a model takes of each parameter's state (the step count, unless named here)
READS: dict[type, Callable[[dict, dict, float], object]] = {torch.optim.NAdam: nadam_reads}
# what each optimizer's numbers are computed from (its other settings are compared by value)
SETTINGS: dict[type, tuple[str, ...]] = {
    torch.optim.Adam: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.AdamW: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.Adagrad: ("lr", "lr_decay", "eps", "weight_decay"),
    torch.optim.Adamax: ("lr", "betas", "eps", "weight_decay"),
    torch.optim.NAdam: ("lr", "betas", "eps", "weight_decay", "momentum_decay"),
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
