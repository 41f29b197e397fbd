"""Fused groups at run time, with the reference backend (every group runs op by op through aten):
grouping, placeholders in checked replay, on-demand reads, and training parity."""

import copy

import pytest
import torch
from models import assert_same_state, train_side_by_side
from side_by_side import mse, seeded, side_by_side, step_of

import tracejit
from tracejit.ir import Op


def fused_count(traced):
    entry = traced._entries()[0]
    graphs = [entry.program.graph] + ([entry.host_free.program.graph] if entry.host_free else [])
    return [sum(n.op is Op.FUSED for n in g.nodes) for g in graphs]


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
# (an MLP with a one-op update, _fused_adam_ or SGD's add_, has no elementwise chain to fuse)
@pytest.mark.parametrize("kind, opt_name", [("mlp", "sgd_momentum"), ("cnn", "sgd_momentum"),
                                            ("transformer", "adamw_fused")])
def test_training_with_fused_groups_matches_eager(kind, opt_name, without_host):
    (model_a, opt_a), (model_b, opt_b), _ = train_side_by_side(kind, opt_name, backend="reference", fused=True,
                                                               without_host=without_host)
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)


def chain(x, y):
    return ((x * y + 1).sigmoid() * x - y).tanh() * 0.5 + x


@pytest.mark.parametrize("without_host", [False, True])
def test_elementwise_chain_becomes_one_group(without_host):
    traced = tracejit.trace(chain, backend="reference", without_host=without_host)
    for _ in range(3):
        x, y = torch.randn(1000), torch.randn(1000)
        assert torch.equal(traced(x, y), chain(x, y))
    assert fused_count(traced)[-1] == 1
    graph = traced._entries()[0].program.graph
    (fused,) = [n for n in graph.nodes if n.op is Op.FUSED]
    assert len(fused.members) == 8


def test_unrecorded_host_read_of_a_placeholder_is_computed_on_demand():
    seen = []
    show = {"on": False}

    @tracejit.trace(backend="reference")
    def f(x):
        a = x.exp()
        b = a.sin()
        if show["on"]:
            seen.append(a.tolist())  # reads a, which the group keeps internal, mid-group
        return b.cos()

    x = torch.randn(5)
    f(x), f(x)
    show["on"] = True
    out = f(x)
    assert torch.equal(out, x.exp().sin().cos())
    assert seen == [x.exp().tolist()]


def test_intermediate_kept_by_python_is_filled():
    kept = []

    @tracejit.trace(backend="reference")
    def f(x):
        a = x.exp()
        b = a.sin()
        if len(kept) == 2:
            kept.append(a)  # a new reference the record never saw escape
        return b.cos()

    for _ in range(3):
        x = torch.randn(5)
        f(x)
        if len(kept) < 2:
            kept.append(None)
    assert torch.equal(kept[2], x.exp())


def test_excluded_block_sees_real_values():
    seen = []

    @tracejit.trace(backend="reference")
    def f(x):
        a = x.exp()
        with tracejit.exclude_from_trace():
            seen.append(a.sum().item())
        return a.sin().cos()

    for i in range(3):
        x = torch.full((4,), float(i))
        assert torch.equal(f(x), x.exp().sin().cos())
        assert seen[-1] == pytest.approx(4 * torch.exp(torch.tensor(float(i))).item())


def test_exception_in_a_fused_replay_leaves_kept_values_real():
    kept = []
    fail = {"on": False}

    def f(x):
        b = x * 2 + 1  # one fused group with the multiplication below
        kept.append(b)
        if fail["on"]:
            raise ValueError("boom")
        return (b * 3).relu()

    traced = tracejit.trace(f, backend="reference")
    x = torch.randn(4)
    traced(x)
    traced(x)
    fail["on"] = True
    with pytest.raises(ValueError):
        traced(x)
    assert torch.equal(kept[-1], x * 2 + 1)


def test_exception_after_a_deferred_in_place_member_applies_it():
    fail = {"on": False}

    def f(x, *, w):
        w.add_(x)  # handed out, computed when the group's last member arrives
        if fail["on"]:
            raise ValueError("boom")
        return (w * 2).relu()

    traced = tracejit.trace(f, backend="reference")
    w = torch.zeros(4)
    traced(torch.ones(4), w=w), traced(torch.ones(4), w=w)
    fail["on"] = True
    with pytest.raises(ValueError):
        traced(torch.ones(4), w=w)
    assert torch.equal(w, torch.full((4,), 3.0))  # as after an eager call that raised there


def manual_sgd_step(x, *, model, path):
    loss = model(x).sum()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.99).add_(p.grad, alpha=-0.1)  # one fused group per parameter, writing it in place
            if path == 2:  # an int, not a bool: a bool keyword would select a trace of its own
                p.sub_(x.sum())  # another path: TraceMismatchError while the group pends
            else:
                p.add_(1.0)
            p.grad = None
    return loss


@pytest.mark.parametrize("backend", ["reference", "c"])
def test_a_mismatch_while_a_group_writing_a_parameter_under_no_grad_pends_leaves_eager_state(backend):
    # The pending members ran after the exception had left the user's no_grad block: in-place
    # writes into a leaf that requires grad then raised RuntimeError over the TraceMismatchError
    # and left the parameter without the writes eager made before the divergence.
    model = torch.nn.Linear(4, 2)
    eager = copy.deepcopy(model)
    traced = tracejit.trace(manual_sgd_step, backend=backend)
    xs = [torch.randn(3, 4) for _ in range(6)]
    for x in xs[:4]:
        torch.testing.assert_close(traced(x, model=model, path=1), manual_sgd_step(x, model=eager, path=1),
                                   rtol=1e-5, atol=1e-5)
    assert traced.stats.checked_replays == 3 and fused_count(traced)[0] > 0
    with pytest.raises(tracejit.TraceMismatchError):
        traced(xs[4], model=model, path=2)
    eager(xs[4]).sum().backward()  # an eager call that raised at the divergence: the first parameter updated
    with torch.no_grad():
        eager.weight.mul_(0.99).add_(eager.weight.grad, alpha=-0.1)
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(model, name), getattr(eager, name), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(getattr(model, name).grad, getattr(eager, name).grad)
    torch.testing.assert_close(traced(xs[5], model=model, path=1),
                               manual_sgd_step(xs[5], model=eager, path=1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.weight, eager.weight, rtol=1e-5, atol=1e-5)


def test_asgd_switching_its_averaging_branch_records_again_from_the_pending_fused_update():
    # ASGD(t0=2) reads its step on the host and switches to averaging at step t0, inside
    # torch.no_grad() while its fused update of a parameter pends: the call records again from
    # there (torch's own branch, replay.branching_step), from the state the fused kernels left
    def step(x, y, *, model, opt):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        return model, torch.optim.ASGD(model.parameters(), lr=1e-2, t0=2)

    for backend in ("c", "aten"):
        (model, opt), (eager, eager_opt) = make(), make()
        traced = tracejit.trace(step, backend=backend)
        torch.manual_seed(1)
        for i in range(8):
            x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
            loss = traced(x, y, model=model, opt=opt)
            expected = step(x, y, model=eager, opt=eager_opt)
            close = torch.equal if backend == "aten" else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
            assert close(loss, expected), (backend, i)
            for a, b in zip(model.parameters(), eager.parameters()):
                assert close(a, b), (backend, i)
            for a, b in zip(opt.state.values(), eager_opt.state.values()):
                assert close(a["ax"], b["ax"]), (backend, i)
        assert traced.stats.rerecords == 2 and traced.stats.checked_replays == 5, traced.stats
        if backend == "c":
            assert fused_count(traced)[0] > 0


def test_a_kernel_that_raises_in_checked_replay_reports_its_own_error():
    # the member whose call fires the kernel has no placeholder: settling the group after the
    # failure once raised AttributeError ('NoneType' has no copy_) over the kernel's error
    def f(x, y):
        return (x.abs() * 2 + y).relu(), y * 3

    traced = tracejit.trace(f, backend="reference")
    x, y = torch.randn(50), torch.randn(50)
    traced(x, y)
    groups = {g for g in traced._entries()[0].program.group_at if g is not None}
    assert groups

    def failing_kernel(*args):
        raise RuntimeError("the kernel failed")
    for group in groups:
        group.kernel = failing_kernel
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the kernel failed"):
            traced(x, y)


def test_a_fused_group_is_one_profile_row_in_checked_replay():
    traced = tracejit.trace(chain, backend="reference", profiling=True)
    x, y = torch.randn(64), torch.randn(64)
    for _ in range(4):
        traced(x, y)
    (row,) = traced.get_profile()["rows"]
    assert row["node"].startswith("fused") and row["calls"] == 3 and len(row["ops"]) == 8


class ScaledTanh(torch.nn.Module):
    """A parameter used elementwise: its gradient is the output of a fused backward group."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.ones(3, 4))

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale


def recurrent_model(cell):
    torch.manual_seed(0)
    return cell(4, 8, batch_first=True)


def momentum_ready(model, loss, shape):
    """SGD whose momentum buffers exist before the first traced call: no lazy state, no re-record."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step_of(loss)(torch.randn(*shape), model=model, opt=opt)
    return opt


def recurrent_mse(model, x):
    return model(x)[0].square().mean()


@pytest.mark.parametrize("make, loss, shape, make_opt", [
    (lambda: recurrent_model(torch.nn.GRU), recurrent_mse, (3, 5, 4), None),
    (lambda: recurrent_model(torch.nn.RNN), recurrent_mse, (3, 5, 4), None),
    (lambda: recurrent_model(torch.nn.GRU), recurrent_mse, (3, 5, 4), momentum_ready),
    (ScaledTanh, mse, (3, 4), momentum_ready),
], ids=["gru", "rnn", "gru-momentum", "scaled-momentum"])
def test_a_gradient_computed_by_a_fused_group_is_stolen_by_autograd_as_in_eager(make, loss, shape, make_opt):
    # The call state used to keep the group's outputs: a second reference to a gradient, so
    # AccumulateGrad copied it (aten.new_empty_strided) where the recorded call stole it
    # (aten.detach), a spurious mismatch at call 2 inside loss.backward().
    model = make()
    opt = make_opt(model, loss, shape) if make_opt else torch.optim.SGD(model.parameters(), lr=0.1)
    step = step_of(loss)
    traced = tracejit.trace(step, backend="reference")
    side_by_side(traced, step, {"model": model, "opt": opt}, seeded(*shape), steps=4, fused=True)
    assert traced.stats.checked_replays >= 2 and traced.stats.records == 1
    assert fused_count(traced)[0] >= 1


def _scaled_in_place_step(x, y, *, model, opt):
    h = model[0](x) + 0
    h.mul_(3)  # in place into memory the group made; `h` stays alive while the call runs
    loss = torch.nn.functional.mse_loss(model[1](torch.tanh(h)), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("without_host", [False, True])
def test_a_live_value_written_in_place_inside_a_group_is_recomputed_for_a_rerecord(without_host):
    """The second call re-records (the optimizer creates its momentum buffers) while `h`, written
    in place inside the fused group [add, mul_, tanh], is alive in the function: the group did not
    store it and refused to recompute it because a member writes, so the call raised a spurious
    TraceMismatchError ("kept a reference to t6"). A write into memory the group made itself
    is recomputed from the group's inputs now."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    twin, twin_opt = copy.deepcopy((model, opt))
    traced = tracejit.trace(_scaled_in_place_step, backend="c", without_host=without_host)
    for i in range(6):
        x, y = torch.randn(8, 6), torch.randn(8, 3)
        torch.testing.assert_close(traced(x, y, model=model, opt=opt), _scaled_in_place_step(x, y, model=twin, opt=twin_opt),
                                   rtol=1e-5, atol=1e-6)
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert traced.stats.rerecords == 1
    assert traced.stats.host_free_calls if without_host else traced.stats.checked_replays
