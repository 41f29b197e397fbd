"""without_host=True findings (hunt of 2026-12): each case runs eager and traced side by side from
the same state (backend aten) and compares outputs, parameters, gradients and optimizer state
exactly on every call, and that the host-free fast path ran.

What failed before:

- A fresh optimizer (or `opt.state.clear()`) after a warm-up step: the first call after it created
  the optimizer state again, replayed the record that had created it without a difference, and
  bound that program; the calls after it ran, without the host, the program that *creates* the
  state on every step: SGD's momentum buffer was made anew from the gradient every step (momentum
  restarted), fused Adam's `step` stayed at 1. Nothing checked that the state the program creates
  was still missing (runtime/hostfree.py `_created_state_guard` now does).
- A returned view of a parameter (`model[2].bias[1:]`), or one kept in a module attribute: the
  host-free program runs without gradients, so the view was made in no_grad mode, and reading it
  after the next step updated the parameter in place raised torch's "A view was created in no_grad
  mode and its base ... modified inplace". Eager's view requires grad, has autograd history and
  follows the parameter (`_grad_mode_views` makes such views again with gradients on).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from models import train_step
from torch import nn

import tracejit

CALLS = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)


def assert_same_state(eager: nn.Module, traced: nn.Module, opt_e, opt_t, where: str) -> None:
    for (name, a), b in zip(eager.named_parameters(), traced.parameters(), strict=True):
        assert torch.equal(a, b), f"{where}: {name}"
        assert (a.grad is None) == (b.grad is None), f"{where}: {name}.grad"
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), f"{where}: {name}.grad"
    for (name, a), b in zip(eager.named_parameters(), traced.parameters(), strict=True):
        state_e, state_t = opt_e.state.get(a, {}), opt_t.state.get(b, {})
        assert state_e.keys() == state_t.keys(), f"{where}: optimizer state keys of {name}"
        for key, value in state_e.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, state_t[key]), f"{where}: optimizer state {name}.{key}"
            else:
                assert value == state_t[key], f"{where}: optimizer state {name}.{key}"


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def fused_adam(params):
    return torch.optim.Adam(params, lr=0.01, fused=True)


def run_with_resets(make_optimizer, reset, resets=(1, 5)):
    eager = make_model()
    twin = copy.deepcopy(eager)
    opt_e, opt_t = make_optimizer(eager.parameters()), make_optimizer(twin.parameters())
    traced = tracejit.trace(train_step, without_host=True, backend="aten")
    for i in range(CALLS):
        if i in resets:
            opt_e, opt_t = reset(opt_e, opt_t)
        x, y = batch(i)
        loss_e = train_step(x, y, model=eager, opt=opt_e)
        loss_t = traced(x, y, model=twin, opt=opt_t)
        assert torch.equal(loss_e, loss_t), f"call {i}: loss"
        assert_same_state(eager, twin, opt_e, opt_t, f"call {i}")
    return traced


def new_optimizers(make_optimizer):
    def reset(opt_e, opt_t):  # a warm-up step, then a fresh optimizer on both sides
        return (make_optimizer([p for group in opt_e.param_groups for p in group["params"]]),
                make_optimizer([p for group in opt_t.param_groups for p in group["params"]]))
    return reset


def cleared_state(opt_e, opt_t):
    opt_e.state.clear()
    opt_t.state.clear()
    return opt_e, opt_t


def test_fresh_sgd_after_warm_up_step_keeps_its_momentum():
    traced = run_with_resets(sgd, new_optimizers(sgd))
    # calls 3, 4 and 7 run without the host (each reset costs two calls that run the function)
    assert traced.stats.host_free_calls >= 3


def test_cleared_sgd_state_keeps_its_momentum():
    traced = run_with_resets(sgd, cleared_state)
    assert traced.stats.host_free_calls >= 3


def test_fresh_fused_adam_after_warm_up_step_counts_its_steps():
    traced = run_with_resets(fused_adam, new_optimizers(fused_adam))
    assert traced.stats.host_free_calls >= 3


def test_cleared_fused_adam_state_counts_its_steps():
    traced = run_with_resets(fused_adam, cleared_state)
    assert traced.stats.host_free_calls >= 3


def step_returning_view(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss, model[2].bias[1:]


def step_keeping_view(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.tail = model[0].weight.t()[1:]
    return loss


def compare_kept_views(step, view_of) -> tracejit.trace:
    eager = make_model()
    twin = copy.deepcopy(eager)
    opt_e, opt_t = sgd(eager.parameters()), sgd(twin.parameters())
    traced = tracejit.trace(step, without_host=True, backend="aten")
    kept_e, kept_t = [], []
    for i in range(CALLS):
        x, y = batch(i)
        out_e = step(x, y, model=eager, opt=opt_e)
        out_t = traced(x, y, model=twin, opt=opt_t)
        kept_e.append(view_of(out_e, eager))
        kept_t.append(view_of(out_t, twin))
        assert torch.equal(out_e[0] if isinstance(out_e, tuple) else out_e,
                           out_t[0] if isinstance(out_t, tuple) else out_t), f"call {i}: loss"
        assert_same_state(eager, twin, opt_e, opt_t, f"call {i}")
        # every view kept so far follows its parameter, as eager's does (this raised before)
        for j, (a, b) in enumerate(zip(kept_e, kept_t, strict=True)):
            assert torch.equal(a * 1, b * 1), f"after call {i}: the view of call {j}"
            assert b.requires_grad and b.grad_fn is not None, f"after call {i}: the view of call {j} has no history"
            assert any(b._base is p for p in twin.parameters()), f"after call {i}: the view of call {j}"
    return traced


def test_returned_view_of_parameter_stays_readable_after_later_steps():
    traced = compare_kept_views(step_returning_view, lambda out, model: out[1])
    assert traced.stats.host_free_calls == CALLS - 2


def test_view_of_parameter_kept_in_module_attribute_stays_readable():
    traced = compare_kept_views(step_keeping_view, lambda out, model: model.tail)
    assert traced.stats.host_free_calls == CALLS - 2


def test_returned_view_of_parameter_carries_gradients_to_it():
    # the view's autograd history reaches the parameter, as eager's does
    eager = make_model()
    twin = copy.deepcopy(eager)
    opt_e, opt_t = sgd(eager.parameters()), sgd(twin.parameters())
    traced = tracejit.trace(step_returning_view, without_host=True, backend="aten")
    for i in range(CALLS):
        x, y = batch(i)
        _, view_e = step_returning_view(x, y, model=eager, opt=opt_e)
        _, view_t = traced(x, y, model=twin, opt=opt_t)
        (view_e * 2).sum().backward()
        (view_t * 2).sum().backward()
        assert_same_state(eager, twin, opt_e, opt_t, f"call {i}")
        for module in (eager, twin):
            module.zero_grad()
    assert traced.stats.host_free_calls == CALLS - 2


LONG_HISTORY: list = list(range(100))  # past the size tracejit follows list contents to


def test_a_host_read_appended_to_a_long_global_list_is_refused_without_the_host():
    """Hunt R F3: the call changes a list too long to follow, so the next call runs the function;
    that path returned before the program's own refusals, so the `loss.item()` read was never
    refused and every call ran silently at the aten level (7.5x eager)."""
    def logging_step(x, y, *, model, opt):
        loss = train_step(x, y, model=model, opt=opt)
        LONG_HISTORY.append(loss.item())
        return loss

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    traced = tracejit.trace(logging_step, without_host=True, backend="aten")
    with pytest.raises(tracejit.HostDependencyError, match=r"reads tensor values on the host"):
        for i in range(4):
            traced(*batch(i), model=model, opt=opt)


def test_a_history_appended_to_on_every_call_says_every_call_runs_the_function():
    """Hunt R F3's other half: `history.append(loss.detach())` changes a list on every call, so
    every call runs the function, as eager does (correct), and was silently 8x slower than eager.
    A HostFreeMissWarning now says so after three calls in a row, once."""
    history = []

    def step(x, y, *, model, opt):
        loss = train_step(x, y, model=model, opt=opt)
        history.append(loss.detach())
        return loss

    model = make_model()
    eager_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    traced = tracejit.trace(step, without_host=True, backend="aten")
    with pytest.warns(tracejit.HostFreeMissWarning, match=r"3 calls in a row .*history has other items") as caught:
        for i in range(CALLS):
            want = train_step(*batch(i), model=eager_model, opt=eager_opt)
            assert torch.equal(traced(*batch(i), model=model, opt=opt), want)
            assert torch.equal(history[-1], want) and len(history) == i + 1
    assert sum(issubclass(w.category, tracejit.HostFreeMissWarning) for w in caught) == 1
    assert traced.stats.host_free_calls == 0 and traced.stats.checked_replays == CALLS - 1
    for a, b in zip(model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)
