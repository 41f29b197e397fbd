"""The contract of a traced call: return values, options (none silently ignored), what selects a trace."""

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import assert_same_state, batch, make_model, twin

import tracejit
from tracejit.options import BACKENDS, TraceOptions


def assert_same_tree(got, want):
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want) and got.dtype == want.dtype
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same_tree(got[key], want[key])
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_same_tree(a, b)
    else:
        assert got is want


RETURNS = {
    "tensor": lambda a, b, x: a,
    "tuple": lambda a, b, x: (a, b),
    "list": lambda a, b, x: [b, a, x],
    "dict": lambda a, b, x: {"b": b, "a": a},
    "nested": lambda a, b, x: {"pair": (a, [b]), "input": x, "none": None},
    "none": lambda a, b, x: None,
}


@pytest.mark.parametrize("kind", list(RETURNS))
def test_every_kind_of_return_value(trace, kind):
    side = []

    def f(x):
        a = x.exp()
        b = (a * 2).sum(0)
        side.append(b)  # for "none": the result reaches the host another way
        return RETURNS[kind](a, b, x)

    traced = trace(f)
    for i in range(3):
        x = torch.randn(2, 3) + i
        want = f(x)
        got = traced(x)
        assert_same_tree(got, want)
        assert torch.equal(side[-1], side[-2])
    assert len(traced.records) == 1


# -- options ----------------------------------------------------------------------------------------


def test_the_options_are_exactly_the_validated_ones():
    accepted = [p for p in inspect.signature(tracejit.trace.__init__).parameters if p not in ("self", "function")]
    assert accepted == list(TraceOptions.__dataclass_fields__)
    assert set(accepted) >= {"capture_as_const", "opt_level", "max_traces", "symbolic", "without_host", "profiling"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_value_works_or_names_itself_as_unimplemented(backend):
    try:
        traced = tracejit.trace(lambda x: (x * 2).relu() + 1, backend=backend)
    except NotImplementedError as error:  # an option a later issue implements: refused, never ignored
        assert f"backend={backend!r}" in str(error)
        return
    except RuntimeError as error:  # a backend whose toolchain is missing here says so
        assert f"backend={backend!r} needs" in str(error)
        return
    x = torch.randn(16)
    for _ in range(3):
        assert torch.allclose(traced(x), (x * 2).relu() + 1, rtol=0, atol=1e-6)


class Counted:
    def __init__(self, function):
        self.function, self.calls, self.__name__ = function, 0, function.__name__

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)


def _scaled(x):
    return (x * 2).relu() + 1


def _observe(option):
    """Run a small traced function with one option set; return what the option changed, observably."""
    x = torch.randn(8)
    function = Counted(_scaled)
    options = {"without_host": {"without_host": True},
               "verify_every": {"without_host": True, "verify_every": 2},
               "sublinear_memory_config": {"without_host": True,
                                           "sublinear_memory_config": tracejit.SublinearMemoryConfig()},
               "opt_level": {"without_host": True, "opt_level": 0},
               }.get(option, {option: {"symbolic": True, "capture_as_const": True, "max_traces": 1,
                                       "profiling": True, "backend": "reference"}.get(option)})
    traced = tracejit.trace(function, **options)
    for _ in range(5):
        assert torch.equal(traced(x), _scaled(x))
    if option == "max_traces":
        with pytest.raises(tracejit.TraceCacheFullError):
            traced(torch.randn(3))
    return traced, function


@pytest.mark.parametrize("option", ["symbolic", "capture_as_const", "opt_level", "max_traces", "without_host",
                                    "verify_every", "profiling", "backend", "sublinear_memory_config"])
def test_no_option_is_silently_ignored(option):
    traced, function = _observe(option)
    record = traced.records[0]
    if option == "symbolic":
        assert isinstance(traced._new_recorder({}), tracejit.record.symbolic.SymbolicRecorder)
    elif option == "capture_as_const":
        assert not any(info.kind.value == "external" for info in record.tensors)
    elif option == "opt_level":
        assert [name for name, _, _ in traced.history] == ["record"]  # level 0 runs no pass
    elif option == "without_host":
        assert function.calls == 1  # recorded, then never run again
    elif option == "verify_every":
        assert function.calls == 3  # ... and every second host-free call runs it as a checked replay
    elif option == "profiling":
        assert traced.get_profile()["summary"]["calls"] == 4
    elif option == "backend":
        assert any(node.op.name == "FUSED" for node in traced._entries()[0].program.graph.nodes)
    elif option == "sublinear_memory_config":
        assert "rematerialize" in " ".join(name for name, _, _ in traced.history)


# -- what selects a trace ---------------------------------------------------------------------------


def sgd_step(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_freezing_a_layer_selects_another_trace(trace):
    # requires_grad decides which backward ops run: a toggle selects (or records) a trace, no error
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "sgd_momentum")
    traced = trace(sgd_step)
    for i, frozen in enumerate([False, False, True, True, False, True]):
        for model in (model_a, model_b):
            model.net[0].weight.requires_grad_(not frozen)
        x, y = batch("mlp", i)
        assert torch.equal(sgd_step(x, y, model=model_a, opt=opt_a), traced(x, y, model=model_b, opt=opt_b))
        assert_same_state(model_a, opt_a, model_b, opt_b)
    assert len(traced.records) == 2


def test_a_submodule_in_eval_selects_another_trace(trace):
    # BatchNorm frozen for fine-tuning: only a submodule's training flag changes
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("cnn"), "sgd")
    traced = trace(sgd_step)
    for i, bn_eval in enumerate([False, False, True, True, False, True]):
        for model in (model_a, model_b):
            model.bn1.train(not bn_eval)
            model.drop.train(not bn_eval)
        x, y = batch("cnn", i)
        torch.manual_seed(i)
        want = sgd_step(x, y, model=model_a, opt=opt_a)
        torch.manual_seed(i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), want)
        assert_same_state(model_a, opt_a, model_b, opt_b)
    assert len(traced.records) == 2


def test_the_same_tensor_in_two_argument_slots_selects_another_trace(trace):
    # an autoencoder's step(x, x), then step(x, target): the aliasing changes which handles ops read
    def f(x, y):
        x.mul_(2)
        return y + 1

    traced = trace(f)
    for same in (True, False, True, False):
        a = torch.randn(4)
        b = a if same else torch.randn(4)
        a_eager = a.clone()
        b_eager = a_eager if same else b.clone()
        assert torch.equal(traced(a, b), f(a_eager, b_eager))
        assert torch.equal(a, a_eager)
    assert len(traced.records) == 2


def add_into_first(x, y):
    x.add_(y)
    return x * 2 + 1  # the in-place add and this chain are one fused group


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
@pytest.mark.parametrize("backend", ["aten", "c"])
def test_inputs_that_overlap_in_memory_raise_eagers_overlap_error(backend, without_host):
    # Recorded on separate tensors, the compiled program (a fused C kernel) used to compute
    # x.add_(x.t()) element by element where eager refuses it.
    traced = tracejit.trace(add_into_first, backend=backend, without_host=without_host)
    for _ in range(3):
        a, b = torch.randn(3, 3), torch.randn(3, 3).t()
        want = add_into_first(a.clone(), b.clone())
        assert torch.equal(traced(a, b), want)
    for _ in range(3):
        a = torch.randn(3, 3)
        with pytest.raises(RuntimeError, match="refer to a single memory location") as eager:
            add_into_first(a, a.t())
        b = torch.randn(3, 3)
        with pytest.raises(RuntimeError) as got:
            traced(b, b.t())
        assert str(got.value) == str(eager.value)
    assert traced.stats.records == 1 and traced.stats.checked_replays + traced.stats.host_free_calls == 2
    if backend == "c" and tracejit.backends.resolve_backend("c") is not None:
        assert traced.kernel_sources()  # the program that used to compute it is a fused kernel


def test_inputs_in_one_storage_without_overlap_replay_their_own_trace():
    # x[0] and x[1]: one storage, no common element; eager computes, and so does the trace
    def f(x, y):
        x.mul_(y)
        return x + y

    traced = tracejit.trace(f, backend="c", without_host=True)
    for i in range(6):
        base = torch.randn(2, 4)
        x, y = (base[0], base[1]) if i % 2 else (torch.randn(4), torch.randn(4))
        eager_base = base.clone()
        ex, ey = (eager_base[0], eager_base[1]) if i % 2 else (x.clone(), y.clone())
        assert torch.allclose(traced(x, y), f(ex, ey))
        assert torch.equal(x, ex)
    assert traced.stats.records == 2 and traced.stats.host_free_calls >= 2


def test_the_signature_message_names_the_new_distinctions():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))

    @tracejit.trace(max_traces=1)
    def f(x, y, *, model):
        return model(x) + y

    x = torch.randn(3, 2)
    f(x, torch.randn(3, 2), model=model)
    model[1].eval()
    with pytest.raises(tracejit.TraceCacheFullError) as info:
        f(x, x, model=model)
    assert "new: (x: cpu float32[3, 2], y: cpu float32[3, 2], training, 1 of 2 submodules in eval, " \
           "input 1 is input 0, gradient state" in str(info.value)
    assert "  (x: cpu float32[3, 2], y: cpu float32[3, 2], training)" in str(info.value)
