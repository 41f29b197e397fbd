"""Findings of an adversarial hunt on composition: what the caller does around a traced call
(interrupts, torch modes, copies), and what modules hold besides parameters."""

import copy
import gc
import pickle
import weakref

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import tracejit


def _twins(optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)):
    """Two identical models with their optimizers: one for eager, one for the trace."""
    pairs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        pairs.append((model, optimizer(model.parameters())))
    return pairs


def _same_state(eager, traced):
    (model_e, opt_e), (model_t, opt_t) = eager, traced
    for p_e, p_t in zip(model_e.parameters(), model_t.parameters()):
        assert torch.equal(p_e, p_t)
        assert (p_e.grad is None) == (p_t.grad is None)
        if p_e.grad is not None:
            assert torch.equal(p_e.grad, p_t.grad)
    for p_e, p_t in zip(model_e.parameters(), model_t.parameters()):
        for key, value in opt_e.state[p_e].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_t.state[p_t][key])), key


def _train_step(x, *, model, opt):
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


class Stop(BaseException):
    """A BaseException of the user's own, as KeyboardInterrupt and SystemExit are."""


@pytest.mark.parametrize("backend", ["aten", "c"])
@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, Stop])
@pytest.mark.parametrize("after", ["backward", "step", "end"])
def test_a_base_exception_in_a_checked_call_leaves_eagers_update(backend, error, after):
    """Checked calls at the API level computed nothing when the function raised a BaseException
    that is not an Exception: the update before the raise was lost, silently."""
    def step(x, *, model, opt, stop):
        loss = model(x).square().mean()
        loss.backward()
        if stop and after == "backward":
            raise error()
        opt.step()
        if stop and after == "step":
            raise error()
        opt.zero_grad()
        if stop and after == "end":
            raise error()
        return loss

    eager, mine = _twins()
    traced = tracejit.trace(step, backend=backend)
    for i in range(10):
        x = torch.randn(3, 4)
        stop = i in (3, 7)  # each after an API-level call: the call after a raise runs at the aten level
        for function, (model, opt) in ((step, eager), (traced, mine)):
            if stop:  # an int, not a bool: one trace for both (a bool keyword selects a trace per value)
                with pytest.raises(error):
                    function(x, model=model, opt=opt, stop=1)
            else:
                function(x, model=model, opt=opt, stop=0)
        if backend == "aten":
            _same_state(eager, mine)
        else:
            for p_e, p_t in zip(eager[0].parameters(), mine[0].parameters()):
                torch.testing.assert_close(p_e, p_t)
        if stop:  # the raise may have skipped zero_grad(): the next call starts from no gradients
            eager[1].zero_grad()
            mine[1].zero_grad()
    assert traced.stats.api_replays >= 2  # the calls that did not raise ran at the API level,
    assert traced.stats.api_fallbacks == 2  # and so did the two that raised, until they raised


def test_an_interrupt_that_does_not_come_again_is_raised_after_the_call():
    """An interrupt from outside the function's logic (Ctrl-C) comes once: the aten-level run of
    the call completes, and the interrupt is raised then, not lost."""
    interrupt = {"now": False}

    def step(x, *, model, opt):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if interrupt["now"]:
            interrupt["now"] = False
            raise KeyboardInterrupt
        return loss

    eager, mine = _twins()
    traced = tracejit.trace(step)
    for i in range(7):
        x = torch.randn(3, 4)
        step(x, model=eager[0], opt=eager[1])
        interrupt["now"] = i == 3
        if i == 3:
            with pytest.raises(KeyboardInterrupt):
                traced(x, model=mine[0], opt=mine[1])
        else:
            traced(x, model=mine[0], opt=mine[1])
        _same_state(eager, mine)
    assert traced.stats.api_replays >= 2


class Net(nn.Module):
    """A module that owns its optimizer and keeps tensors in a dict, a list and a plain object."""

    class Box:
        pass

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.opt = torch.optim.Adam(self.parameters(), lr=0.01, fused=True)
        self.cache = {"t": torch.ones(2)}
        self.history = [torch.ones(2)]
        self.box = Net.Box()
        self.box.t = torch.ones(2)


def _twin_nets() -> tuple[Net, Net]:
    nets = []
    for _ in range(2):
        torch.manual_seed(0)
        nets.append(Net())
    return nets[0], nets[1]


def _module_step(x, *, model):
    loss = model.fc(x).square().mean()
    loss.backward()
    model.opt.step()
    model.opt.zero_grad()
    return loss


def test_without_the_host_an_optimizer_a_module_owns_is_guarded():
    """`model.opt.load_state_dict(...)` replaced the state tensors of an optimizer held as a module
    attribute; host-free calls went on updating the old ones."""
    eager, mine = _twin_nets()
    traced = tracejit.trace(_module_step, without_host=True)
    for i in range(8):
        x = torch.randn(3, 4)
        _module_step(x, model=eager)
        traced(x, model=mine)
        if i == 2:
            saved_e, saved_t = copy.deepcopy(eager.opt.state_dict()), copy.deepcopy(mine.opt.state_dict())
        if i == 4:
            eager.opt.load_state_dict(saved_e)
            mine.opt.load_state_dict(saved_t)
        assert torch.equal(eager.fc.weight, mine.fc.weight), i
        assert torch.equal(eager.opt.state[eager.fc.weight]["exp_avg"], mine.opt.state[mine.fc.weight]["exp_avg"]), i
        assert eager.opt.state[eager.fc.weight]["step"].item() == mine.opt.state[mine.fc.weight]["step"].item(), i
    assert traced.stats.host_free_calls >= 4 and traced.stats.host_free_misses >= 1


@pytest.mark.parametrize("place", ["cache", "history", "box"])
def test_without_the_host_a_tensor_a_module_keeps_in_a_container_is_guarded(place):
    """A tensor replaced in a module's dict, list or plain-object attribute was read stale."""
    def read(model):
        return {"cache": lambda: model.cache["t"], "history": lambda: model.history[0], "box": lambda: model.box.t}[place]()

    def put(model, tensor):
        if place == "cache":
            model.cache["t"] = tensor
        elif place == "history":
            model.history[0] = tensor
        else:
            model.box.t = tensor

    def forward(x, *, model):
        with torch.no_grad():
            return model.fc(x) + read(model)

    model = Net()
    traced = tracejit.trace(forward, without_host=True)
    for i in range(6):
        x = torch.randn(3, 4)
        if i >= 3:
            put(model, torch.full((2,), float(i)))
        assert torch.equal(traced(x, model=model), forward(x, model=model)), i
    assert traced.stats.host_free_calls >= 2 and traced.stats.host_free_misses >= 1


def test_without_the_host_a_list_inside_a_keyword_dict_is_looked_up_in_order():
    """The generated call read a list's item before looking the list up (UnboundLocalError on
    every call) for a tensor in a list inside a keyword dict."""
    def add(x, *, state):
        return x + state["history"][0]

    state = {"history": [torch.ones(2)]}
    traced = tracejit.trace(add, without_host=True)
    for i in range(5):
        if i == 3:
            state["history"][0] = torch.full((2,), 5.0)
        x = torch.randn(2)
        assert torch.equal(traced(x, state=state), add(x, state=state))
    assert traced.stats.host_free_calls >= 2


class Scale(TorchFunctionMode):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        return result * self.k if func is torch.nn.functional.linear else result


class ScaleAten(TorchDispatchMode):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        return result * self.k if func is torch.ops.aten.addmm.default else result


@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("mode", [Scale, ScaleAten])
def test_a_call_inside_the_callers_torch_mode_runs_eagerly(mode, without_host):
    """A caller's TorchFunctionMode was never consulted by the API-level checker (nor by a call
    without the host): under `Scale(5.0)` the traced call returned the unscaled result."""
    model = nn.Linear(4, 2)

    def forward(x, *, model):
        with torch.no_grad():
            return model(x)

    traced = tracejit.trace(forward, without_host=without_host)
    x = torch.randn(3, 4)
    for k in (None, None, None, 1.0, 5.0, 5.0, None):
        if k is None:
            assert torch.equal(traced(x, model=model), forward(x, model=model))
            continue
        with pytest.warns(tracejit.ReplayLevelWarning, match="mode") if traced.stats.eager_calls == 0 else _quiet():
            with mode(k):
                got = traced(x, model=model)
        with mode(k):
            assert torch.equal(got, forward(x, model=model))
    assert traced.stats.eager_calls == 3
    assert (traced.stats.host_free_calls if without_host else traced.stats.api_replays) >= 2


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_default_device_is_no_mode_that_stops_tracing():
    """`torch.set_default_device` puts a mode on the stack: calls keep replaying under it."""
    model = nn.Linear(4, 2)

    def forward(x, *, model):
        with torch.no_grad():
            return model(x) + torch.ones(2)

    traced = tracejit.trace(forward)
    torch.set_default_device("cpu")
    try:
        for _ in range(4):
            x = torch.randn(3, 4)
            assert torch.equal(traced(x, model=model), forward(x, model=model))
    finally:
        torch.set_default_device(None)
    assert traced.stats.eager_calls == 0 and traced.stats.api_replays >= 2


def test_a_traced_function_copies_without_its_traces_and_pickles_by_name():
    """copy.copy raised "invalid partial state", deepcopy and pickle failed on a lock."""
    copied = copy.copy(_doubled)
    deep = copy.deepcopy(_doubled)
    _doubled(torch.ones(2))
    for other in (copied, deep):
        assert other is not _doubled and other.options == _doubled.options and other.stats.calls == 0
        assert torch.equal(other(torch.ones(2)), torch.full((2,), 2.0))
        assert other.stats.records == 1
    assert pickle.loads(pickle.dumps(_doubled)) is _doubled


@tracejit.trace(opt_level=1)
def _doubled(x):
    return x * 2


@pytest.mark.parametrize("without_host", [False, True])
def test_a_traced_function_does_not_keep_the_model_and_optimizer_it_ran(without_host):
    """The host-free runner and the API checker kept the last call's keyword arguments (the
    model and its optimizer) alive after the user dropped them."""
    model, opt = _twins()[0]
    traced = tracejit.trace(_train_step, without_host=without_host)
    for _ in range(5):
        traced(torch.randn(3, 4), model=model, opt=opt)
    assert traced.stats.host_free_calls if without_host else traced.stats.api_replays
    model_ref, opt_ref = weakref.ref(model), weakref.ref(opt)
    del model, opt
    gc.collect()
    assert model_ref() is None and opt_ref() is None


@pytest.mark.parametrize("without_host", [False, True])
def test_an_optimizer_a_keyword_module_owns_may_start_a_call_without_state(without_host):
    """`model.opt.state.clear()` made the next call create the state lazily, as a keyword
    optimizer's does; it raised TraceMismatchError (and without the host, before the guard, went
    on with the old state)."""
    eager, mine = _twin_nets()
    traced = tracejit.trace(_module_step, without_host=without_host)
    for i in range(9):
        x = torch.randn(3, 4)
        _module_step(x, model=eager)
        traced(x, model=mine)
        if i == 4:
            eager.opt.state.clear()
            mine.opt.state.clear()
        assert torch.equal(eager.fc.weight, mine.fc.weight), i
        assert len(eager.opt.state) == len(mine.opt.state), i
    assert traced.stats.host_free_calls if without_host else traced.stats.api_replays
