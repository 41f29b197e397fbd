"""Which `.grad` exist when a call begins, for leaves that are not parameters of keyword modules
(hunt H, F2 and F4). Each case runs an eager twin and the traced function side by side from the
same state, compares gradients and parameters on every call (bitwise with backend="aten", to
1e-5 with "c"), in checked mode and without_host, and checks that the traced calls ran.

What failed before:

- Gradient accumulation where the leaf whose `.grad` is cleared between calls is not a parameter
  of a keyword module: a model the step reaches through a closure or a global
  (`model.zero_grad()` every 3 calls), or an input that requires grad (`delta.grad = None` every 3
  calls). autograd's AccumulateGrad stores a first gradient (a detach) but adds into one that is
  there (`add_`), and only the `.grad` of keyword modules' parameters selected a trace: every call
  starting with `.grad` None raised TraceMismatchError "a different op ran (aten.detach.default
  instead of aten.add_.Tensor)", and went on raising. Now the parameters a trace reaches without a
  keyword select it by requires_grad and `.grad` as the call begins
  (signature.reached_gradient_state, TraceEntry.reached_bits, also for traces of symbolic sizes),
  and so do the inputs that require grad (signature.tensor_key).
- without_host, a step doing `loss.backward(retain_graph=True)` and `return loss` warned that "no
  backward pass inside the call used their autograd graph": its backward did, and kept it. The
  GradientWarning now says the call's backward retained the graph and host-free calls return it
  without one.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracejit
from tracejit.errors import GradientWarning, TraceMismatchError

CALLS = 7
MODES = [("aten", False), ("aten", True), ("c", False), ("c", True)]


def _mode_id(mode: tuple) -> str:
    backend, without_host = mode
    return f"{backend}-{'without_host' if without_host else 'checked'}"


@pytest.fixture(params=MODES, ids=_mode_id)
def mode(request):
    backend, _ = request.param
    if backend == "c" and tracejit.backends.resolve_backend("c") is None:
        pytest.skip("no C compiler")
    return request.param


def assert_same(eager: torch.Tensor | None, traced: torch.Tensor | None, backend: str, what: str) -> None:
    assert (eager is None) == (traced is None), f"{what}: .grad None in one run only"
    if eager is None:
        return
    if backend == "aten":
        assert torch.equal(eager, traced), what
    else:
        torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-6, msg=what)


def assert_same_model(eager: nn.Module, traced: nn.Module, backend: str, where: str) -> None:
    for (name, a), b in zip(eager.named_parameters(), traced.parameters(), strict=True):
        assert_same(a, b, backend, f"{where}: {name}")
        assert_same(a.grad, b.grad, backend, f"{where}: {name}.grad")


def assert_jit_ran(traced, without_host: bool) -> None:
    stats = traced.stats
    if without_host:
        assert stats.host_free_calls > 0, stats
    else:
        assert stats.checked_replays > 0 and stats.api_replays > 0, stats


def batch(i: int, rows: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def closure_step(model: nn.Module):
    def step(x, y):
        loss = F.cross_entropy(model(x), y)  # the model reached through a closure, not a keyword
        loss.backward()
        return loss.detach()
    return step


def test_closure_model_gradients_cleared_every_few_calls(mode):
    backend, without_host = mode
    eager_model, traced_model = make_model(), make_model()
    eager = closure_step(eager_model)
    traced = tracejit.trace(closure_step(traced_model), backend=backend, without_host=without_host)
    x, y = batch(0)
    for i in range(CALLS):
        if i % 3 == 0:
            eager_model.zero_grad()
            traced_model.zero_grad()
        assert_same(eager(x, y), traced(x, y), backend, f"call {i}: loss")
        assert_same_model(eager_model, traced_model, backend, f"call {i}")
    assert_jit_ran(traced, without_host)


_global_model = None


def _global_step(x, y):
    loss = F.cross_entropy(_global_model(x), y)  # the model reached as a global
    loss.backward()
    return loss.detach()


def test_global_model_gradients_cleared_every_few_calls(mode):
    global _global_model
    backend, without_host = mode
    eager_model, traced_model = make_model(), make_model()
    traced = tracejit.trace(_global_step, backend=backend, without_host=without_host)
    try:
        for i in range(CALLS):
            x, y = batch(i)
            if i % 3 == 0:
                eager_model.zero_grad()
                traced_model.zero_grad()
            _global_model = eager_model
            expected = _global_step(x, y)
            _global_model = traced_model
            assert_same(expected, traced(x, y), backend, f"call {i}: loss")
            assert_same_model(eager_model, traced_model, backend, f"call {i}")
    finally:
        _global_model = None
    assert_jit_ran(traced, without_host)


def test_closure_model_accumulation_with_a_closure_optimizer(mode):
    # gradient accumulation over 3 calls, the step and zero_grad() inside every third one
    backend, without_host = mode

    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step(x, y, *, do_step):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if do_step:
                opt.step()
                opt.zero_grad()
            return loss.detach()
        return step

    eager_model, traced_model = make_model(), make_model()
    eager = make(eager_model)
    traced = tracejit.trace(make(traced_model), backend=backend, without_host=without_host)
    for i in range(CALLS + 2):
        x, y = batch(i)
        do_step = i % 3 == 2
        assert_same(eager(x, y, do_step=do_step), traced(x, y, do_step=do_step), backend, f"call {i}: loss")
        assert_same_model(eager_model, traced_model, backend, f"call {i}")
    assert_jit_ran(traced, without_host)


def input_step(delta, *, model, x, y):
    loss = F.cross_entropy(model(x + delta), y)  # a learnable input perturbation
    loss.backward()
    return loss.detach()


def test_input_gradient_cleared_every_few_calls(mode):
    backend, without_host = mode
    eager_model, traced_model = make_model(), make_model()
    eager_delta = torch.zeros(5, 4, requires_grad=True)
    traced_delta = torch.zeros(5, 4, requires_grad=True)
    traced = tracejit.trace(input_step, backend=backend, without_host=without_host)
    x, y = batch(0)
    for i in range(CALLS):
        if i % 3 == 0:
            eager_delta.grad = None
            traced_delta.grad = None
        expected = input_step(eager_delta, model=eager_model, x=x, y=y)
        assert_same(expected, traced(traced_delta, model=traced_model, x=x, y=y), backend, f"call {i}: loss")
        assert_same(eager_delta.grad, traced_delta.grad, backend, f"call {i}: delta.grad")
        assert_same_model(eager_model, traced_model, backend, f"call {i}")
    assert_jit_ran(traced, without_host)


def test_input_gradient_cleared_and_the_input_updated(mode):
    # an adversarial iterate: the step updates the input from its gradient, cleared every other call
    backend, without_host = mode

    def step(delta, *, model, x, y):
        loss = -F.cross_entropy(model(x + delta), y)
        loss.backward()
        with torch.no_grad():
            delta.sub_(0.1 * delta.grad.sign())
        return loss.detach()

    eager_model, traced_model = make_model(), make_model()
    eager_delta = torch.zeros(5, 4, requires_grad=True)
    traced_delta = torch.zeros(5, 4, requires_grad=True)
    traced = tracejit.trace(step, backend=backend, without_host=without_host)
    x, y = batch(0)
    for i in range(CALLS):
        if i % 2 == 0:
            eager_delta.grad = None
            traced_delta.grad = None
        expected = step(eager_delta, model=eager_model, x=x, y=y)
        assert_same(expected, traced(traced_delta, model=traced_model, x=x, y=y), backend, f"call {i}: loss")
        assert_same(eager_delta, traced_delta, backend, f"call {i}: delta")
        assert_same(eager_delta.grad, traced_delta.grad, backend, f"call {i}: delta.grad")
        assert_same_model(eager_model, traced_model, backend, f"call {i}")
    assert_jit_ran(traced, without_host)


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_closure_model_gradients_cleared_with_symbolic_sizes(without_host):
    # batches of several sizes: the traces of symbolic sizes are selected by the .grad state too
    eager_model, traced_model = make_model(), make_model()
    eager = closure_step(eager_model)
    traced = tracejit.trace(closure_step(traced_model), backend="aten", without_host=without_host)
    for i, rows in enumerate((5, 6, 7, 8, 5, 6, 7, 9, 10)):
        x, y = batch(i, rows)
        if i % 3 == 0:
            eager_model.zero_grad()
            traced_model.zero_grad()
        assert_same(eager(x, y), traced(x, y), "aten", f"call {i}: loss")
        assert_same_model(eager_model, traced_model, "aten", f"call {i}")
    assert traced.stats.shape_specializations > 0 and traced.stats.checked_replays > 0, traced.stats


def test_a_mismatch_from_a_cleared_gradient_says_so():
    # a plain tensor requiring grad, reached through a closure (not a parameter): its .grad does not
    # select a trace, and the mismatch its clearing causes names the cause
    w = torch.randn(4, 3, requires_grad=True)

    def step(x):
        (x @ w).square().sum().backward()

    traced = tracejit.trace(step, backend="aten")
    x = torch.randn(5, 4)
    traced(x)
    traced(x)  # the record now accumulates into w.grad
    w.grad = None
    with pytest.raises(TraceMismatchError, match=r"a `\.grad` was None where the recorded call had one"):
        traced(x)


def test_retain_graph_warning_says_the_graph_was_retained():
    model = make_model()

    def step(x, y, *, model):
        loss = F.cross_entropy(model(x), y)
        loss.backward(retain_graph=True)
        return loss

    traced = tracejit.trace(step, without_host=True)
    x, y = batch(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            traced(x, y, model=model)
    messages = [str(w.message) for w in caught if issubclass(w.category, GradientWarning)]
    assert messages, [str(w.message) for w in caught]
    assert all("no backward pass inside the call used their autograd graph" not in m for m in messages), messages
    assert any("retain_graph=True" in m and "without an autograd graph" in m for m in messages), messages


def _dict_step(x, y, *, st):
    loss = torch.nn.functional.cross_entropy(st["model"](x), y)
    loss.backward()
    st["opt"].step()
    st["opt"].zero_grad()
    return loss.detach()


def _train_with_a_resume_and_a_freeze(step):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    st = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    generator = torch.Generator().manual_seed(1)
    for call in range(9):
        if call == 3:  # resume: new objects holding the state, in a new dict
            model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
            model.load_state_dict(st["model"].state_dict())
            st = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
        if call == 6:
            model[0].weight.requires_grad_(False)
        step(torch.randn(8, 6, generator=generator), torch.randint(0, 5, (8,), generator=generator), st=st)
    return model


@pytest.mark.parametrize("options", [{}, {"without_host": True}, {"backend": "aten"}])
def test_freezing_a_layer_of_a_model_held_in_a_keyword_dict_selects_a_trace_of_its_own(options):
    # after a resume, the frozen weight kept training (0.018 off after three calls)
    want = _train_with_a_resume_and_a_freeze(_dict_step)
    traced = tracejit.trace(_dict_step, **options)
    got = _train_with_a_resume_and_a_freeze(traced)
    for a, b in zip(want.state_dict().values(), got.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.equal(want[0].weight, got[0].weight)
    assert traced.stats.records >= 2 and traced.stats.calls - traced.stats.records >= 5
