"""Gradient and module hooks with without_host=True: on inputs, registered inside the step, and
leaves made inside the step (WGAN-GP's gradient penalty)."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit
from tracejit.errors import HostDependencyError


def _model_and_opt():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)


def _step(x, y, *, model, opt):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _double(g):
    return g * 2


def _triple_grad(t):
    t.grad.mul_(3)


@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
@pytest.mark.parametrize("pattern", ["HHHNNNN", "NNNHHHH", "HNHNHNH"])
def test_gradient_hooks_on_inputs_are_honoured(hook, pattern):
    """A gradient hook on an input that requires grad runs in eager's backward: a call of an
    input with another hook state than the bound call's cannot run the program."""
    eager_model, eager_opt = _model_and_opt()
    model, opt = _model_and_opt()
    traced = tracejit.trace(_step, without_host=True)
    fn = _double if hook == "register_hook" else _triple_grad
    for i, c in enumerate(pattern):
        x0, y = _batch(i)
        xe, xt = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        if c == "H":
            getattr(xe, hook)(fn)
            getattr(xt, hook)(fn)
        host_free = traced.stats.host_free_calls
        expected = _step(xe, y, model=eager_model, opt=eager_opt)
        got = traced(xt, y, model=model, opt=opt)
        assert torch.equal(expected, got)
        assert torch.equal(xe.grad, xt.grad), (i, c)
        assert _same_params(eager_model, model)
        if c == "H":  # a Python hook cannot run without the function
            assert traced.stats.host_free_calls == host_free
    # inputs without hooks: the fast path runs once bound
    if pattern == "HHHNNNN":
        assert traced.stats.host_free_calls >= 2
    if pattern == "NNNHHHH":
        assert traced.stats.host_free_calls == 1 and traced.stats.host_free_misses >= 1


def _leak_grad(x, y, *, model, opt):
    model[0].weight.register_hook(lambda g: g * 0.5)
    return _step(x, y, model=model, opt=opt)


def _leak_post(x, y, *, model, opt):
    def halve(p):
        p.grad.mul_(0.5)
    model[0].weight.register_post_accumulate_grad_hook(halve)
    return _step(x, y, model=model, opt=opt)


def _leak_backward(x, y, *, model, opt):
    model[1].register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    return _step(x, y, model=model, opt=opt)


def _leak_forward(x, y, *, model, opt):
    model[1].register_forward_hook(lambda m, i, o: o * 0.5)
    return _step(x, y, model=model, opt=opt)


def _leak_step_hook(x, y, *, model, opt):
    opt.register_step_post_hook(lambda o, a, k: None)
    return _step(x, y, model=model, opt=opt)


@pytest.mark.parametrize("step, what", [
    (_leak_grad, "a backward hook registered on parameter 0.weight of Sequential"),
    (_leak_post, "a post-accumulate-grad hook registered on parameter 0.weight of Sequential"),
    (_leak_backward, "a backward hook registered on Tanh 1"),
    (_leak_forward, "a forward hook registered on Tanh 1"),
    (_leak_step_hook, "a step post hook registered on SGD"),
])
def test_a_hook_registered_inside_the_step_and_kept_is_refused(step, what):
    """Each eager call adds one more hook; a call without the function would add none, and the
    hook guards, which compare with the hooks after the bound call, would pass."""
    eager_model, eager_opt = _model_and_opt()
    model, opt = _model_and_opt()
    traced = tracejit.trace(step, without_host=True)
    with pytest.raises(HostDependencyError) as info:
        for i in range(6):
            x, y = _batch(i)
            expected = step(x, y, model=eager_model, opt=eager_opt)
            got = traced(x, y, model=model, opt=opt)
            assert torch.equal(expected, got) and _same_params(eager_model, model), i
    assert what in str(info.value) and "not removed" in str(info.value)
    assert traced.stats.host_free_calls == 0


def _removed_hooks(x, y, *, model, opt):
    handles = [model[0].weight.register_hook(lambda g: g * 0.5),
               model[1].register_forward_hook(lambda m, i, o: o * 0.5)]
    loss = _step(x, y, model=model, opt=opt)
    for handle in handles:
        handle.remove()
    return loss


def test_hooks_removed_inside_the_step_run_without_the_host():
    eager_model, eager_opt = _model_and_opt()
    model, opt = _model_and_opt()
    traced = tracejit.trace(_removed_hooks, without_host=True)
    for i in range(6):
        x, y = _batch(i)
        expected = _removed_hooks(x, y, model=eager_model, opt=eager_opt)
        got = traced(x, y, model=model, opt=opt)
        assert torch.equal(expected, got) and _same_params(eager_model, model), i
    assert traced.stats.host_free_calls >= 4 and traced.stats.host_free_misses == 0


def _critic_and_opt():
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return critic, torch.optim.SGD(critic.parameters(), lr=0.05, momentum=0.9)


def _gan_batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g), torch.rand(5, 1, generator=g)


def _wgan_gp(real, fake, a, *, model, opt):
    xi = (a * real + (1 - a) * fake).requires_grad_(True)  # a leaf made inside the step
    g, = torch.autograd.grad(model(xi).sum(), xi, create_graph=True)
    gp = ((g.norm(2, dim=1) - 1) ** 2).mean()
    loss = model(fake).mean() - model(real).mean() + 10 * gp
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach(), gp.detach()


def _detached_input(real, fake, a, *, model, opt):
    xx = real.detach().requires_grad_()  # a leaf view of the input
    loss = F.mse_loss(model(xx * a), fake[:, :1])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("step", [_wgan_gp, _detached_input])
def test_a_leaf_made_inside_the_step_runs_without_the_host(step):
    """The leaf's AccumulateGrad node, which the call's backward frees, owns the leaf: tracejit
    noting the node must not keep it alive, or the leaf looks kept beyond the call and every call
    runs the function."""
    eager_model, eager_opt = _critic_and_opt()
    model, opt = _critic_and_opt()
    traced = tracejit.trace(step, without_host=True)
    for i in range(7):
        args = _gan_batch(i)
        expected = step(*(t.clone() for t in args), model=eager_model, opt=eager_opt)
        got = traced(*(t.clone() for t in args), model=model, opt=opt)
        expected, got = (o if isinstance(o, tuple) else (o,) for o in (expected, got))
        assert all(torch.equal(e, t) for e, t in zip(expected, got, strict=True)), i
        assert _same_params(eager_model, model), i
    assert traced.stats.host_free_calls >= 4 and traced.stats.host_free_misses == 0


def _head_step(h, y, *, model):
    loss = F.mse_loss(model(h), y)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1 * p.grad)
            p.grad = None
    return loss.detach()


def test_binding_reads_no_grad_of_a_non_leaf_input():
    """An input that requires grad but is no leaf (an encoder's output): binding must not read its
    `.grad`, which makes torch warn that a non-leaf's .grad is being accessed."""
    torch.manual_seed(0)
    enc_e, head_e = nn.Linear(3, 4), nn.Linear(4, 2)
    torch.manual_seed(0)
    enc_t, head_t = nn.Linear(3, 4), nn.Linear(4, 2)
    traced = tracejit.trace(_head_step, without_host=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(5):
            x, y = _batch(i)
            x = x[:, :3].contiguous()
            expected = _head_step(enc_e(x), y, model=head_e)
            got = traced(enc_t(x), y, model=head_t)
            assert torch.equal(expected, got) and _same_params(head_e, head_t), i
            assert all(torch.equal(a.grad, b.grad) for a, b in zip(enc_e.parameters(), enc_t.parameters())), i
    assert not [w for w in caught if "not a leaf" in str(w.message)]
