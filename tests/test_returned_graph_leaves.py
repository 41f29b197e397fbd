"""A leaf made inside the call (a gradient penalty's `xi.requires_grad_()`, FGSM's perturbed
input) that only the autograd graph of the returned loss holds: without the host the step still
runs host-free, computing what eager does."""

import copy

import pytest
import torch
import torch.nn as nn

import tracejit


def gradient_penalty_step(real, fake, eps, *, critic, opt):
    xi = (eps * real + (1 - eps) * fake).requires_grad_(True)
    grad, = torch.autograd.grad(critic(xi).sum(), xi, create_graph=True)
    penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
    loss = critic(fake).mean() - critic(real).mean() + 10 * penalty
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def fgsm_step(real, fake, eps, *, critic, opt):
    x = real.clone().requires_grad_()
    critic(x).sum().backward()
    adversarial = (real + 0.1 * eps * x.grad.sign()).detach()
    opt.zero_grad()
    loss = (critic(adversarial) - critic(fake)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("backend", ["aten", "c"])
@pytest.mark.parametrize("step", [gradient_penalty_step, fgsm_step], ids=lambda f: f.__name__)
def test_a_returned_loss_holding_a_leaf_made_in_the_call_runs_host_free(backend, step):
    torch.manual_seed(0)
    critic_a = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    critic_b = copy.deepcopy(critic_a)
    opt_a = torch.optim.SGD(critic_a.parameters(), lr=0.01, momentum=0.9)
    opt_b = torch.optim.SGD(critic_b.parameters(), lr=0.01, momentum=0.9)
    traced = tracejit.trace(step, without_host=True, backend=backend)
    same = torch.equal if backend == "aten" else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    for i in range(7):
        generator = torch.Generator().manual_seed(i)
        real, fake, eps = torch.randn(6, 4, generator=generator), torch.randn(6, 4, generator=generator), \
            torch.rand(6, 1, generator=generator)
        want = step(real, fake, eps, critic=critic_a, opt=opt_a)
        got = traced(real, fake, eps, critic=critic_b, opt=opt_b)
        assert same(got, want.detach()), (i, got, want)
        for a, b in zip(critic_a.parameters(), critic_b.parameters(), strict=True):
            assert same(a, b), i
        for a, b in zip(opt_a.state.values(), opt_b.state.values(), strict=True):
            assert same(a["momentum_buffer"], b["momentum_buffer"]), i
    assert traced.stats.host_free_calls >= 4 and traced.stats.host_free_misses == 0, traced.stats
