"""Checked replay at the torch API level: the function runs and is matched call by call, the
host-free program computes. Every test asserts through `stats` that the API level really served
the calls (or, where it must not, that it did not)."""

import copy
import gc
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import assert_same_state, batch, closure_mse_step, make_model, mse_step, train_side_by_side, train_step, twin

import tracejit
from tracejit.errors import TraceMismatchError

API_OPTIMIZERS = ["sgd", "sgd_momentum", "adam", "adam_foreach", "adam_fused", "adamw_fused"]


def served_by_api(traced) -> None:
    """Every call ran at the API level but the record, a re-record of lazy state and the one
    aten-level replay after them that notes the torch calls; none fell back."""
    stats = traced.stats
    assert stats.records == 1
    expected = stats.calls - stats.records - stats.rerecords - 1
    assert expected > 0 and stats.api_replays == expected, (
        stats, [e.api_refused or e.api_last_fallback for e in traced._entries()])
    assert stats.api_fallbacks == 0


@pytest.mark.parametrize("opt_name", API_OPTIMIZERS)
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_training_matches_eager_bitwise(kind, opt_name):
    # the aten backend computes op by op as eager does: every step is bitwise eager's
    (model_a, opt_a), (model_b, opt_b), traced = train_side_by_side(kind, opt_name, steps=6, backend="aten")
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    served_by_api(traced)


def test_fused_kernels_compute_api_level_calls():
    (model_a, opt_a), (model_b, opt_b), traced = train_side_by_side("mlp", "sgd_momentum", steps=6, backend="c")
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=False)
    served_by_api(traced)
    entry = traced._entries()[0]
    assert any(node.op.name == "FUSED" for node in entry.serving_program.graph.nodes)


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam", "adam_foreach", "adam_fused"])
def test_a_learning_rate_schedule_is_followed_without_leaving_the_api_level(opt_name):
    (model_a, opt_a), (model_b, opt_b), traced = train_side_by_side("mlp", opt_name, steps=7, scheduler_gamma=0.5,
                                                                    backend="aten")
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    served_by_api(traced)


def test_a_changing_python_number_is_passed_to_the_program():
    class Warmup(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.fc(x) * min(1.0, self.calls / 4)

    def forward(x, *, model):
        return model(x)

    eager_model = Warmup()
    traced_model = Warmup()
    traced_model.load_state_dict(eager_model.state_dict())
    traced = tracejit.trace(forward, backend="aten")
    for i in range(6):
        x = torch.randn(2, 3)
        with torch.no_grad():  # outputs that require grad keep the aten level (tested below)
            assert torch.equal(traced(x, model=traced_model), forward(x, model=eager_model))
    assert traced_model.calls == 6  # the function ran once per call: no fallback ran it twice
    served_by_api(traced)


def test_outputs_of_earlier_calls_keep_their_values():
    traced = tracejit.trace(lambda x: (x * 2.0, (x + 1.0).exp()))
    xs = [torch.randn(3, 2) for _ in range(5)]
    kept = [traced(x) for x in xs]
    for x, (a, b) in zip(xs, kept):
        assert torch.equal(a, x * 2.0) and torch.equal(b, (x + 1.0).exp())
    served_by_api(traced)


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
@pytest.mark.parametrize("size", [2, 512], ids=["small", "planned"])  # 512: the memory planner places it
def test_returned_views_of_computed_values_keep_their_values(size, without_host):
    # issue 11.5: the base of a returned view was written by every later call
    def f(x):
        return ((x * 2.0 + 1.0) @ x).t()[1:]

    traced = tracejit.trace(f, without_host=without_host, backend="aten")
    xs = [torch.randn(size, size) for _ in range(5)]
    kept = [traced(x) for x in xs]
    for x, got in zip(xs, kept):
        assert torch.equal(got, f(x))
    if without_host:
        assert traced.stats.host_free_calls == 4
    else:
        served_by_api(traced)


def test_returned_input_is_the_object_itself():
    traced = tracejit.trace(lambda x, y: (x, x + y))
    for _ in range(4):
        x, y = torch.randn(3), torch.randn(3)
        a, b = traced(x, y)
        assert a is x and torch.equal(b, x + y)
    served_by_api(traced)


def test_a_divergence_falls_back_to_the_aten_level_and_raises_there():
    flag = {"neg": False}

    @tracejit.trace
    def f(x):
        y = x * 2
        return -y if flag["neg"] else y

    for _ in range(4):
        f(torch.randn(3))
    served_by_api(f)
    flag["neg"] = True
    with pytest.raises(TraceMismatchError):
        f(torch.randn(3))
    assert f.stats.api_fallbacks == 1


def test_a_mismatch_at_the_api_level_changes_no_state():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mode = {"extra": False}

    @tracejit.trace
    def step(x, *, model, opt):
        loss = model(x).sum()
        if mode["extra"]:
            loss = loss * 3  # not in the trace
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(4):
        step(torch.randn(8, 4), model=model, opt=opt)
    before = [p.detach().clone() for p in model.parameters()]
    mode["extra"] = True
    with pytest.raises(TraceMismatchError):
        step(torch.randn(8, 4), model=model, opt=opt)
    # the aten level raised at the first differing op, before the update: parameters are untouched
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_backward_hooks_keep_the_aten_level():
    model, opt = twin(make_model("mlp"), "sgd")[0]
    seen = []
    model.net[0].weight.register_hook(lambda g: seen.append(1))
    traced = tracejit.trace(train_step)
    with pytest.warns(tracejit.ReplayLevelWarning, match="Python code runs inside backward") as warned:
        for i in range(4):
            traced(*batch("mlp", i), model=model, opt=opt)
    assert len([w for w in warned if issubclass(w.category, tracejit.ReplayLevelWarning)]) == 1
    assert warned[0].filename == __file__  # it points at the call in user code
    assert len(seen) == 4  # the hook ran on every call
    assert traced.stats.api_replays == 0
    assert "Python code runs inside backward()" in traced._entries()[0].api_refused


def _scale_gradient(grad):
    return grad * 3


def _double_accumulated(param):
    param.grad.mul_(2)


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_gradient_hook_registered_between_calls_runs_as_in_eager(hook, without_host):
    # Found by an adversarial review: the API level answers backward() without autograd, so a
    # hook registered after the trace was warm never ran and the weights went wrong silently.
    # A keyword model's hooks are part of the gradient state: the call records a trace of its own.
    # Its checked calls run backward (and the hook) at the aten level; without the host, the
    # program has the ops the hook ran while recording (its Python does not run, as the function's).
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "sgd_momentum")
    traced = tracejit.trace(train_step, backend="aten", without_host=without_host)
    ran = []

    def scale(grad):
        ran.append(1)
        return _scale_gradient(grad)

    def double(param):
        ran.append(1)
        _double_accumulated(param)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(8):
            if i == 4:
                for model in (model_a, model_b):
                    getattr(model.net[0].weight, hook)(scale if hook == "register_hook" else double)
            x, y = batch("mlp", i)
            assert torch.equal(traced(x, y, model=model_b, opt=opt_b), train_step(x, y, model=model_a, opt=opt_a)), i
            assert_same_state(model_a, opt_a, model_b, opt_b)
    stats = traced.stats
    assert stats.records == 2
    if without_host:
        assert stats.host_free_calls >= 4 and len(ran) >= 4 + 1  # eager's four, and the recording call
    else:
        assert stats.api_replays >= 1 and len(ran) == 2 * 4  # eager's four calls and the traced four
        assert any("Python code runs inside backward" in str(w.message) for w in caught)


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_a_gradient_hook_registered_between_calls_on_a_closure_model_raises(without_host):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    traced = tracejit.trace(closure_mse_step(model, opt), backend="aten", without_host=without_host)
    for _ in range(4):
        traced(torch.randn(5, 4), torch.randn(5, 3))
    assert traced.stats.api_replays + traced.stats.host_free_calls >= 1
    before = [p.detach().clone() for p in model.parameters()]
    model.weight.register_hook(_scale_gradient)
    with pytest.raises(TraceMismatchError, match="_scale_gradient"):
        traced(torch.randn(5, 4), torch.randn(5, 3))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no update happened


def test_a_divergence_of_a_trace_with_random_ops_falls_back():
    # Found by an adversarial review: restoring the generator's state after a divergence ran under
    # the checker still on the mode stack, which raised its internal ApiDiverged to the caller.
    step = mse_step
    torch.manual_seed(0)
    (model_a, opt_a), (model_b, opt_b) = twin(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 3)), "sgd")
    traced = tracejit.trace(step, backend="aten")
    for i in range(7):
        scale = 1.0 if i < 4 else 0.5  # a number backward also uses: matched, not bound
        x, y = torch.randn(5, 4), torch.randn(5, 3)
        torch.manual_seed(100 + i)
        expected = step(x, y, model=model_a, opt=opt_a, scale=scale)
        torch.manual_seed(100 + i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b, scale=scale), expected), i
        assert_same_state(model_a, opt_a, model_b, opt_b)
    assert traced.stats.api_replays >= 1 and traced.stats.api_fallbacks >= 1


def test_a_gc_callback_during_backward_is_not_a_hook():
    # a collection that starts inside backward runs gc.callbacks (hypothesis registers one): they
    # are no part of the step, and kept every checked call at the aten level
    collections = []

    def callback(phase, info):
        collections.append(_note(phase))

    def _note(phase):
        return phase

    threshold = gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(1)  # a collection at nearly every allocation, backward's included
    try:
        (model_a, opt_a), (model_b, opt_b), traced = train_side_by_side("mlp", "sgd", steps=5, backend="aten")
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*threshold)
    assert collections
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    served_by_api(traced)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused"])
def test_zero_grad_at_the_start_of_the_step(opt_name, set_to_none):
    # the usual loop (zero_grad, forward, backward, step): zero_grad reads the previous step's
    # gradients and frees them, so the objects the trace recorded were gone on every later call
    # and every call fell back to the aten level. set_to_none=False calls requires_grad_(False)
    # on each gradient, which kept the trace at the aten level: a no-op is now checked as one.
    def step(x, y, *, model, opt):
        opt.zero_grad(set_to_none=set_to_none)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), opt_name)
    traced = tracejit.trace(step, backend="aten")
    for i in range(8):
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), step(x, y, model=model_a, opt=opt_a)), i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    stats = traced.stats
    assert stats.api_replays >= 4 and stats.api_fallbacks == 0, (
        stats, [e.api_refused or e.api_last_fallback for e in traced._entries()])


def _reseeds(x, *, seed):
    y = F.dropout(x, 0.5)
    torch.manual_seed(seed)  # seeding what comes next: the draws of y were made before it
    return y, torch.rand(3)


def _forks(x, *, seed):
    a = torch.rand(2)
    with torch.random.fork_rng():  # draws inside do not move the stream outside
        torch.manual_seed(seed)
        b = torch.rand(2)
    return a, b, torch.rand(2), F.dropout(x, 0.5)


def _saves_and_restores(x, *, seed):
    a = torch.rand(2)
    state = torch.get_rng_state()
    b = torch.rand(2)
    torch.set_rng_state(state)
    return a, b, torch.rand(2) + x.sum()


@pytest.mark.parametrize("function", [_reseeds, _forks, _saves_and_restores])
def test_the_rng_state_read_or_set_by_the_function_keeps_the_aten_level(function):
    # the program draws the random numbers after the function has run: with the generator's state
    # read or set in between, its draws were not eager's (silently, in the default mode)
    traced = tracejit.trace(function)
    with pytest.warns(tracejit.ReplayLevelWarning, match="random number generator|generator.s state"):
        for i in range(5):
            x = torch.randn(8)
            torch.manual_seed(100 + i)
            want = function(x, seed=i)
            torch.manual_seed(100 + i)
            got = traced(x, seed=i)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), i
            assert torch.equal(torch.rand(4), (torch.manual_seed(100 + i), function(x, seed=i), torch.rand(4))[2])
    assert traced.stats.api_replays == 0 and traced.stats.checked_replays == 4


def test_a_reseed_on_a_later_call_runs_that_call_at_the_aten_level():
    reseed = {"now": False}

    def f(x):
        y = F.dropout(x, 0.5) * 2
        if reseed["now"]:  # decided by Python state the checker does not see
            torch.manual_seed(7)
        return y, torch.rand(3)

    traced = tracejit.trace(f)
    for i in range(6):
        reseed["now"] = i == 4
        x = torch.randn(8)
        torch.manual_seed(100 + i)
        want = f(x)
        after = torch.rand(2)
        torch.manual_seed(100 + i)
        got = traced(x)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), i
        assert torch.equal(torch.rand(2), after), i  # the stream continues as eager's
    stats = traced.stats
    # the reseeding call fell back; its aten-level run saw the reseed, so the trace stays there
    assert stats.api_replays == 2 and stats.api_fallbacks == 1, stats
    assert "torch.manual_seed()" in traced._entries()[0].api_refused


def _history_step(history: list, *, keep):
    def step(x, y, *, model, opt):
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append(keep(loss, out))
        return loss
    return step


KEEPS = {
    "loss.detach()": lambda loss, out: loss.detach(),
    "a row of a detached output": lambda loss, out: out.detach()[0],
    "a tuple of two": lambda loss, out: (loss.detach(), out.detach() * 2),
}


@pytest.mark.parametrize("backend", ["aten", "c"])
@pytest.mark.parametrize("keep", list(KEEPS))
def test_values_kept_beyond_the_call_stay_at_the_api_level(keep, backend):
    """`history.append(loss.detach())` on every call: the function's list gets the program's
    values (each call's own, earlier ones unchanged), sharing memory as eager's do. Such a step
    ran every call at the aten level, 6.7x slower than eager."""
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("cnn"), "adam_fused")
    eager_history, traced_history = [], []
    eager = _history_step(eager_history, keep=KEEPS[keep])
    traced = tracejit.trace(backend=backend)(_history_step(traced_history, keep=KEEPS[keep]))
    for i in range(6):
        x, y = batch("cnn", i)
        torch.manual_seed(i)  # the CNN's dropout draws the same masks
        want = eager(x, y, model=model_a, opt=opt_a)
        torch.manual_seed(i)
        got = traced(x, y, model=model_b, opt=opt_b)
        assert torch.equal(got, want) if backend == "aten" else torch.allclose(got, want, atol=1e-5)
        flat = [t for item in traced_history for t in (item if isinstance(item, tuple) else (item,))]
        if keep == "loss.detach()":  # a view of the returned loss, as in eager
            assert traced_history[-1].data_ptr() == got.data_ptr()
        assert len({t.data_ptr() for t in flat}) == len(flat)  # every call's values in memory of their own
    assert len(eager_history) == len(traced_history) == 6
    for i, (a, b) in enumerate(zip(eager_history, traced_history)):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y) if backend == "aten" else torch.allclose(x, y, atol=1e-5), (i, x, y)
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=backend == "aten", atol=1e-5)
    served_by_api(traced)


def test_a_kept_view_of_an_input_keeps_the_aten_level():
    kept = []

    @tracejit.trace
    def f(x):
        kept.append(x[1:])  # memory the caller owns: a placeholder's could not be the caller's
        return x.exp().sum()

    with pytest.warns(tracejit.ReplayLevelWarning, match="a view of a tensor it did not make"):
        for i in range(4):
            x = torch.randn(3) + i
            f(x)
            assert kept[-1].data_ptr() == x[1:].data_ptr()
    assert f.stats.api_replays == 0
    assert "a view of a tensor it did not make" in f._entries()[0].api_refused


def test_a_kept_tensor_that_requires_grad_keeps_the_aten_level():
    kept = []
    w = torch.randn(3, requires_grad=True)

    @tracejit.trace
    def f(x):
        h = x * w
        kept.append(h)  # its autograd graph is eager's: the caller may backpropagate through it
        return h.detach().sum()

    with pytest.warns(tracejit.ReplayLevelWarning, match="requires grad"):
        for i in range(4):
            x = torch.randn(3) + i
            f(x)
            assert torch.equal(kept[-1], x * w) and kept[-1].grad_fn is not None
    assert f.stats.api_replays == 0
    assert "requires grad" in f._entries()[0].api_refused


def test_a_new_autocast_context_records_its_own_trace():
    @tracejit.trace
    def f(x, w):
        return x @ w

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    for _ in range(3):
        assert f(x, w).dtype == torch.float32
    for _ in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = f(x, w)
            assert out.dtype == torch.bfloat16 and torch.equal(out, x @ w)
    assert torch.equal(f(x, w), x @ w)
    assert f.stats.records == 2 and f.stats.api_replays >= 3 and f.stats.api_fallbacks == 0


def test_outputs_that_require_grad_keep_the_aten_level():
    # a traced forward, backward outside: the gradients need the graph the aten level builds
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "sgd")
    forward = tracejit.trace(lambda x, *, model: model(x))
    with pytest.warns(tracejit.ReplayLevelWarning, match="requires grad"):
        for i in range(4):
            x, y = batch("mlp", i)
            for model, opt, run in ((model_a, opt_a, lambda x, model: model(x)), (model_b, opt_b, forward)):
                F.cross_entropy(run(x, model=model), y).backward()
                opt.step()
                opt.zero_grad()
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    assert forward.stats.checked_replays == 3 and forward.stats.api_replays == 0


def _drop_first_row(x):
    x.set_(x[1:])  # x now lives in its own memory past the first row
    return x * 2


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_a_tensor_set_to_other_memory_keeps_the_aten_level(without_host):
    """`x.set_(x[1:])` reaches no torch function mode: the API level answered `x[1:]` with a
    stand-in and let set_ run on it, so from the third call the input pointed into scratch memory
    and the result was garbage of the wrong shape. Its aten op in the record keeps the checked
    calls at the aten level, saying why once; without the host the program runs set_ itself."""
    traced = tracejit.trace(_drop_first_row, backend="aten", without_host=without_host)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for i in range(5):
            x, twin = torch.arange(12.0).view(3, 4) + i, torch.arange(12.0).view(3, 4) + i
            out, expected = traced(x), _drop_first_row(twin)
            assert torch.equal(out, expected) and torch.equal(x, twin) and x.shape == (2, 4), f"call {i}"
    refusals = [str(w.message) for w in warned if issubclass(w.category, tracejit.ReplayLevelWarning)]
    if without_host:
        assert traced.stats.host_free_calls == 4 and refusals == []
    else:
        assert traced.stats.checked_replays == 4 and traced.stats.api_replays == 0
        assert len(refusals) == 1 and "aten.set_.source_Tensor" in refusals[0], refusals
        assert "makes a tensor use other memory (Tensor.set_)" in refusals[0]


def test_replay_env_switch_keeps_the_aten_level(monkeypatch):
    monkeypatch.setenv("TRACEJIT_REPLAY", "aten")
    traced = tracejit.trace(lambda x: x * 2)
    for _ in range(4):
        traced(torch.randn(3))
    assert traced.stats.checked_replays == 3 and traced.stats.api_replays == 0


def test_inference_with_no_grad_and_eval_mode():
    model = make_model("cnn").eval()
    traced = tracejit.trace(lambda x, *, model: model(x), backend="aten")
    for i in range(5):
        x, _ = batch("cnn", i)
        with torch.no_grad():
            assert torch.equal(traced(x, model=model), model(x))
    served_by_api(traced)


def test_loss_returned_by_a_full_step_is_correct():
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "sgd")
    traced = tracejit.trace(train_step, backend="aten")
    for i in range(4):
        x, y = batch("mlp", i)
        want = train_step(x, y, model=model_a, opt=opt_a)
        got = traced(x, y, model=model_b, opt=opt_b)
        assert torch.equal(got, want)
    served_by_api(traced)
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)


def test_host_reads_are_computed_when_read():
    # Adam's default CPU implementation reads each step count with .item(): the value must be
    # this call's, and the numbers derived from it must reach the program
    seen = []

    @tracejit.trace(backend="aten")
    def f(x, *, state):
        state.add_(1)
        n = state.item()
        seen.append(n)
        return x * (1.0 / n)

    state = torch.zeros(())
    x = torch.randn(4)
    for i in range(1, 6):
        assert torch.equal(f(x, state=state), x * (1.0 / i))
    assert seen == [1.0, 2.0, 3.0, 4.0, 5.0] and state.item() == 5.0
    served_by_api(f)


def test_a_host_read_of_a_random_value_draws_what_the_program_draws():
    # the read draws the random ops before it from where the generator stands and puts it back:
    # the program then draws the same mask (api_replay._Reader)
    def f(x):
        y = F.dropout(x, 0.5)
        return y * y.sum().item()

    traced = tracejit.trace(f)
    for i in range(6):
        torch.manual_seed(i)
        want = f(torch.ones(8))
        torch.manual_seed(i)
        assert torch.equal(traced(torch.ones(8)), want), i
        assert torch.equal(torch.rand(3), (torch.manual_seed(i), f(torch.ones(8)), torch.rand(3))[2]), i
    assert traced.stats.api_replays >= 3 and traced.stats.api_fallbacks == 0, traced.stats


def test_python_side_effects_happen_once_per_call():
    log = []

    @tracejit.trace
    def f(x):
        log.append("called")
        return F.relu(x) + 1

    for _ in range(5):
        f(torch.randn(4))
    assert log == ["called"] * 5
    served_by_api(f)


def test_a_keyword_number_that_changes_every_call_stays_at_the_api_level():
    # the host-free program's guard that a keyword number kept its recorded value (needed without
    # the host, where it could decide control flow) failed every call at the API level, so every
    # call fell back to the aten level; a checked call runs the function and binds the number
    def step(x, *, scale, shift):
        return x * scale + shift

    traced = tracejit.trace(step, backend="c")
    for i in range(6):
        x = torch.randn(4, 6)
        assert torch.equal(traced(x, scale=0.5 + i, shift=i), step(x, scale=0.5 + i, shift=i)), i
    assert traced.stats.api_replays == 4 and traced.stats.api_fallbacks == 0, traced.stats


_NUMBER_FORMS = {
    "floordiv": lambda x, i, k, j: (x // k) * 2,
    "where": lambda x, i, k, j: torch.where(x > 0, x, k) - 1,
    "where_first": lambda x, i, k, j: torch.where(x > 0, k, x) + x,
    "int_floordiv": lambda x, i, k, j: i // j + 1,
    "int_where": lambda x, i, k, j: torch.where(i > 0, i, j),
    "bitwise": lambda x, i, k, j: (i & j) + (i | j) + (i ^ j),
    "eq": lambda x, i, k, j: (i == j) | (x > k),
}


@pytest.mark.parametrize("form", list(_NUMBER_FORMS))
def test_numbers_of_operators_and_where_are_passed_to_the_program(form):
    # `x // k` (Tensor.__floordiv__ binds aten.floor_divide), `torch.where(c, x, k)` (k becomes an
    # aten.scalar_tensor first): a k that changed every call diverged at the API level before
    body = _NUMBER_FORMS[form]

    def step(x, i, *, k, j):
        return body(x, i, k, j)

    with warnings.catch_warnings():
        warnings.simplefilter("error", tracejit.ReplayLevelWarning)
        traced = tracejit.trace(step, backend="aten")
        for n in range(7):
            x, i = torch.randn(8) * 10, torch.randint(-20, 20, (8,))
            k, j = 1.5 + n, 1 + n % 3
            got, want = traced(x, i, k=k, j=j), step(x, i, k=k, j=j)
            assert got.dtype == want.dtype and torch.equal(got, want), n
    assert traced.stats.api_replays == 5 and traced.stats.api_fallbacks == 0, traced.stats


def test_a_keyword_number_that_changes_control_flow_still_raises():
    def step(x, *, k):
        return x * 2 if k > 2 else x - 1

    traced = tracejit.trace(step)
    for _ in range(3):
        traced(torch.randn(3), k=1.0)
    with pytest.raises(TraceMismatchError, match="a different op ran"):
        traced(torch.randn(3), k=3.0)


def test_a_number_that_backward_also_uses_is_matched_not_bound():
    # `loss * cfg.scale`: autograd saves the scale for backward's mul, which the API level does
    # not see. Bound as a number, backward kept the traced scale and the weights went wrong silently
    class Config:
        scale = 1.0

    def step(x, y, *, model, opt):
        loss = F.cross_entropy(model(x), y) * Config.scale
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    torch.manual_seed(0)
    (model_a, opt_a), (model_b, opt_b) = twin(nn.Linear(8, 4), "sgd")
    traced = tracejit.trace(step, backend="aten")
    with pytest.warns(tracejit.ReplayLevelWarning, match="diverged at the torch API level"):
        for i in range(8):
            Config.scale = 1.0 if i < 4 else 1.0 / i  # constant at first: those calls run at the API level
            x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
            assert torch.equal(traced(x, y, model=model_b, opt=opt_b), step(x, y, model=model_a, opt=opt_a)), i
            assert_same_state(model_a, opt_a, model_b, opt_b)
    # the first new scale ran at the aten level; the API level built from that call saw the scale
    # and MulBackward's copy of it change together, and passes both on from then on
    assert traced.stats.api_replays == 5 and traced.stats.api_fallbacks == 1, traced.stats


def test_a_number_backward_transforms_stays_matched():
    # `x ** k`: PowBackward takes k and k - 1. The k - 1 slot changes with k but holds another
    # value, which no forward number explains: numbers before backward stay matched exactly
    def step(x, *, model, opt, k):
        loss = model(x).abs().add(1).pow(k).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    torch.manual_seed(0)
    (model_a, opt_a), (model_b, opt_b) = twin(nn.Linear(8, 4), "sgd")
    traced = tracejit.trace(step, backend="aten")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracejit.ReplayLevelWarning)
        for i in range(7):
            x, k = torch.randn(5, 8), 2.0 + i / 4
            assert torch.equal(traced(x, model=model_b, opt=opt_b, k=k), step(x, model=model_a, opt=opt_a, k=k)), i
            assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    assert traced.stats.api_replays == 0, traced.stats


def test_numbers_scaling_several_losses_before_backward_stay_at_the_api_level():
    # KL annealing: `rec + beta * kl` with beta changing every call, and a second weighted term
    def step(x, *, model, opt, beta, gamma):
        out = model(x)
        loss = out.pow(2).mean() + beta * out.abs().mean() + out.sum() * gamma
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    torch.manual_seed(0)
    (model_a, opt_a), (model_b, opt_b) = twin(nn.Linear(8, 4), "adam_fused")
    traced = tracejit.trace(step, backend="aten")
    for i in range(8):
        x, beta, gamma = torch.randn(5, 8), min(1.0, i / 5), 0.01 * (i + 1)
        got = traced(x, model=model_b, opt=opt_b, beta=beta, gamma=gamma)
        assert torch.equal(got, step(x, model=model_a, opt=opt_a, beta=beta, gamma=gamma)), i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    # Adam's lazy state re-records the second call; each later call but the aten-level one is served
    assert traced.stats.api_replays == 5 and traced.stats.api_fallbacks == 0, traced.stats


def test_an_exception_inside_a_grad_mode_block_leaves_grad_mode_as_it_was():
    # The exception unwinds through `no_grad().__exit__`, whose grad-mode call is not the recorded
    # call at that position: it must still run (grad mode restored) and the exception go on.
    state = {"raise": False}

    def forward(x, *, model):
        with torch.no_grad():
            if state["raise"]:
                raise KeyError("raised by the function")
            y = model(x)
        return y * 2

    model = nn.Linear(3, 3)
    traced = tracejit.trace(forward, backend="aten")
    x = torch.randn(2, 3)
    for _ in range(4):
        assert torch.equal(traced(x, model=model), forward(x, model=model))
    assert traced.stats.api_replays >= 1
    state["raise"] = True
    with pytest.raises(KeyError, match="raised by the function"):
        traced(x, model=model)
    assert torch.is_grad_enabled()
    state["raise"] = False
    assert torch.equal(traced(x, model=model), forward(x, model=model))


def test_torchs_python_functions_reach_the_checker_and_torch_is_left_as_it_was():
    # F.relu, F.cross_entropy and Tensor.backward go to the checker directly while a checked call
    # runs, and no_grad() sets grad mode without it (api_replay._install_fast_paths); after every
    # call, a diverging one included, torch's own functions are back, and a mode the function
    # enters itself gets the calls made inside it
    import torch._tensor

    seen = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    state = {"watch": False, "double": False}

    real_set_grad = torch._C._set_grad_enabled

    def step(x, y, *, model, opt):
        with torch.no_grad():
            x = x * 1.5
        h = F.relu(model(x))
        if state["watch"]:
            with Watch():
                h = F.gelu(F.relu(h))
        loss = F.cross_entropy(h * 2 if state["double"] else h, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    torch.manual_seed(0)
    (model_a, opt_a), (model_b, opt_b) = twin(nn.Linear(8, 4), "sgd")
    traced = tracejit.trace(step, backend="aten")

    def check(i):
        x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), step(x, y, model=model_a, opt=opt_a)), i
        assert_same_state(model_a, opt_a, model_b, opt_b)
        assert F.handle_torch_function is torch.overrides.handle_torch_function
        assert torch._tensor.handle_torch_function is torch.overrides.handle_torch_function
        assert torch._C._set_grad_enabled is real_set_grad and torch.is_grad_enabled()

    for i in range(4):
        check(i)
    assert traced.stats.api_replays >= 2
    state["double"] = True  # diverges at the API level: the call runs at the aten level
    with pytest.raises(TraceMismatchError):
        check(4)
    state["double"] = False
    state["watch"] = True
    with pytest.raises(TraceMismatchError):
        check(5)
    assert seen and seen[0] is F.relu  # the function's own mode got its call first


def test_another_thread_keeps_torchs_way_while_checked_calls_run():
    # the bindings replaced during a checked call are process-wide: a thread running its own
    # TorchFunctionMode meanwhile must still see every call it makes, and grad mode stays per thread
    import threading

    class Count(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.relu = self.grad = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.relu:
                self.relu += 1
            elif func is torch._C._set_grad_enabled or getattr(func, "__name__", "") == "_set_grad_enabled":
                self.grad += 1
            return func(*args, **(kwargs or {}))

    stop = threading.Event()
    counts = []

    def other_thread():
        x = torch.randn(4)
        with Count() as mode:
            while not stop.is_set():
                with torch.no_grad():
                    F.relu(x)
        counts.append((mode.relu, mode.grad))

    def step(x, y, *, model, opt):
        with torch.no_grad():
            x = x + 1
        loss = F.cross_entropy(F.relu(model(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    torch.manual_seed(0)
    (model_a, opt_a), (model_b, opt_b) = twin(nn.Linear(8, 4), "sgd")
    traced = tracejit.trace(step, backend="aten")
    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        for i in range(30):
            x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
            assert torch.equal(traced(x, y, model=model_b, opt=opt_b), step(x, y, model=model_a, opt=opt_a)), i
            assert_same_state(model_a, opt_a, model_b, opt_b)
    finally:
        stop.set()
        thread.join()
    assert traced.stats.api_replays >= 20
    (relu, grad), = counts
    assert relu > 0 and grad == 2 * relu  # each no_grad() block: enter and exit, all seen by its mode


def test_the_fast_signature_check_agrees_with_the_signature():
    # The next checked call first tries the last API-level trace's generated signature check
    # (HostFreeRunner.admit) instead of computing its signature: what it admits must have the
    # trace's signature (it may refuse more: another set of keywords goes the slow way).
    from tracejit.signature import gradient_state, signature

    def forward(x, w, *, model, double):
        y = model(x) + w
        return y * 2 if double else y

    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0))
    traced = tracejit.trace(forward, backend="aten")
    x, w = torch.randn(3, 4), torch.randn(3, 4)
    with torch.no_grad():
        for _ in range(4):
            traced(x, w, model=model, double=True)
    entry = traced._fast_api
    assert entry is not None and traced.stats.api_replays >= 1
    big = torch.randn(6, 8)
    variants = {
        "same": lambda: ((torch.randn(3, 4), torch.randn(3, 4)), dict(model=model, double=True)),
        "shape": lambda: ((torch.randn(2, 4), w), dict(model=model, double=True)),
        "layout": lambda: ((torch.randn(4, 3).t(), w), dict(model=model, double=True)),
        "dtype": lambda: ((x.double(), w), dict(model=model, double=True)),
        "requires_grad": lambda: ((x.requires_grad_(False).clone().requires_grad_(), w), dict(model=model, double=True)),
        "same_object": lambda: ((x, x), dict(model=model, double=True)),
        "overlap": lambda: ((big[:3, :4], big[3:, :4]), dict(model=model, double=True)),
        "flag": lambda: ((x, w), dict(model=model, double=False)),
        "number_flag": lambda: ((x, w), dict(model=model, double=1)),
        "missing_keyword": lambda: ((x, w), dict(model=model)),
        "extra_keyword": lambda: ((x, w), dict(model=model, double=True, scale=2.0)),
        "not_a_tensor": lambda: ((x, 1.0), dict(model=model, double=True)),
        "inference_tensor": lambda: ((_inference_randn(3, 4), w), dict(model=model, double=True)),
    }
    with torch.no_grad():
        for name, make in variants.items():
            args, kwargs = make()
            same = (all(isinstance(a, torch.Tensor) for a in args) and signature(args, kwargs) == entry.key
                    and (entry.grad_state is None or gradient_state(kwargs) == entry.grad_state))
            admitted = entry.host_free.admit(args, kwargs) is True
            assert admitted == same or (same and name == "extra_keyword"), name
        model[1].eval()
        args, kwargs = variants["same"]()
        assert entry.host_free.admit(args, kwargs) is not True and signature(args, kwargs) != entry.key
        model[1].train()
    args, kwargs = variants["same"]()
    assert entry.host_free.admit(args, kwargs) is not True and signature(args, kwargs) != entry.key  # grad mode
    with torch.no_grad(), torch.autograd.set_detect_anomaly(True):
        assert entry.host_free.admit(args, kwargs) is not True and signature(args, kwargs) != entry.key


def _inference_randn(*shape):
    with torch.inference_mode():
        return torch.randn(*shape)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused", "adam_foreach"])
@pytest.mark.parametrize("reached", ["closure", "keyword"])
@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("backend", ["aten", "c"])
def test_gradients_made_by_the_call_are_new_tensors_each_call(kind, opt_name, reached, without_host, backend):
    # zero_grad() first: the gradients each call makes stay on the parameters after it. In eager
    # every call's backward makes new ones, so a gradient the caller kept from an earlier step
    # keeps that step's values; the program assigns its gradients anew instead of writing into the
    # ones Python holds. A model reached through the closure runs at the API level like a keyword
    # one (its gradients are written back, not values the function kept).
    if without_host and opt_name == "adam_foreach":
        pytest.skip("Adam(foreach=True) reads step.item() on the host")
    if backend == "c" and opt_name == "adam_foreach":
        pytest.skip("the fused foreach-Adam kernel rounds within a few ulp, which Adam's normalization "
                    "magnifies on near-zero gradients (tests/test_fused_training.py bounds it)")
    (model_a, opt_a), (model_b, opt_b) = twin(make_model(kind), opt_name)

    def step(x, y, model, opt):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    options = {"backend": backend, "without_host": without_host}
    exact = backend == "aten"
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-6))
    if reached == "closure":
        traced_step = tracejit.trace(lambda x, y: step(x, y, model_b, opt_b), **options)
        call = traced_step
    else:
        traced_step = tracejit.trace(lambda x, y, *, model, opt: step(x, y, model, opt), **options)
        call = lambda x, y: traced_step(x, y, model=model_b, opt=opt_b)  # noqa: E731
    kept_a, kept_b = [], []
    for i in range(7):
        x, y = batch(kind, i)
        torch.manual_seed(i)
        want = step(x, y, model_a, opt_a)
        torch.manual_seed(i)
        assert same(call(x, y), want), i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=exact, atol=1e-5)
        kept_a.append([p.grad for p in model_a.parameters()])
        kept_b.append([p.grad for p in model_b.parameters()])
    for i, (grads_a, grads_b) in enumerate(zip(kept_a, kept_b)):  # each step's gradients as eager left them
        assert all(same(a, b) for a, b in zip(grads_a, grads_b, strict=True)), i
    stats = traced_step.stats
    if without_host:
        assert stats.host_free_calls >= 4
    else:
        assert stats.api_replays >= 3 and stats.api_fallbacks == 0
        assert not [e.api_refused for e in traced_step._entries() if e.api_refused]


def test_an_infinite_number_is_matched_at_the_api_level():
    # Found by an adversarial review: the generated check wrote -inf as `-inf`, a NameError, so
    # every call of an attention-mask step fell back to the aten level.
    def masked(weight):
        def f(x, mask):
            y = (x * weight).masked_fill(mask, float("-inf")).softmax(-1)
            y.sum().backward()
            return y.detach()
        return f

    traced_weight = torch.randn(5, requires_grad=True)
    eager_weight = traced_weight.detach().clone().requires_grad_()
    traced, eager = tracejit.trace(masked(traced_weight), backend="aten"), masked(eager_weight)
    for _ in range(8):
        x, mask = torch.randn(4, 5), torch.rand(4, 5) > 0.5
        mask[:, 0] = False
        assert torch.equal(traced(x, mask), eager(x, mask))
        assert torch.equal(traced_weight.grad, eager_weight.grad)
    assert traced.stats.api_replays >= 4 and traced.stats.api_fallbacks == 0


def test_a_signed_zero_is_matched_bit_for_bit_at_the_api_level():
    # Found by an adversarial review: `threshold`'s value is a number the API level matches (the
    # program has it built in), compared with `!=`: -0.0 passed for the recorded 0.0, and 1 / the
    # result was inf where eager's is -inf. Now it diverges, and that call runs at the aten level.
    def step(x, *, value):
        return 1 / F.threshold(x, 1.5, value)

    traced = tracejit.trace(step, backend="aten")
    x = torch.tensor([1.0, -2.0, 3.0])
    with pytest.warns(tracejit.ReplayLevelWarning, match="_threshold has other arguments"):
        for value in (0.0, 0.0, 0.0, 0.0, -0.0, -0.0, -0.0):
            got, want = traced(x, value=value), step(x, value=value)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (value, got, want)
    assert traced.stats.api_replays >= 4 and traced.stats.api_fallbacks == 1


def test_exceptions_the_function_raises_do_not_keep_the_trace_at_the_aten_level():
    # Found by an adversarial review: three calls that raised the user's own error (a bad batch,
    # retried) counted as API-level divergences and kept every later call at the aten level.
    weight = torch.randn(8, requires_grad=True)
    batch_is_bad = {"now": False}

    def f(x):
        y = (x * weight).sum()
        if batch_is_bad["now"]:
            raise ValueError("bad batch")
        y.backward()
        return y.detach()

    traced = tracejit.trace(f, backend="aten")
    for i in range(16):
        batch_is_bad["now"] = i in (5, 8, 11)
        if batch_is_bad["now"]:
            with pytest.raises(ValueError, match="bad batch"):
                traced(torch.randn(8))
        else:
            x = torch.randn(8)
            assert torch.equal(traced(x), (x * weight).sum().detach())
    before = traced.stats.api_replays
    for _ in range(4):
        traced(torch.randn(8))
    assert traced.stats.api_replays == before + 4
    assert all(e.api_refused is None for e in traced._entries())


def test_a_call_that_diverges_at_the_api_level_says_its_side_effects_ran_twice():
    # the function runs again at the aten level: a counter it keeps moves twice in that call,
    # which changes the numbers it computes from then on; one warning per trace says so
    log = []

    def step(x, *, k):
        log.append("called")
        return x.neg() if len(log) == 4 else x * 2  # the fourth run of the Python takes another branch

    traced = tracejit.trace(step, backend="aten")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            traced(torch.randn(3), k=1)
    twice = [w for w in caught if "happened twice in this call" in str(w.message)]
    assert len(twice) == 1 and "diverged at the torch API level" in str(twice[0].message)
    assert traced.stats.api_fallbacks == 1
    assert len(log) == 5  # 4 calls, one of them ran the function twice


def _focal_step(x, y, *, model, opt, gamma, w):
    opt.zero_grad()
    out = model(x)
    logp = F.log_softmax(out, -1).gather(1, y[:, None]).squeeze(1)
    loss = ((1 - logp.exp()) ** gamma * -logp).mean() + w * out.pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach()


def _lerp_step(x, y, *, model, opt, gamma, w):
    opt.zero_grad()
    out = model(x)
    loss = torch.lerp(out, out.tanh(), gamma).pow(2).mean() + w * out.abs().mean()
    loss.backward()
    opt.step()
    return loss.detach()


# (gamma, w) per call: schedules under which a transformed backward number (PowBackward's
# gamma - 1, LerpBackward's 1 - gamma) moved between two calls exactly as the loss weight w did
_COINCIDENCES = {
    "milestones": (_focal_step, [(2.0, 1.0)] * 6 + [(3.0, 2.0)] * 3 + [(4.0, 2.0)] * 5),
    "annealing": (_focal_step, [(1 + 0.25 * i, min(1.0, i / 4)) for i in range(12)]),
    "lerp": (_lerp_step, [(0.1 * i, 1 - 0.1 * i) for i in range(4)] + [(0.1 * i, 0.2) for i in range(4, 12)]),
}


@pytest.mark.parametrize("case", list(_COINCIDENCES))
def test_a_backward_number_that_moves_like_a_loss_weight_is_not_taken_for_it(case):
    # Two equal pairs of values are no proof of one number: only MulBackward0 and DivBackward0
    # slots are linked to the numbers of a forward mul or div, and any other backward slot that
    # changed keeps exact matching (was: gradients off by up to 0.05 from the next change on)
    step, schedule = _COINCIDENCES[case]
    torch.manual_seed(0)
    (model_a, opt_a), (model_b, opt_b) = twin(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)),
                                              "sgd_momentum")
    traced = tracejit.trace(step, backend="aten")
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tracejit.ReplayLevelWarning)
        for i, (gamma, w) in enumerate(schedule):
            x, y = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
            got = traced(x, y, model=model_b, opt=opt_b, gamma=gamma, w=w)
            assert torch.equal(got, step(x, y, model=model_a, opt=opt_a, gamma=gamma, w=w)), i
            assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)



def test_a_call_that_leaves_the_api_level_before_the_function_runs_does_not_say_it_ran_twice():
    # the caller replaced a momentum buffer, freeing the recorded one: the call goes to the aten
    # level before the function runs, so its side effects happen once, and no warning says they
    # happened twice
    log = []

    def step(x, *, model, opt):
        log.append("called")
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        opt.step()
        return loss.detach()

    model_a = nn.Linear(3, 2)
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model_a, model_b))
    traced = tracejit.trace(step, backend="aten")
    for i in range(6):
        x = torch.full((1, 3), float(i))
        assert torch.equal(traced(x, model=model_b, opt=opt_b), step(x, model=model_a, opt=opt_a))
    assert traced.stats.api_replays >= 1
    for opt, model in ((opt_a, model_a), (opt_b, model_b)):
        opt.state[model.weight]["momentum_buffer"] = torch.zeros(2, 3)  # the recorded one is freed
    runs = len(log)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = traced(torch.ones(1, 3), model=model_b, opt=opt_b)
    assert len(log) == runs + 1
    assert not [w for w in caught if "happened twice" in str(w.message)], [str(w.message) for w in caught]
    assert torch.equal(got, step(torch.ones(1, 3), model=model_a, opt=opt_a))
    assert_same_state(model_a, opt_a, model_b, opt_b)


def test_a_step_profiled_with_cprofile_notes_its_calls_and_keeps_the_profiler():
    """The call that notes the torch-level calls watches backward() with sys.setprofile and put
    back what sys.getprofile() had answered: under cProfile, its Profile object, which
    sys.setprofile cannot take, so the user's step raised TypeError ("'Profile' object is not
    callable") on the next Python event. cProfile is enabled again instead, and sees the calls."""
    import cProfile
    import pstats

    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "adam_fused")
    traced = tracejit.trace(train_step)
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        for i in range(5):
            x, y = batch("mlp", i)
            want = train_step(x, y, model=model_a, opt=opt_a)
            assert torch.equal(traced(x, y, model=model_b, opt=opt_b), want)
            assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
        _after_the_steps()
    finally:
        profiler.disable()
    served_by_api(traced)
    profiled = {code[2] for code in pstats.Stats(profiler).stats}
    assert "_after_the_steps" in profiled  # the profiler ran after the noting call's backward too


def _after_the_steps():
    pass


def test_a_step_noted_under_torch_profiler_with_stacks_keeps_the_profiler():
    """torch.profiler's with_stack=True installs a C profiler that cannot be put back once
    replaced: the noting call leaves it alone and the trace stays at the aten level, saying why."""
    from torch.profiler import profile

    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "adam_fused")
    traced = tracejit.trace(train_step)
    with profile(with_stack=True), pytest.warns(tracejit.ReplayLevelWarning, match="with_stack=True"):
        tracer = sys.getprofile()
        for i in range(4):
            x, y = batch("mlp", i)
            want = train_step(x, y, model=model_a, opt=opt_a)
            assert torch.equal(traced(x, y, model=model_b, opt=opt_b), want)
            assert sys.getprofile() is tracer
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    stats = traced.stats  # the record, a re-record of Adam's lazy state, then aten-level replays
    assert stats.records + stats.rerecords == 2 and stats.checked_replays == 2 and stats.api_replays == 0


def test_a_value_kept_before_a_divergence_gets_the_value_the_aten_level_computes():
    """A call that diverges at the API level runs the function again at the aten level, so what
    the function appended before the divergence is appended twice (said by a ReplayLevelWarning).
    The first copy was the placeholder of the run that computes nothing, over a scratch buffer
    nobody writes: the history held a 0.0 among the losses. It now holds the call's value."""
    torch.manual_seed(0)
    (model_a, opt_a), (model_b, opt_b) = twin(nn.Linear(4, 2), "sgd")
    opt_a, opt_b = (torch.optim.RAdam(m.parameters(), lr=0.01) for m in (model_a, model_b))

    def step(x, y, *, model, opt, history):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        history.append(loss.detach())
        opt.step()  # RAdam's rectification switches on at step 6: the API level diverges there
        opt.zero_grad()
        return loss

    traced = tracejit.trace(step)
    eager_history, traced_history, fallbacks = [], [], []
    with pytest.warns(tracejit.ReplayLevelWarning, match="happened twice"):
        for i in range(9):
            x, y = torch.randn(8, 4), torch.randn(8, 2)
            before = traced.stats.api_fallbacks
            assert torch.equal(traced(x, y, model=model_b, opt=opt_b, history=traced_history),
                               step(x, y, model=model_a, opt=opt_a, history=eager_history))
            if traced.stats.api_fallbacks > before:
                fallbacks.append(i)
    assert fallbacks == [5] and traced.stats.api_replays >= 4
    assert len(traced_history) == len(eager_history) + 1
    assert torch.equal(traced_history[5], traced_history[6])  # the call's one value, twice
    del traced_history[5]
    assert all(torch.equal(a, b) for a, b in zip(traced_history, eager_history))
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)


def _mixup_step(x, y, *, model, opt, lam, perm):
    mixed = lam * x + (1 - lam) * x[perm]  # `lam` scales an input that needs no gradient, and the loss
    out = model(mixed)
    loss = lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_mixup_with_a_new_weight_on_every_call_stays_at_the_api_level():
    """One number scaling the input and the loss: the loss's MulBackward0 takes a number two
    forward muls had, so no number before backward was passed on and every call ran at the aten
    level (0.23x eager; the second run drew mixup's numbers twice). A backward slot linked to
    several forward numbers is now passed on while they agree."""
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "adam_fused")
    traced = tracejit.trace(_mixup_step)
    lams = [0.3, 0.8, 0.55, 0.1, 0.95, 0.4, 0.65, 0.2]
    for i, lam in enumerate(lams):
        x, y = batch("mlp", i)
        perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(i))
        want = _mixup_step(x, y, model=model_a, opt=opt_a, lam=lam, perm=perm)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b, lam=lam, perm=perm), want), i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    served_by_api(traced)


def test_numbers_that_agreed_when_traced_and_then_differ_run_at_the_aten_level():
    def step(x, y, *, model, opt, a, b):
        loss = b * F.cross_entropy(model(x), y)  # backward takes `b`...
        scaled = a * y.float()  # ...and `a`, which needs no backward op, agreed with it twice
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach(), scaled

    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "adam_fused")
    traced = tracejit.trace(step)
    numbers = [(0.5, 0.5), (0.7, 0.7), (0.9, 0.9), (0.6, 2.0), (0.3, 0.3), (0.8, 0.1)]
    with pytest.warns(tracejit.ReplayLevelWarning, match="reach one backward op differ"):
        for i, (a, b) in enumerate(numbers):
            x, y = batch("mlp", i)
            want = step(x, y, model=model_a, opt=opt_a, a=a, b=b)
            got = traced(x, y, model=model_b, opt=opt_b, a=a, b=b)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), i
            assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    # the call that disagreed ran at the aten level and noted the calls again: from its numbers
    # the loss's backward takes `b` alone, so the calls after it stay at the API level
    assert traced.stats.api_fallbacks == 1 and traced.stats.api_replays == 2, traced.stats
