"""Eager against traced, call by call: outputs and every piece of state compared bitwise."""

import copy

import torch
import torch.nn as nn


def same_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    return a == b


def state_of(obj) -> list:
    if isinstance(obj, nn.Module):
        return ([t.detach() for t in obj.state_dict().values()]
                + [p.grad for p in obj.parameters()] + [p.requires_grad for p in obj.parameters()])
    if isinstance(obj, torch.optim.Optimizer):
        return [v for s in obj.state_dict()["state"].values() for v in s.values()]
    return [obj]


def side_by_side(traced_fn, fn, objects: dict, inputs, steps: int, between=None):
    """Run fn eagerly on `objects` and traced on a deep copy; compare outputs and state after every call."""
    twins = copy.deepcopy(objects)  # one deepcopy: optimizers keep pointing at the copied parameters
    for i in range(steps):
        if between is not None:
            between(i, objects)
            between(i, twins)
        args = inputs(i)
        torch.manual_seed(100 + i)
        want = fn(*[a.clone() for a in args], **objects)
        torch.manual_seed(100 + i)
        got = traced_fn(*[a.clone() for a in args], **twins)
        assert same_tree(got, want), f"call {i}: {got} vs {want}"
        for name, obj in objects.items():
            assert same_tree(state_of(twins[name]), state_of(obj)), f"call {i}: {name} differs"
    return twins


def step_of(loss_fn):
    def step(*args, model, opt, **kwargs):
        loss = loss_fn(model, *args, **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def mse(model, x):
    return model(x).square().mean()


def seeded(*shape, kind=torch.randn):
    return lambda i: (kind(*shape, generator=torch.Generator().manual_seed(i)),)
