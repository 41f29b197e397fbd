"""Hunt Q: training-loop idioms that gave silently wrong results.

- f01: without_host froze a host read (`.item()`, `float()`, `int()`) of a tensor no op of the call
  had used yet (a buffer, a global, a tensor `max_norm`): now HostDependencyError, and checked
  calls follow the value.
- f02: `opt.zero_grad()` inside the step did not clear the `.grad` of a parameter no op of the
  call used (the other head of a multi-task model) in API-level and host-free calls.
Every test compares with eager after every call (backend="aten": bit for bit)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit

SCALE = torch.tensor(0.5)  # a global tensor the caller fills between calls


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    model.register_buffer("mx", torch.tensor(0.5))
    model.register_buffer("it", torch.tensor(0))
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def data(count):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=generator), torch.randint(0, 4, (8,), generator=generator))
            for _ in range(count)]


def step_item(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y) * model.mx.item()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def step_global(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y) * float(SCALE)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def step_clip(x, y, *, model, opt):  # clip_grad_norm_ reads float(max_norm)
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), model.mx)
    opt.step()
    return loss.detach()


def step_counter(x, y, *, model, opt):  # a warm-up from a step count kept in a tensor, bumped in the step
    warm = min(1.0, (int(model.it) + 1) / 5)
    loss = F.cross_entropy(model(x), y) * warm
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.it.add_(1)
    return loss.detach()


READING = [step_item, step_global, step_clip, step_counter]


def changing(step, i, models):
    if step is not step_counter:
        for model in models:
            model.mx.fill_(0.1 + 0.1 * i)
        SCALE.fill_(0.1 + 0.1 * i)


@pytest.mark.parametrize("step", READING, ids=lambda f: f.__name__)
def test_a_host_read_of_a_tensor_the_call_finds_is_refused_without_the_host(step):
    (model_a, opt_a), (model_b, opt_b) = make(), make()
    traced = tracejit.trace(step, backend="aten", without_host=True)
    with pytest.raises(tracejit.HostDependencyError, match="no op of the call had used"):
        for i, (x, y) in enumerate(data(6)):
            changing(step, i, (model_a, model_b))
            want = step(x, y, model=model_a, opt=opt_a)
            assert torch.equal(traced(x, y, model=model_b, opt=opt_b), want), i
    assert traced.stats.host_free_calls == 0


@pytest.mark.parametrize("step", READING, ids=lambda f: f.__name__)
def test_a_host_read_of_a_tensor_the_call_finds_is_followed_in_checked_calls(step):
    (model_a, opt_a), (model_b, opt_b) = make(), make()
    traced = tracejit.trace(step, backend="aten")
    for i, (x, y) in enumerate(data(7)):
        changing(step, i, (model_a, model_b))
        want = step(x, y, model=model_a, opt=opt_a)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), want), i
        for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True):
            assert torch.equal(a, b), i
    assert traced.stats.checked_replays >= 4


def multi_task():
    torch.manual_seed(0)
    model = nn.ModuleDict({"body": nn.Linear(6, 16), "h1": nn.Linear(16, 4), "h2": nn.Linear(16, 4)})
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def multi_task_step(x, y, *, model, opt, task_b):  # each call trains one head
    h = torch.relu(model["body"](x))
    loss = F.cross_entropy(model["h2"](h) if task_b else model["h1"](h), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
@pytest.mark.parametrize("backend", ["aten", "c"])
def test_zero_grad_clears_the_gradient_of_a_head_the_call_does_not_use(backend, without_host):
    (model_a, opt_a), (model_b, opt_b) = multi_task(), multi_task()
    traced = tracejit.trace(multi_task_step, backend=backend, without_host=without_host)
    for i, (x, y) in enumerate(data(12)):
        task_b = i % 3 == 2
        want = multi_task_step(x, y, model=model_a, opt=opt_a, task_b=task_b)
        got = traced(x, y, model=model_b, opt=opt_b, task_b=task_b)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), i
        for (name, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None), (i, name)
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (i, name)
    # each task's trace and its gradient states: the last calls run at the API level or without the host
    served = traced.stats.host_free_calls if without_host else traced.stats.api_replays
    assert served >= (4 if without_host else 2), traced.stats


def test_a_gradient_the_call_sets_again_after_clearing_it_stays_set():
    # cleared by zero_grad, then given a tensor by the step's own Python: not cleared after the program
    def step(x, y, *, model, opt, task_b):
        loss = multi_task_step(x, y, model=model, opt=opt, task_b=task_b)
        unused = model["h1"] if task_b else model["h2"]
        unused.weight.grad = torch.zeros_like(unused.weight)
        return loss

    (model_a, opt_a), (model_b, opt_b) = multi_task(), multi_task()
    traced = tracejit.trace(step, backend="aten", without_host=True)
    for i, (x, y) in enumerate(data(8)):
        task_b = i % 2 == 1
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b, task_b=task_b),
                           step(x, y, model=model_a, opt=opt_a, task_b=task_b)), i
        for (name, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None), (i, name)


def zero_grad_first_step(x, y, *, model, opt):
    opt.zero_grad()  # before the forward, whose cross_entropy raises on a label out of range
    loss = F.cross_entropy(model["h1"](torch.relu(model["body"](x))), y)
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_a_program_that_raises_after_zero_grad_leaves_the_unused_head_cleared(without_host):
    # review 41 F3: the clear of a parameter no op used happens before the op that raises
    (model_a, opt_a), (model_b, opt_b) = multi_task(), multi_task()
    traced = tracejit.trace(zero_grad_first_step, backend="aten", without_host=without_host)
    batches = data(7)

    def head_b_has_a_gradient():
        for model in (model_a, model_b):
            model["h2"].weight.grad = torch.ones_like(model["h2"].weight)

    for i, (x, y) in enumerate(batches[:6]):
        head_b_has_a_gradient()
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), zero_grad_first_step(x, y, model=model_a, opt=opt_a)), i
    served = traced.stats.host_free_calls if without_host else traced.stats.api_replays
    assert served >= 2, traced.stats
    x, y = batches[6]
    bad = y.clone()
    bad[0] = 7
    head_b_has_a_gradient()
    with pytest.raises(IndexError):
        zero_grad_first_step(x, bad, model=model_a, opt=opt_a)
    with pytest.raises(IndexError):
        traced(x, bad, model=model_b, opt=opt_b)
    assert model_a["h2"].weight.grad is None
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None), name


def test_tensor_betas_of_an_optimizer_found_through_a_namespace_run_without_the_host():
    # review 41 F1: fused Adam reads its tensor betas on the host inside step(); they are bound where
    # they are however the function reaches the optimizer (here a SimpleNamespace tracejit does not walk)
    import types

    def make_holder():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(torch.tensor(0.9), torch.tensor(0.99)),
                               fused=True)
        return types.SimpleNamespace(inner=types.SimpleNamespace(model=model, opt=opt))

    def step(x, y, *, root):
        model, opt = root.inner.model, root.inner.opt
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    holder_a, holder_b = make_holder(), make_holder()
    traced = tracejit.trace(step, backend="aten", without_host=True)
    for i, (x, y) in enumerate(data(8)):
        if i == 5:
            for holder in (holder_a, holder_b):
                holder.inner.opt.param_groups[0]["betas"][0].fill_(0.8)
        assert torch.equal(traced(x, y, root=holder_b), step(x, y, root=holder_a)), i
    assert traced.stats.host_free_calls >= 4, traced.stats
