"""without_host=True: the program runs, the Python function does not."""

import contextlib
import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import CNN, assert_same_state, batch, make_model, train_side_by_side, train_step, twin
from side_by_side import assert_replayed, mse, seeded, side_by_side, step_of

import tracejit
from tracejit.errors import HostDependencyError

HOST_FREE_OPTIMIZERS = ["sgd", "sgd_momentum", "adam_fused", "adamw_fused"]


class Counted:
    """Wraps a step function and counts how often Python actually ran it."""

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0
        self.__name__ = fn.__name__

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("opt_name", HOST_FREE_OPTIMIZERS)
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_training_matches_eager_and_skips_python(kind, opt_name):
    counted = Counted(train_step)
    steps = 6
    (model_a, opt_a), (model_b, opt_b), _ = train_side_by_side(
        kind, opt_name, steps, step_fn=counted, scheduler_gamma=0.8, without_host=True)
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    # the eager twin ran it every step; the traced one only to record, and for one checked replay
    # when the first call created optimizer state
    assert counted.calls - steps <= 2


def test_optimizer_reading_step_on_the_host_is_refused():
    (model, opt), _ = twin(make_model("mlp"), "adam_loop")  # Adam(foreach=False) calls step.item()
    traced = tracejit.trace(train_step, without_host=True)
    x, y = batch("mlp", 0)
    traced(x, y, model=model, opt=opt)
    with pytest.raises(HostDependencyError) as info:
        for _ in range(2):
            traced(x, y, model=model, opt=opt)
    message = str(info.value)
    assert "item() of t" in message and "models.py" in message and "opt.step()" in message
    assert "fused=True" in message and "capturable=True" in message


def test_exclude_block_is_refused():
    @tracejit.trace(without_host=True)
    def f(x):
        with tracejit.exclude_from_trace():
            pass
        return x + 1

    f(torch.ones(2))
    with pytest.raises(HostDependencyError, match=r"exclude_from_trace\(\) block at test_without_host.py"):
        f(torch.ones(2))


def test_returned_tensors_are_fresh_and_inputs_bind_per_call():
    counted = Counted(lambda x, *, model: model(x).relu())
    traced = tracejit.trace(counted, without_host=True)
    model = nn.Linear(3, 3)
    outs = []
    for i in range(4):
        x = torch.full((2, 3), float(i))
        out = traced(x, model=model)
        outs.append(out)
        assert torch.equal(out, model(x).relu().detach())
    assert counted.calls == 1
    assert len({o.data_ptr() for o in outs}) == 4  # earlier results are not overwritten
    assert not outs[-1].requires_grad


def test_escaped_gradients_are_new_tensors_each_call():
    # as in eager: zero_grad() sets .grad to None, backward makes new ones; a gradient the caller
    # kept from an earlier step keeps that step's values (the program assigns, never writes into it)
    def step(x, y, *, model, opt):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    (model_a, opt_a), (model_b, opt_b) = twin(nn.Linear(4, 2), "sgd_momentum")
    counted = Counted(step)
    traced = tracejit.trace(counted, without_host=True)
    kept_a, kept_b = [], []
    for i in range(5):
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        assert torch.equal(step(x, y, model=model_a, opt=opt_a), traced(x, y, model=model_b, opt=opt_b))
        # call 0 records with no .grad; call 1 sees .grad set and records a second trace, which
        # call 2 replays checked (its first call created gradients); calls 3+ skip Python
        grads = [p.grad for p in model_b.parameters()]
        if kept_b:
            assert all(g is not old for g, old in zip(grads, kept_b[-1], strict=True)), i
        kept_a.append([p.grad for p in model_a.parameters()])
        kept_b.append(grads)
    for i, (grads_a, grads_b) in enumerate(zip(kept_a, kept_b)):
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True)), i
    assert counted.calls == 3
    assert traced.stats.host_free_calls == 2


def test_replaced_parameter_falls_back_to_a_checked_replay():
    model_a, model_b = nn.Linear(3, 2), nn.Linear(3, 2)
    model_b.load_state_dict(model_a.state_dict())
    counted = Counted(lambda x, *, model: model(x))
    traced = tracejit.trace(counted, without_host=True)
    x = torch.randn(4, 3)
    for _ in range(3):
        traced(x, model=model_b)
    assert counted.calls == 1
    new_weight = torch.randn(2, 3)
    model_a.weight = nn.Parameter(new_weight.clone())
    model_b.weight = nn.Parameter(new_weight.clone())
    assert torch.equal(traced(x, model=model_b), model_a(x))  # guard failed: the function ran
    assert counted.calls == 2
    assert torch.equal(traced(x, model=model_b), model_a(x))  # rebound: host-free again
    assert counted.calls == 2


def test_parameter_data_swap_is_noticed():
    model = nn.Linear(3, 2)
    counted = Counted(lambda x, *, model: model(x))
    traced = tracejit.trace(counted, without_host=True)
    x = torch.randn(4, 3)
    traced(x, model=model), traced(x, model=model)
    with torch.no_grad():
        model.weight.data = torch.randn(2, 3)  # same object, new storage: hoisted views are stale
    assert torch.equal(traced(x, model=model), model(x))
    assert counted.calls == 2


def test_primitive_keyword_change_runs_the_function():
    counted = Counted(lambda x, *, scale, model: model(x) * scale)
    traced = tracejit.trace(counted, without_host=True)
    model = nn.Linear(2, 2)
    x = torch.randn(3, 2)
    traced(x, scale=2.0, model=model), traced(x, scale=2.0, model=model)
    assert counted.calls == 1
    assert torch.equal(traced(x, scale=3.0, model=model), model(x) * 3.0)
    assert counted.calls == 2


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, compared exactly: torch.equal calls -0.0 equal to 0.0 and a NaN unequal to itself."""
    return t.reshape(-1).view(torch.uint8)


def assert_same_result(got: torch.Tensor, want: torch.Tensor, where: object) -> None:
    assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want)), (where, got, want)


def _times(x, *, k):
    return x * k


def _plus(x, *, k):
    return x + k


@pytest.mark.parametrize("backend", ["aten", "c"])
def test_a_keyword_number_of_another_type_runs_the_function(backend):
    """`k=2`, then `k=2.0`: equal numbers, yet `x_int32 * 2.0` is float32. The guard compared with
    `!=`, so the program recorded for the int kept returning int32. Now a number of another type
    misses the guard and the call runs the function, which raises as a checked call does. `True`,
    then `1`: the int selects another trace (bool + 1 is int64) instead of the bool's program."""
    x = torch.tensor([1, 2, 3], dtype=torch.int32)
    traced = tracejit.trace(_times, without_host=True, backend=backend)
    for _ in range(3):
        assert_same_result(traced(x, k=2), x * 2, "k=2")
    assert traced.stats.host_free_calls == 2
    with pytest.raises(tracejit.TraceMismatchError, match="a scalar of another type, <float> instead of <int>"):
        traced(x, k=2.0)
    flags = torch.tensor([True, False])
    traced = tracejit.trace(_plus, without_host=True, backend=backend)
    for k in (True, True, True, 1, 1, 1):
        assert_same_result(traced(flags, k=k), _plus(flags, k=k), f"k={k!r}")
    assert traced.stats.host_free_calls == 4 and traced.stats.records == 2


def _divided(x, *, k):
    return x / k


_DIVISOR = 0.5


def _divided_by_global(x):
    return x / _DIVISOR


@pytest.mark.parametrize("backend", ["aten", "c"])
def test_a_float_keyword_is_compared_bit_for_bit(backend):
    """`0.0 == -0.0`, yet `x / -0.0` is -inf where `x / 0.0` is inf: the guard let -0.0 pass as the
    recorded 0.0. A NaN, equal to no NaN, missed the guard on every call: none ran without the host."""
    x = torch.tensor([1.0, -2.0, 3.0])
    traced = tracejit.trace(_divided, without_host=True, backend=backend)
    nan = float("nan")
    values = [0.5, 0.0, 0.0, -0.0, -0.0, nan, nan, nan]
    for k in values:
        assert_same_result(traced(x, k=k), _divided(x, k=k), f"k={k!r}")
    assert traced.stats.host_free_calls == 4  # the second 0.0, the second -0.0, the last two NaNs


def test_a_float_global_or_closure_is_compared_bit_for_bit():
    """The same for a number the function reads from a global or closure cell (record/names.py's
    same_value)."""
    global _DIVISOR
    divisor = 0.5

    def closed(x):
        return x / divisor

    x = torch.tensor([1.0, -2.0, 3.0])
    for function in (_divided_by_global, closed):
        traced = tracejit.trace(function, without_host=True, backend="aten")
        for value in (0.5, 0.0, 0.0, -0.0, -0.0):
            _DIVISOR = divisor = value
            assert_same_result(traced(x), function(x), (function.__name__, value))
        assert traced.stats.host_free_calls == 2, function.__name__
    _DIVISOR = 0.5


def test_verify_every_runs_a_checked_replay_and_catches_divergence():
    state = {"op": "relu"}

    def f(x, *, model):
        y = model(x)
        return y.relu() if state["op"] == "relu" else y.sigmoid()

    counted = Counted(f)
    traced = tracejit.trace(counted, without_host=True, verify_every=3)
    model = nn.Linear(2, 2)
    x = torch.randn(3, 2)
    for _ in range(7):
        traced(x, model=model)
    assert counted.calls == 3  # the record, then the 3rd and 6th calls after it were checked
    state["op"] = "sigmoid"
    traced(x, model=model), traced(x, model=model)  # host-free: the change goes unseen...
    with pytest.raises(tracejit.TraceMismatchError, match="aten.sigmoid.default instead of aten.relu.default"):
        traced(x, model=model)  # ...until the next verification


def test_inference_with_capture_as_const_folds_weights():
    model = make_model("mlp").eval()

    @tracejit.trace(capture_as_const=True, without_host=True)
    def infer(x):
        with torch.no_grad():
            return model(x)

    for i in range(3):
        x, _ = batch("mlp", i)
        with torch.no_grad():
            assert torch.equal(infer(x), model(x))
    source = infer.program_source()
    assert "aten.t.default" not in source.split("def init")[0]  # folded at compile time
    assert any(name == "fold_constants" for name, _, _ in infer.history)


def test_program_source_before_any_host_free_program():
    traced = tracejit.trace(lambda x: x + 1, without_host=True)
    with pytest.raises(RuntimeError, match="no host-free program yet"):
        traced.program_source()


def test_host_free_function_called_inside_another_trace_is_refused():
    inner = tracejit.trace(lambda x: x * 2, without_host=True)
    x = torch.ones(2)
    inner(x), inner(x)  # host-free from now on

    @tracejit.trace
    def outer(x):
        return inner(x) + 1

    with pytest.raises(RuntimeError, match="is being traced"):
        outer(x)


def test_without_host_submodule_eval():
    def forward(x, *, model):
        return model(x)

    def between(i, objects):
        objects["model"].drop.train(i % 2 == 0)

    side_by_side(tracejit.trace(forward, without_host=True), forward, {"model": CNN()},
                 lambda i: (batch("cnn", i)[0],), 4, between, records=2)  # dropout on, dropout off


def test_without_host_inputs_that_stop_being_the_same_tensor():
    def f(x, y):
        x.add_(1)
        return y * 2

    traced = tracejit.trace(f, without_host=True)
    for same in (True, True, False):
        a = torch.randn(3)
        b = a if same else torch.randn(3)
        a_eager = a.clone()
        b_eager = a_eager if same else b.clone()
        want = f(a_eager, b_eager)
        assert torch.equal(traced(a, b), want)
        assert torch.equal(a, a_eager) and torch.equal(b, b_eager)
    assert_replayed(traced, 3, records=2)  # f(x, x), f(x, y)


# The learning rate a host-free call binds is the one the last host-run call used, found by the
# value that call saw (not the value recorded on the first call).
def test_without_host_lr_survives_a_rebind():
    model = nn.Linear(4, 2)
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    step = step_of(lambda model, x, flag: mse(model, x))
    traced = tracejit.trace(step, without_host=True)
    for i in range(6):
        x = torch.randn(3, 4)
        flag = int(i == 3)  # another keyword value: the guard fails, the function runs and rebinds
        # (an int: a bool keyword would select a trace of its own)
        assert torch.equal(step(x, model=model, opt=opts[0], flag=flag), traced(x, model=twin, opt=opts[1], flag=flag))
        for opt in opts:
            opt.param_groups[0]["lr"] *= 0.5
    assert torch.equal(model.weight, twin.weight)
    assert traced.stats.records == 1 and traced.stats.host_free_calls >= 3  # the rebinding call is a checked one


def test_without_host_lr_of_a_group_changed_before_the_re_record():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": model[2].parameters(), "lr": 0.01, "momentum": 0.5}])

    def between(i, objects):
        objects["opt"].param_groups[0]["lr"] = 0.1 / (i + 1)

    step = step_of(mse)
    side_by_side(tracejit.trace(step, without_host=True), step, {"model": model, "opt": opt}, seeded(5, 4), 5, between)


@pytest.mark.parametrize("opt_name", ["sgd", "sgd_momentum", "adam_fused"])
def test_learning_rate_warm_up_from_zero_is_followed(opt_name):
    # issue 11.6: a learning rate of 0 on the call that binds it used to stay 0 for good
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), opt_name)
    warm_up = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: s / 4) for o in (opt_a, opt_b)]
    traced = tracejit.trace(train_step, without_host=True, backend="aten")
    for i in range(6):
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), train_step(x, y, model=model_a, opt=opt_a))
        for scheduler in warm_up:
            scheduler.step()
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    assert traced.stats.host_free_calls >= 4


class _DefaultDtype:
    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        self.saved = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.saved)


class _Deterministic:
    def __enter__(self):
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("context, misses", [
    (lambda: torch.inference_mode(), 0), (lambda: _DefaultDtype(torch.float64), 0), (lambda: _Deterministic(), 0),
    # autocast entered around each call caches its weight casts per context: traced calls run
    # without the cache, so the casts are ops of the trace and no later context misses
    (lambda: torch.autocast("cpu", dtype=torch.bfloat16), 0),
], ids=["inference_mode", "default_dtype", "deterministic", "autocast"])
def test_a_call_in_another_context_is_the_context_s_result(context, misses):
    # issue 11.8: the caller's context decides the ops (autocast, the default dtype of a constant)
    # or whether outputs need a graph: each context gets a trace of its own, recorded in it, in
    # both directions (recorded in one, called in the other, then back)
    lin = nn.Linear(4, 4)

    def f(x, *, lin):
        return lin(x) + torch.ones(4)  # the default dtype decides the constant's dtype

    traced = tracejit.trace(f, without_host=True, backend="aten")
    x = torch.randn(2, 4)
    with torch.no_grad():
        for inside in (False, False, False, True, True, True, False, False):
            with context() if inside else contextlib.nullcontext():
                want, got = f(x, lin=lin), traced(x, lin=lin)
            assert got.dtype == want.dtype and torch.equal(got, want)
    stats = traced.stats
    assert stats.records == 2 and stats.host_free_calls >= 4 and stats.host_free_misses == misses, stats


@pytest.mark.parametrize("without_host", [True, False], ids=["without_host", "checked"])
def test_a_view_taken_before_an_update_and_read_after_it(without_host):
    # issue 11.9: the view's node was removed as dead code (only its version after the update is
    # read), leaving the generated program without it
    def step(x, *, model, opt):
        row = model.weight[0]
        loss = model(x).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return (row * 1.0).detach()  # with its graph, the caller could backpropagate: aten level

    torch.manual_seed(0)
    model_a = nn.Linear(4, 3)
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = torch.optim.SGD(model_a.parameters(), lr=0.1), torch.optim.SGD(model_b.parameters(), lr=0.1)
    traced = tracejit.trace(step, without_host=without_host, backend="aten")
    for _ in range(5):
        x = torch.randn(2, 4)
        assert torch.equal(traced(x, model=model_b, opt=opt_b), step(x, model=model_a, opt=opt_a))
    assert traced.stats.host_free_calls + traced.stats.api_replays >= 3


@pytest.mark.parametrize("backend", ["aten", "c"])
def test_a_returned_view_of_an_input_updated_after_it_was_taken(backend):
    # found by the view fuzzer: the returned view's only node was removed as dead code (the
    # output is its version after the update), so the generated program raised NameError
    def step(x):
        xt = x.t()
        doubled = x * 2
        x.add_(x)
        return doubled, xt

    traced = tracejit.trace(step, without_host=True, backend=backend)
    for i in range(4):
        x = torch.randn(3, 5)
        x_eager = x.clone()
        got, want = traced(x), step(x_eager)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), i
        assert torch.equal(x, x_eager)
        assert got[1]._base is x  # still a view of the caller's tensor, as in eager
    assert traced.stats.host_free_calls == 3


@pytest.mark.parametrize("backend", ["aten", "c"])
def test_a_returned_view_of_a_detached_alias_keeps_its_values(backend):
    # found by the view fuzzer: the alias (`x.detach()`) stays alive after the call as the `_base`
    # of the returned view, which counted as Python state: later calls wrote their values into
    # it, so into the first call's input and everything it returned
    def step(x):
        alias = x.detach()
        x.add_(x)
        return alias.t(), x.t()

    traced = tracejit.trace(step, without_host=True, backend=backend)
    calls = []
    for i in range(4):
        x = torch.randn(3, 5)
        x_eager = x.clone()
        got, want = traced(x), step(x_eager)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), i
        calls.append((x, got, x_eager, [w.clone() for w in want]))
    for i, (x, got, x_eager, want) in enumerate(calls):
        assert torch.equal(x, x_eager), f"call {i + 1}'s input changed by a later call"
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), f"call {i + 1}'s results changed"
    assert traced.stats.host_free_calls == 3


def test_an_input_whose_shape_the_call_changes_in_place():
    # found by the view fuzzer: the signature guard was built from the input after the recording
    # call had transposed it (`x.t_()`), so every later call missed and ran the function
    def step(x):
        view = x.t()
        x.t_()
        return view * 1.0, x

    traced = tracejit.trace(step, without_host=True)
    for i in range(4):
        x = torch.randn(2, 5)
        x_eager = x.clone()
        got, want = traced(x), step(x_eager)
        assert x.shape == x_eager.shape == (5, 2) and x.stride() == x_eager.stride(), i
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), i
        assert got[1] is x
    assert traced.stats.host_free_calls == 3


@pytest.mark.parametrize("without_host", [True, False], ids=["without_host", "checked"])
def test_captured_weights_given_new_memory_are_a_mismatch_not_stale(without_host):
    # issue 11.12: `module.weight.data = new` kept the object and its version: stale weights, silently
    lin = nn.Linear(3, 2).eval()
    traced = tracejit.trace(lambda x, *, lin: lin(x), without_host=without_host, capture_as_const=True)
    x = torch.randn(4, 3)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(traced(x, lin=lin), lin(x))
        lin.weight.data = torch.randn(2, 3)
        with pytest.raises(tracejit.TraceMismatchError, match=r"lin.weight\) has other memory than when it was captured"):
            traced(x, lin=lin)


@pytest.mark.parametrize("without_host", [True, False], ids=["without_host", "checked"])
def test_a_captured_parameter_replaced_by_another_is_a_mismatch_not_stale(without_host):
    # the host-free guards checked the captured tensor itself, not that the function still reaches it
    lin = nn.Linear(3, 2).eval()
    traced = tracejit.trace(lambda x, *, lin: lin(x), without_host=without_host, capture_as_const=True)
    x = torch.randn(4, 3)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(traced(x, lin=lin), lin(x))
        assert traced.stats.host_free_calls == (2 if without_host else 0)
        lin.weight = nn.Parameter(torch.randn(2, 3))
        with pytest.raises(tracejit.TraceMismatchError, match=r"lin.weight\) is a different tensor object now"):
            traced(x, lin=lin)


def test_a_forward_whose_backward_runs_outside_warns_once():
    # issue 11.13: the gradients of calls after the first were lost silently
    lin = nn.Linear(3, 2)
    traced = tracejit.trace(lambda x, *, lin: lin(x), without_host=True)
    with pytest.warns(tracejit.GradientWarning, match="require grad and runs no backward") as warned:
        for _ in range(4):
            out = traced(torch.randn(4, 3), lin=lin)
    assert len([w for w in warned if w.category is tracejit.GradientWarning]) == 1
    assert not out.requires_grad  # a backward from it fails loudly rather than dropping gradients
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()


def _mlp_twins(make_optimizer):
    torch.manual_seed(0)
    model_a = make_model("mlp")
    model_b = copy.deepcopy(model_a)
    return (model_a, make_optimizer(model_a.parameters())), (model_b, make_optimizer(model_b.parameters()))


def _train_with_settings(make_optimizer, change, steps=8):
    """Eager and without_host training side by side; `change(opt, step)` edits the settings
    (or returns schedulers to step) before each call. Returns the trace's stats."""
    (model_a, opt_a), (model_b, opt_b) = _mlp_twins(make_optimizer)
    schedulers = [s for opt in (opt_a, opt_b) for s in (change(opt, -1) or [])]
    traced = tracejit.trace(train_step, without_host=True, backend="aten")
    for i in range(steps):
        for opt in (opt_a, opt_b):
            change(opt, i)
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), train_step(x, y, model=model_a, opt=opt_a)), i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
        for scheduler in schedulers:
            scheduler.step()
    return traced.stats


def _at_step(key, value, step=4):
    def change(opt, i):
        if i == step:
            opt.param_groups[0][key] = value
    return change


def _one_cycle(opt, i):
    if i < 0:
        return [torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20)]


SGD_DAMPENED = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9, dampening=0.1, foreach=True)
ADAM_FUSED = functools.partial(torch.optim.Adam, lr=0.01, fused=True)


@pytest.mark.parametrize("make_optimizer, change", [
    (SGD_DAMPENED, _at_step("dampening", 0.2)),  # reaches the program as 1 - dampening
    (ADAM_FUSED, _at_step("weight_decay", 0.1)),  # from 0: SGD would run other ops, so zeroness is guarded
    (SGD_DAMPENED, _at_step("momentum", 0.7)),  # 0.9 is also 1 - dampening's value: not bound, guarded
    (functools.partial(torch.optim.SGD, lr=0.01), lambda opt, i: i == 4 and opt.add_param_group(
        {"params": [opt.param_groups[0]["params"].pop()], "lr": 0.05})),
], ids=["dampening", "weight_decay_from_zero", "momentum_like_dampening", "add_param_group"])
def test_changed_optimizer_settings_are_followed(make_optimizer, change):
    # issue 11.7: only lr was rebound; momentum, betas, weight decay... froze
    stats = _train_with_settings(make_optimizer, change)
    # the changed setting made that call a checked one (a new param group: a trace of its own,
    # since the number of groups is part of the gradient state)...
    assert stats.host_free_misses + (stats.records - 1) == 1, stats
    assert stats.host_free_calls >= 5  # ...which bound the new numbers


@pytest.mark.parametrize("make_optimizer", [
    functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9),
    functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-3, foreach=True),
    ADAM_FUSED,
    functools.partial(torch.optim.AdamW, lr=0.01, fused=True, weight_decay=0.1),
], ids=["sgd", "sgd_nesterov_foreach", "adam_fused", "adamw_fused"])
def test_scheduled_momentum_and_betas_stay_host_free(make_optimizer):
    # OneCycleLR cycles SGD's momentum or Adam's beta1 every step: they are read from param_groups
    # on every call like lr, not guarded (which made every call a checked one)
    stats = _train_with_settings(make_optimizer, _one_cycle)
    assert stats.host_free_misses == 0 and stats.host_free_calls >= 6


@pytest.mark.parametrize("make_optimizer, change", [
    (functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9, foreach=True), "nesterov"),
    (functools.partial(torch.optim.SGD, lr=0.01), "maximize"),
    (ADAM_FUSED, "maximize"),
    (functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9), "params_reordered"),
], ids=["sgd_nesterov", "sgd_maximize", "adam_maximize", "params_reordered"])
def test_a_setting_that_changes_the_ops_is_followed(make_optimizer, change):
    # a guarded setting that changed makes the call a checked one; one that changes which ops the
    # optimizer runs (or which tensors it updates) diverges inside torch's own step(): the call
    # records again from there (replay.branching_step; it raised TraceMismatchError before), as
    # eager runs it, and later calls run without the host again
    (model_a, opt_a), (model_b, opt_b) = _mlp_twins(make_optimizer)
    traced = tracejit.trace(train_step, without_host=True, backend="aten")
    for i in range(8):
        if i == 4:
            for opt in (opt_a, opt_b):
                group = opt.param_groups[0]
                if change == "params_reordered":
                    group["params"].reverse()
                else:
                    group[change] = True
            rerecords, host_free = traced.stats.rerecords, traced.stats.host_free_calls
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), train_step(x, y, model=model_a, opt=opt_a)), i
        assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters())), i
    assert traced.stats.rerecords == rerecords + 1, traced.stats
    assert traced.stats.host_free_calls > host_free, traced.stats


def test_a_parameter_taken_out_of_the_optimizer_records_again_and_follows_eager():
    # fewer parameters of the groups hold state than after the recorded call: the call records
    # again (it used to raise TraceMismatchError), then runs without the host
    (model_a, opt_a), (model_b, opt_b) = _mlp_twins(functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9))
    traced = tracejit.trace(train_step, without_host=True, backend="aten")
    for i in range(9):
        if i == 4:
            opt_a.param_groups[0]["params"].pop(0)
            opt_b.param_groups[0]["params"].pop(0)
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), train_step(x, y, model=model_a, opt=opt_a))
        assert all(torch.equal(p, q) for p, q in zip(model_a.parameters(), model_b.parameters())), i
    assert traced.stats.host_free_calls >= 5


def test_every_bound_setting_follows_its_schedule():
    def change(opt, i):
        group = opt.param_groups[0]
        group["betas"] = (0.8 + 0.01 * i, 0.99 - 0.001 * i)
        group["eps"] = 1e-8 * (i + 1)
        group["weight_decay"] = 0.1 + 0.01 * i
        group["lr"] = 0.01 / (i + 2)

    stats = _train_with_settings(functools.partial(torch.optim.AdamW, lr=0.01, fused=True, weight_decay=0.1), change)
    assert stats.host_free_misses == 0 and stats.host_free_calls >= 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32], ids=str)
@pytest.mark.parametrize("backend", ["aten", "c"])
@pytest.mark.parametrize("bounds", ["min", "max", "both", "method", "clamp_min_max"])
def test_clamp_with_tensor_bounds(bounds, backend, dtype):
    # issue 15.2: the program called clamp's number overload (clamp.out) for clamp.Tensor
    functions = {
        "min": lambda a, b: torch.clamp(a, min=b) * 1,
        "max": lambda a, b: torch.clamp(a, max=b) * 1,
        "both": lambda a, b: torch.clamp(a, min=b, max=b + 1) * 1,
        "method": lambda a, b: a.clamp(max=b) * 1,
        "clamp_min_max": lambda a, b: torch.clamp_min(a, b) + torch.clamp_max(a, b),
    }
    function = functions[bounds]
    traced = tracejit.trace(function, without_host=True, backend=backend)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        a, b = (torch.randn(64, generator=g) * 5).to(dtype), (torch.randn(64, generator=g) * 5).to(dtype)
        assert torch.equal(traced(a, b), function(a, b))
    assert traced.stats.host_free_calls == 3


def _same_gradients(model_a, model_b):
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert (a.grad is None) == (b.grad is None)
        assert a.grad is None or torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("backend", ["aten", "c"])
def test_a_gradient_the_user_sets_before_the_call_is_accumulated_into(backend):
    # issue 11.10: a .grad set by the user before a call (a gradient penalty computed outside, a
    # warm start) is freed by zero_grad during the call; binding the program to it raised KeyError
    # after the model was updated. Now: the call accumulates into it as eager does.
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "sgd_momentum")
    traced = tracejit.trace(train_step, without_host=True, backend=backend)
    for i in range(8):
        if i in (3, 4, 6):
            for model in (model_a, model_b):
                weight = model.net[0].weight
                weight.grad = torch.full_like(weight, 0.01 * i)
        x, y = batch("mlp", i)
        want = train_step(x, y, model=model_a, opt=opt_a)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), want), i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=backend == "aten")
    assert traced.stats.host_free_calls >= 3, traced.stats


@pytest.mark.parametrize("backend", ["aten", "c"])
def test_a_tensor_the_function_assigns_to_a_module_is_new_on_every_call(backend):
    # eager assigns a new tensor on every call: a history of them kept by the user held the last
    # call's value everywhere, as the program wrote each new value into the previous tensor
    def step(x, *, model, opt):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.last = loss.detach() * 1
        model.register_buffer("seen", x.sum(0, keepdim=True) + 0, persistent=False)
        return loss

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    traced = tracejit.trace(step, without_host=True, backend=backend)
    history, expected = [], []
    for _ in range(6):
        x = torch.randn(8, 4)
        loss = traced(x, model=model, opt=opt)
        history.append((model.last, model.seen))
        expected.append((loss.clone(), x.sum(0, keepdim=True)))
    for (last, seen), (loss, total) in zip(history, expected):
        assert torch.equal(last, loss) and torch.allclose(seen, total)
    assert traced.stats.host_free_calls >= 3


class Averaged(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("last", torch.zeros(4))


def averaged_step(x, *, model, opt):
    h = torch.tanh(model.fc(x))
    with torch.no_grad():
        model.ema.mul_(0.9).add_(h.mean(0), alpha=0.1)
    model.last = h.mean(0).detach()  # a view of an equal mean: one mean once CSE merged them
    loss = h.pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("backend", ["aten", "c"])
def test_a_module_attribute_assigned_a_view_of_a_merged_value_holds_it(backend):
    # the assigned view kept the merged-away mean as its storage: plan_memory gave the kept mean's
    # arena slot to later values while model.last still showed it (-2.41 for a mean of tanh). The
    # re-record for Adam's lazy state left the mean itself unflagged, so CSE could merge it.
    torch.manual_seed(0)
    model = Averaged()
    eager = copy.deepcopy(model)
    opt, eager_opt = (torch.optim.Adam(m.parameters(), lr=0.01, fused=True) for m in (model, eager))
    traced = tracejit.trace(averaged_step, without_host=True, backend=backend)
    kept = []
    for _ in range(6):
        x = torch.randn(5, 4)
        torch.testing.assert_close(traced(x, model=model, opt=opt), averaged_step(x, model=eager, opt=eager_opt))
        kept.append((model.last, eager.last))
        for got, want in kept:  # each call's tensor keeps its values
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(model.ema, eager.ema)
    assert traced.stats.rerecords == 1 and traced.stats.host_free_calls == 4


@pytest.mark.parametrize("options", [{"symbolic": True}, {"symbolic": True, "without_host": True}, {"without_host": True}, {}],
                         ids=["symbolic", "symbolic_without_host", "without_host", "checked"])
def test_two_reshapes_of_a_transposed_input_are_two_tensors(options):
    # found by the view fuzzer: reshape of a non-contiguous tensor is _unsafe_view(clone(x)), whose
    # output shares the clone's memory without its schema saying so. Recorded symbolically, the two
    # clones looked unwritten and were merged, so v2.mul_(2) doubled v1 too.
    def f(v0):
        v1 = v0.reshape(-1)
        v2 = v0.reshape(-1)
        v0.add_(v0)
        v2.mul_(2)
        return v1, v2

    traced = tracejit.trace(f, backend="aten", **options)
    for i in range(4):
        base = torch.arange(24.0).reshape(6, 4) + i
        a, b = base.clone().t(), base.clone().t()
        want, got = f(a), traced(b)
        assert all(torch.equal(w, g) for w, g in zip(want, got)) and torch.equal(a, b), i
    assert traced.stats.records == 1


def test_gradient_accumulation_that_frees_the_gradients_it_read():
    # issue 11.10: the stepping call reads the accumulated .grad and frees it (zero_grad sets None);
    # binding the program to that freed external raised KeyError after the model was updated
    def step(x, y, *, model, opt, do_step):
        F.mse_loss(model(x), y).backward()
        if do_step:
            opt.step()
            opt.zero_grad(set_to_none=True)

    (model_a, opt_a), (model_b, opt_b) = twin(nn.Linear(4, 2), "sgd_momentum")
    traced = tracejit.trace(step, without_host=True, backend="aten")
    for i in range(9):
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        step(x, y, model=model_a, opt=opt_a, do_step=i % 2 == 1)
        traced(x, y, model=model_b, opt=opt_b, do_step=i % 2 == 1)
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
        _same_gradients(model_a, model_b)
    assert traced.stats.host_free_calls >= 3  # the accumulating calls, from the same .grad state


def test_gradients_reach_param_grad_when_zeroed_outside_the_call():
    # a host-free call wrote the gradients into the .grad objects of the host-run call, which
    # zero_grad() outside the call had detached: param.grad stayed None
    def step(x, *, model, opt):
        loss = model(x).pow(2).sum()
        loss.backward()
        opt.step()
        return loss

    (model_a, opt_a), (model_b, opt_b) = twin(nn.Linear(4, 2), "sgd")
    traced = tracejit.trace(step, without_host=True, backend="aten")
    for _ in range(5):
        x = torch.randn(3, 4)
        kept = [p.grad for p in model_b.parameters()]  # a reference held by the user stays as it was
        frozen = [None if g is None else g.clone() for g in kept]
        assert torch.equal(traced(x, model=model_b, opt=opt_b), step(x, model=model_a, opt=opt_a))
        _same_gradients(model_a, model_b)
        assert all(g is None or torch.equal(g, f) for g, f in zip(kept, frozen))
        for opt in (opt_a, opt_b):
            opt.zero_grad(set_to_none=True)
    assert traced.stats.host_free_calls >= 3


class _Keeper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("ema", torch.zeros(3, 3))

    def forward(self, x):
        out = self.lin(x)
        self.last = out  # a plain attribute
        self.ema = out * 0.5  # a buffer, given a new tensor
        return out, self.ema


def test_returned_tensors_kept_in_module_state_are_the_new_ones():
    # the host-free call returned fresh tensors but left the module holding the last host-run call's
    model_a = _Keeper()
    model_b = copy.deepcopy(model_a)

    def f(x, *, model):
        with torch.no_grad():
            return model(x)

    traced = tracejit.trace(f, without_host=True, backend="aten")
    kept = []
    for _ in range(5):
        x = torch.randn(2, 3)
        want, got = f(x, model=model_a), traced(x, model=model_b)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        assert torch.equal(model_b.last, model_a.last) and torch.equal(model_b.ema, model_a.ema)
        assert model_b.last is got[0] and model_b.ema is got[1]
        kept.append((got, [t.clone() for t in got]))
    assert all(torch.equal(a, b) for got, frozen in kept for a, b in zip(got, frozen))  # unchanged since
    assert traced.stats.host_free_calls >= 3


@pytest.mark.parametrize("accumulate", [2, 3])
def test_gradient_accumulation_with_the_step_outside_the_call(accumulate):
    # the call after zero_grad() starts without .grad: its host-free run wrote the gradients into
    # the .grad objects of a host-run call that zero_grad() had dropped, so they never reached the
    # parameters and the optimizer stepped on the later calls' gradients only
    def forward_backward(x, y, *, model):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    (model_a, opt_a), (model_b, opt_b) = twin(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), "sgd_momentum")
    traced = tracejit.trace(forward_backward, without_host=True, backend="aten")
    for i in range(4 * accumulate):
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        assert torch.equal(traced(x, y, model=model_b), forward_backward(x, y, model=model_a))
        _same_gradients(model_a, model_b)
        if (i + 1) % accumulate == 0:
            for opt in (opt_a, opt_b):
                opt.step()
                opt.zero_grad()
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    # the accumulating calls read .grad where it is: the new tensor of each cycle binds too
    assert traced.stats.host_free_misses == 0 and traced.stats.host_free_calls >= 4 * accumulate - 3


def test_amsgrad_turned_on_raises_as_eager_and_updates_nothing():
    # amsgrad is guarded like every setting the program does not bind: turning it on makes the call
    # a checked one, where torch's Adam raises as in eager (its state has no max_exp_avg_sq);
    # nothing was updated, and turning it off again goes on without the host
    (model_a, opt_a), (model_b, opt_b) = _mlp_twins(ADAM_FUSED)
    traced = tracejit.trace(train_step, without_host=True, backend="aten")
    for i in range(4):
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), train_step(x, y, model=model_a, opt=opt_a))
    before = [p.detach().clone() for p in model_b.parameters()]
    for opt in (opt_a, opt_b):
        opt.param_groups[0]["amsgrad"] = True
    x, y = batch("mlp", 4)
    with pytest.raises(KeyError, match="max_exp_avg_sq"):
        train_step(x, y, model=model_a, opt=opt_a)
    with pytest.raises(KeyError, match="max_exp_avg_sq"):
        traced(x, y, model=model_b, opt=opt_b)
    assert all(torch.equal(p, q) for p, q in zip(before, model_b.parameters()))
    assert torch.is_grad_enabled()
    for opt in (opt_a, opt_b):
        opt.param_groups[0]["amsgrad"] = False
        opt.zero_grad()
    calls = traced.stats.host_free_calls
    for i in range(5, 8):
        x, y = batch("mlp", i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), train_step(x, y, model=model_a, opt=opt_a))
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    assert traced.stats.host_free_calls > calls


def test_a_returned_leaf_the_function_flagged_requires_grad_keeps_the_flag():
    # requires_grad_() is Python, never dispatched: from the second call on the program's tensor
    # came back without the flag (values right); and no GradientWarning for a leaf, which has no
    # graph to lose
    def perturbation(x):
        delta = (torch.zeros_like(x) + 0.1 * x.sign()).requires_grad_()
        return delta, x * 2

    traced = tracejit.trace(perturbation, without_host=True, backend="aten")
    with warnings.catch_warnings():
        warnings.simplefilter("error", tracejit.GradientWarning)
        for _ in range(4):
            x = torch.randn(5)
            (delta, double), (want_delta, want_double) = traced(x), perturbation(x)
            assert torch.equal(delta, want_delta) and torch.equal(double, want_double)
            assert delta.requires_grad and delta.is_leaf and not double.requires_grad
            delta.sum().backward()  # a leaf of the caller's own graph
            assert torch.equal(delta.grad, torch.ones(5))
    assert traced.stats.host_free_calls == 3


class _Scaled(nn.Module):
    def forward(self, x):
        self.scale = torch.tensor([1.0, 2.0, 3.0])  # left in the module: a new tensor on every eager call
        return (x * self.scale,)


def _literal_returned(x, *, model):
    c = torch.tensor([1.0, 2.0, 3.0])
    return c, x * c


def _literal_view_returned(x, *, model):
    c = torch.tensor([0.0, 1.0, 2.0, 3.0])[1:]
    return c, x * c


def _literal_updated_and_returned(x, *, model):
    c = torch.tensor([1.0, 2.0, 3.0])
    c.add_(x)
    return c, x * c


def _literal_updated_inside(x, *, model):
    c = torch.tensor([1.0, 2.0, 3.0])
    c.mul_(x)
    return (x + c,)


def _literal_kept_by_a_module(x, *, model):
    return model(x)


@pytest.mark.parametrize("function", [_literal_returned, _literal_view_returned, _literal_updated_and_returned,
                                      _literal_updated_inside, _literal_kept_by_a_module],
                         ids=["returned", "view", "updated", "updated_inside", "module_attribute"])
@pytest.mark.parametrize("options", [{"without_host": True, "backend": "aten"}, {"without_host": True, "backend": "c"},
                                     {"backend": "aten"}], ids=["aten", "c", "checked"])
def test_a_tensor_made_from_python_data_is_new_on_every_call(function, options):
    # torch.tensor(data) makes a tensor on every eager call. Without the host the program returned
    # the record's own literal on every call (and computed with it): a caller scaling what it got
    # (legal, nothing a call returned changes afterwards) changed every later call's results; a
    # literal updated in place inside the call accumulated over calls. Checked calls noticed the
    # change ("a captured constant changed") and left the API level for good.
    model_a, model_b = _Scaled(), _Scaled()
    kept_a, kept_b = [], []
    traced = tracejit.trace(function, **options)
    for i in range(6):
        x = torch.full((3,), float(i + 1))
        want, got = function(x, model=model_a), traced(x, model=model_b)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), i
        for a, b in zip(want, got):
            assert b.is_contiguous() == a.is_contiguous() and (b._base is None) == (a._base is None)
        if function is _literal_kept_by_a_module:
            assert torch.equal(model_b.scale, model_a.scale), i
            model_a.scale.mul_(10)
            model_b.scale.mul_(10)
        for a, b in zip(want, got):  # the caller scales what it got back, in eager as here
            a.mul_(10)
            b.mul_(10)
        kept_a.append(want)
        kept_b.append(got)
    for want, got in zip(kept_a, kept_b):  # and no later call changed what an earlier one returned
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    stats = traced.stats
    if options.get("without_host"):
        assert stats.host_free_calls >= 3 and stats.host_free_misses == 0, stats
    else:
        assert stats.api_replays >= 2 and stats.api_fallbacks == 0, stats


def _features_under_inference_mode(x, *, model):
    a = x * 2
    with torch.inference_mode():
        y = model(a)  # BatchNorm in training mode: its running statistics are updated in place
        total = y.sum(0)
    return a, y, total, y + 1


def _features_leaving_inference_mode(x, *, model):
    with torch.inference_mode(False):  # called under torch.inference_mode()
        a = x * 2
    y = model(a)
    return a, y, y.sum(0)


@pytest.mark.parametrize("function, caller", [
    (_features_under_inference_mode, contextlib.nullcontext),
    (_features_leaving_inference_mode, torch.inference_mode),
], ids=["inside", "left_inside"])
@pytest.mark.parametrize("options", [{"without_host": True, "backend": "aten"}, {"without_host": True, "backend": "c"},
                                     {"backend": "aten"}], ids=["aten", "c", "checked"])
def test_results_made_under_inference_mode_are_inference_tensors(function, caller, options):
    # Which results are inference tensors is eager's: those the ops made inside
    # torch.inference_mode(). The program ran every op in the call's mode, so from the first call
    # that did not run the function they were ordinary tensors (an in-place update outside
    # inference mode, which eager refuses, went through), or inference tensors where the function
    # had left inference mode.
    model_a = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    model_b = copy.deepcopy(model_a)
    traced = tracejit.trace(function, **options)
    for i in range(6):
        x = torch.randn(5, 4)
        with caller():
            want, got = function(x, model=model_a), traced(x, model=model_b)
        assert all(torch.allclose(a, b) for a, b in zip(got, want)), i
        assert [t.is_inference() for t in got] == [t.is_inference() for t in want], i
        assert not any(t.requires_grad for t in got)
        for name, buffer in model_b.named_buffers():  # updated in place: ordinary tensors, as eager's
            assert torch.allclose(buffer, model_a.get_buffer(name)) and not buffer.is_inference(), (i, name)
    made_inside = next(t for t in got if t.is_inference())
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        made_inside.add_(1)
    stats = traced.stats
    if options.get("without_host"):
        assert stats.host_free_calls >= 3 and stats.host_free_misses == 0, stats
    else:
        assert stats.api_replays >= 3 and stats.api_fallbacks == 0, stats
