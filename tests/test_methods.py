"""`@tracejit.trace` on a method: one traced function per instance, the instance passed through."""

import copy
import gc
import weakref

import torch
import torch.nn.functional as F
from torch import nn

import tracejit


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def eager_forward(self, x):
        return self.out(torch.tanh(self.fc(x)))

    @tracejit.trace
    def forward(self, x):
        return self.eager_forward(x)


def test_a_traced_forward_is_bound_per_instance_like_torch_compile():
    # used to fail with "missing 1 required positional argument"
    torch.manual_seed(0)
    a, b = Net(), Net()
    for i in range(3):
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(i))
        for net in (a, b):
            with torch.no_grad():
                assert torch.equal(net(x), net.eager_forward(x))
    assert a.forward is a.forward and a.forward is not b.forward
    assert a.forward.stats.records == 1 and a.forward.stats.replays == 2
    assert b.forward.stats.records == 1 and b.forward.stats.replays == 2
    assert "external self.fc.weight" in a.forward.listing()  # the instance's tensors, by name
    assert Net.forward.stats.calls == 0  # the class-level function only hands out bound ones


class Trainer:
    """A plain class whose method is the whole training step."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def eager_step(self, x, y):
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss

    @tracejit.trace(without_host=True)
    def step(self, x, y):
        return self.eager_step(x, y)


def test_a_training_step_method_runs_without_host():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
    twin = copy.deepcopy(model)
    traced = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    eager = Trainer(twin, torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9))
    for i in range(6):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)
        assert torch.equal(traced.step(x, y), eager.eager_step(x, y))
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    assert traced.step.stats.records == 1 and traced.step.stats.host_free_calls >= 3


def test_a_copy_of_the_instance_traces_afresh_and_an_instance_is_not_kept_alive():
    net = Net()
    x = torch.randn(2, 3)
    with torch.no_grad():
        net(x), net(x)
        clone = copy.deepcopy(net)
        assert torch.equal(clone(x), clone.eager_forward(x))
    assert clone.forward is not net.forward and clone.forward.stats.calls == 1
    gone = weakref.ref(net)
    del net
    gc.collect()
    assert gone() is None


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.scale = 1.0

    def eager_forward(self, x):
        return self.bn(self.fc(x)) * self.scale

    @tracejit.trace(backend="aten")
    def forward(self, x):
        return self.eager_forward(x)


class NormedWithoutHost(Normed):
    @tracejit.trace(backend="aten", without_host=True)
    def forward(self, x):
        return self.eager_forward(x)


def test_a_traced_forward_follows_eval_and_its_modules_settings():
    """The instance was bound in a closure cell, outside the signature and the host-free guards:
    `eval()` between calls raised TraceMismatchError, and without the host a changed `self.scale`
    was frozen at the recorded value. It is the keyword `self` now, as a keyword module."""
    for cls in (Normed, NormedWithoutHost):
        torch.manual_seed(0)
        net = cls()
        twin = copy.deepcopy(net)
        for i, (training, scale) in enumerate([(True, 1.0)] * 3 + [(False, 1.0), (True, 2.0), (False, 2.0),
                                                                    (True, 2.0), (True, 2.0), (False, 2.0)]):
            for module in (net, twin):
                module.train(training)
                module.scale = scale
            x = torch.randn(5, 3, generator=torch.Generator().manual_seed(i))
            with torch.no_grad():
                assert torch.equal(net(x), twin.eager_forward(x)), (cls.__name__, i)
            assert torch.equal(net.bn.running_mean, twin.bn.running_mean)
        stats = net.forward.stats
        assert stats.records == 2, cls.__name__  # training and evaluation
        assert (stats.host_free_calls if cls is NormedWithoutHost else stats.checked_replays) >= 4, cls.__name__


FACTOR = 1.0


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    @tracejit.trace(backend="aten", without_host=True)
    def forward(self, x):
        return self.fc(x) * FACTOR


class Counter:
    def __init__(self):
        self.w = torch.ones(2)

    @tracejit.trace(backend="aten")
    def step(self, x):
        return x * self.w


def test_a_traced_method_reads_its_own_module_globals_and_keeps_its_instance():
    """The wrapper that binds the instance has tracejit's globals: a global the method reads was
    not guarded without the host (FACTOR = 5.0 went unseen), and `step = Counter().step` lost its
    instance to the garbage collector (held weakly)."""
    global FACTOR
    net = Scaled()
    x = torch.ones(1, 3)
    with torch.no_grad():
        for value in (1.0, 1.0, 1.0, 5.0, 5.0):
            FACTOR = value
            assert torch.equal(net(x), net.fc(x) * value)
    assert net.forward.stats.host_free_calls >= 2
    FACTOR = 1.0
    step = Counter().step
    gc.collect()
    for _ in range(3):
        assert torch.equal(step(torch.full((2,), 3.0)), torch.full((2,), 3.0))


class Descriptors:
    scale = 3.0

    @tracejit.trace
    @staticmethod
    def doubled(x):
        return torch.tanh(x) * 2

    @classmethod
    @tracejit.trace
    def scaled_under(cls, x):
        return torch.tanh(x) * cls.scale

    @tracejit.trace
    @classmethod
    def scaled_over(cls, x):
        return torch.sin(x) * cls.scale

    @tracejit.trace
    def method(self, x):
        return torch.cos(x) * self.scale


class MoreDescriptors(Descriptors):
    scale = 5.0

    def method(self, x):
        return Descriptors.method(self, x) + 1  # the base's traced method through its class


def _x(i):
    return torch.randn(4, generator=torch.Generator().manual_seed(i))


def test_staticmethod_under_and_over_trace_and_classmethods_trace_like_eager():
    # used to raise TypeError (a staticmethod given the instance; a class's read-only __dict__)
    obj = Descriptors()
    for i in range(4):
        x = _x(i)
        assert torch.equal(obj.doubled(x), torch.tanh(x) * 2)
        assert torch.equal(Descriptors.doubled(x), torch.tanh(x) * 2)
        assert torch.equal(Descriptors.scaled_under(x), torch.tanh(x) * 3.0)
        assert torch.equal(obj.scaled_under(x), torch.tanh(x) * 3.0)
        assert torch.equal(MoreDescriptors.scaled_over(x), torch.sin(x) * 5.0)  # the subclass's own scale
        assert torch.equal(Descriptors.scaled_over(x), torch.sin(x) * 3.0)
    assert Descriptors.doubled.stats.records == 1 and Descriptors.doubled.stats.replays == 7
    assert Descriptors.scaled_under.stats.records == 1 and Descriptors.scaled_under.stats.replays == 7
    assert Descriptors.scaled_over.stats.records == 1 and Descriptors.scaled_over.stats.replays == 3
    assert MoreDescriptors.scaled_over.stats.records == 1 and MoreDescriptors.scaled_over.stats.replays == 3


def test_a_classmethod_follows_a_changed_class_attribute_in_checked_calls():
    class Config:
        scale = 2.0

        @classmethod
        @tracejit.trace
        def apply(cls, x):
            return x * cls.scale

    x = _x(0)
    assert torch.equal(Config.apply(x), x * 2.0)
    assert torch.equal(Config.apply(x), x * 2.0)
    Config.scale = 7.0
    assert torch.equal(Config.apply(x), x * 7.0)
    assert Config.apply.stats.replays == 2


def test_a_traced_method_called_through_its_class_takes_the_instance_first():
    # used to raise "positional argument 0 (self) ... must be a torch.Tensor"
    base, more = Descriptors(), MoreDescriptors()
    for i in range(3):
        x = _x(i)
        assert torch.equal(Descriptors.method(base, x), torch.cos(x) * 3.0)
        assert torch.equal(more.method(x), torch.cos(x) * 5.0 + 1)
    assert Descriptors.method(base, x) is not None and base.method.stats.replays == 3
    assert more.__dict__["__tracejit_traces__"] and base.method is not Descriptors.__dict__["method"]
    assert Descriptors.method.options.without_host is False  # the trace's attributes through the class
