"""`opt.zero_grad(set_to_none=False)` answered whole at the API level (hunt N, C6): its
`grad.requires_grad_(False)` on gradients that do not require grad is a no-op the stand-in checks."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit


def _step(x, y, *, model, opt, create_graph):
    loss = F.cross_entropy(model(x), y)
    loss.backward(create_graph=create_graph)
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss.detach()


@pytest.mark.parametrize("create_graph", [False, True], ids=["plain", "create_graph"])
def test_zero_grad_keeping_the_gradients_is_stood_in_and_follows_eager(create_graph):
    torch.manual_seed(0)
    model_a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = (torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model_a, model_b))
    traced = tracejit.trace(_step, backend="aten")
    for i in range(7):
        x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
        want = _step(x, y, model=model_a, opt=opt_a, create_graph=create_graph)
        got = traced(x, y, model=model_b, opt=opt_b, create_graph=create_graph)
        assert torch.equal(want, got), i
        for p, q in zip(model_a.parameters(), model_b.parameters()):
            assert torch.equal(p, q) and torch.equal(p.grad, q.grad), i
            assert p.grad.requires_grad == q.grad.requires_grad, i
    if not create_graph:  # step() and zero_grad() both answered whole on the API-level calls
        assert traced.stats.api_replays >= 3 and traced.stats.optimizer_stand_ins >= 2 * traced.stats.api_replays
