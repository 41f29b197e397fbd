"""Python state a replayed call must leave as eager does, found by review (2026-11-26): gradients
the caller holds, parameters frozen through a closure, tensors carried from call to call, `.data`
and `requires_grad_()` inside the step. Each case runs eager and traced side by side from the same
state over several calls, in checked replay (which reaches the API level) and without the host,
and compares every parameter, gradient and output exactly."""

import collections
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracejit

CALLS = 9
MODES = {"checked": {}, "without_host": {"without_host": True}}


def fast_calls(traced, mode: str) -> int:
    """Calls that ran the compiled program without the function's aten ops: proof the fast path ran."""
    stats = traced.stats
    return stats.host_free_calls if mode == "without_host" else stats.api_replays


def assert_same_model(eager: nn.Module, traced: nn.Module, where: str) -> None:
    for (name, a), b in zip(eager.named_parameters(), traced.parameters()):
        assert torch.equal(a, b), f"{where}: {name}"
        assert (a.grad is None) == (b.grad is None), f"{where}: {name}.grad is None: eager {a.grad is None}"
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), f"{where}: {name}.grad"
        assert a.requires_grad == b.requires_grad, f"{where}: {name}.requires_grad"


def sgd_step(x, y, *, m, opt):
    loss = F.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("mode", MODES)
def test_a_gradient_the_caller_holds_is_still_cleared_by_zero_grad(mode):
    """An auxiliary loss backpropagated outside the step leaves `.grad` set when some calls begin,
    and the caller keeps a reference to it: the step's zero_grad() must still leave `.grad` None."""
    torch.manual_seed(0)
    data = [(torch.randn(5, 4), torch.randn(5, 2)) for _ in range(CALLS + 3)]
    models = [nn.Linear(4, 2)]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    traced = tracejit.trace(sgd_step, **MODES[mode])
    held = []
    for i, (x, y) in enumerate(data):
        losses = []
        for step, m, opt in ((sgd_step, models[0], opts[0]), (traced, models[1], opts[1])):
            if i % 3 == 2:
                (m.weight.sum() * 0.01).backward()  # outside the step
                held.append(m.weight.grad)
            losses.append(step(x, y, m=m, opt=opt))
        assert torch.equal(*losses), f"call {i}"
        assert_same_model(models[0], models[1], f"call {i}")
    assert fast_calls(traced, mode) >= 2


def make_closure_step(model):
    def step(x, y, *, opt):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()
    return step


@pytest.mark.parametrize("mode", MODES)
def test_freezing_a_layer_of_a_closure_model_selects_a_trace_of_its_own(mode):
    """requires_grad_(False) on a layer of a model the step reaches by closure, between calls: the
    layer stops training as in eager (it kept training before)."""
    torch.manual_seed(0)
    data = [(torch.randn(5, 4), torch.randn(5, 2)) for _ in range(CALLS)]
    models = [nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    steps = [make_closure_step(models[0]), tracejit.trace(make_closure_step(models[1]), **MODES[mode])]
    for i, (x, y) in enumerate(data):
        if i == 4:
            for m in models:
                m[0].requires_grad_(False)
        if i == 7:
            for m in models:
                m[0].requires_grad_(True)
        losses = [step(x, y, opt=opt) for step, opt in zip(steps, opts)]
        assert torch.equal(*losses), f"call {i}"
        assert_same_model(models[0], models[1], f"call {i}")
    assert steps[1].stats.records == 2  # one trace per requires_grad state
    assert fast_calls(steps[1], mode) >= 3


def discriminator_step(z, real, *, gen, disc, opt_d):
    """A GAN's discriminator step that hands the generator's output, graph intact, to the caller."""
    fake = gen(z)
    loss_d = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
    loss_d.backward()
    opt_d.step()
    opt_d.zero_grad()
    return fake


def gan_models():
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3)), nn.Linear(3, 1)
    return gen, disc, torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)


def test_a_returned_tensor_whose_graph_no_backward_used_keeps_it_in_checked_calls():
    """The generator's output goes back to the caller with its autograd graph: the caller's own
    backward must reach the generator (it silently did not at the API level)."""
    torch.manual_seed(0)
    data = [(torch.randn(4, 2), torch.randn(4, 3)) for _ in range(CALLS)]
    eager, traced_models = gan_models(), gan_models()
    traced = tracejit.trace(discriminator_step)
    with pytest.warns(tracejit.ReplayLevelWarning, match="returns a tensor that requires grad"):
        for i, (z, real) in enumerate(data):
            for step, (gen, disc, opt_g, opt_d) in ((discriminator_step, eager), (traced, traced_models)):
                fake = step(z, real, gen=gen, disc=disc, opt_d=opt_d)
                assert fake.requires_grad and fake.grad_fn is not None, f"call {i}"
                F.softplus(-disc(fake)).mean().backward()
                opt_g.step()
                opt_g.zero_grad()
            assert_same_model(eager[0], traced_models[0], f"generator, call {i}")
            assert_same_model(eager[1], traced_models[1], f"discriminator, call {i}")
    assert traced.stats.checked_replays >= CALLS - 2 and traced.stats.api_replays == 0


def test_a_returned_view_of_a_parameter_keeps_its_graph_in_checked_calls():
    def step(x, *, m, opt):
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return m.weight[0]

    torch.manual_seed(0)
    models = [nn.Linear(3, 2)]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    traced = tracejit.trace(step)
    with pytest.warns(tracejit.ReplayLevelWarning, match="returns a tensor that requires grad"):
        for i in range(CALLS):
            x = torch.randn(4, 3)
            for f, m, opt in ((step, models[0], opts[0]), (traced, models[1], opts[1])):
                row = f(x, m=m, opt=opt)
                assert type(row.grad_fn).__name__ == "SelectBackward0", f"call {i}"
                row.sum().backward()  # the caller's own loss on the returned row
            assert_same_model(models[0], models[1], f"call {i}")
    assert traced.stats.checked_replays >= CALLS - 2


def test_without_the_host_a_returned_graph_no_backward_used_is_warned_of():
    gen, disc, _, opt_d = gan_models()
    traced = tracejit.trace(discriminator_step, without_host=True)
    with pytest.warns(tracejit.GradientWarning, match="no backward pass inside the call used their autograd graph"):
        for _ in range(3):
            traced(torch.randn(4, 2), torch.randn(4, 3), gen=gen, disc=disc, opt_d=opt_d)


class Trainer:
    """A plain object holding what the step uses: not a module, an optimizer or a tensor."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        self.model = nn.Linear(3, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)


def trainer_step(x, *, trainer):
    loss = trainer.model(x).square().mean()
    loss.backward()
    trainer.opt.step()
    trainer.opt.zero_grad()
    return loss.detach()


def test_without_the_host_a_plain_object_keyword_is_followed_to_its_tensors():
    """Two trainers, both alive, passed in turn: each call trains its own trainer's model (every
    host-free call trained the first trainer's weights)."""
    eager = [Trainer(0), Trainer(1)]
    traced_trainers = [Trainer(0), Trainer(1)]
    traced = tracejit.trace(trainer_step, without_host=True)
    for i in range(CALLS):
        x = torch.randn(4, 3)
        which = (i // 3) % 2  # three calls each: the second call of a run is host-free
        assert torch.equal(traced(x, trainer=traced_trainers[which]), trainer_step(x, trainer=eager[which])), i
        for a, b in zip(eager, traced_trainers):
            assert_same_model(a.model, b.model, f"call {i}")
    assert traced.stats.host_free_calls >= 2 and traced.stats.host_free_misses >= 1


@tracejit.trace(without_host=True)
def step(x, *, trainer):
    """trainer_step named as users name it: `step` is an attribute name in its code
    (`trainer.opt.step()`) and the global that holds the trace."""
    loss = trainer.model(x).square().mean()
    loss.backward()
    trainer.opt.step()
    trainer.opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("case", ["named step", "held by its trainer"])
def test_without_the_host_the_trace_itself_is_not_state_of_the_function(case):
    """The trace's statistics change on every call. A step named `step` that calls `opt.step()`
    took the global `step`, the trace, for one the function reaches (`co_names` holds attribute
    names too); a trainer holding its compiled step had the trace searched as an object of the
    user's. Both were refused on the fourth call: `step.stats.checked_replays: 0 -> 1 -> 2`."""
    eager, trainer = Trainer(0), Trainer(0)
    if case == "named step":
        traced = step
    else:
        traced = trainer.compiled = tracejit.trace(trainer_step, without_host=True)
    before = traced.stats.host_free_calls
    for i in range(CALLS):
        x = torch.randn(4, 3)
        assert torch.equal(traced(x, trainer=trainer), trainer_step(x, trainer=eager)), f"call {i}"
        assert_same_model(eager.model, trainer.model, f"call {i}")
    assert traced.stats.host_free_calls - before >= CALLS - 3


class Carrier:
    pass


def carry(x, *, state):
    h = state.h * 0.5 + x
    state.h = h
    return h.sum()


@pytest.mark.parametrize("holder", ["object", "module attribute", "buffer"])
def test_without_the_host_state_carried_from_call_to_call_is_not_frozen(holder):
    """`state.h = h` on every call while the caller keeps the old states (an RNN's hidden state
    across truncated-BPTT windows): each call reads the latest one, and kept ones never change."""
    def make():
        state = Carrier() if holder == "object" else nn.Module()
        if holder == "buffer":
            state.register_buffer("h", torch.zeros(3))
        else:
            state.h = torch.zeros(3)
        return state

    states, kept = [make(), make()], [[], []]
    traced = tracejit.trace(carry, without_host=True)
    for i in range(6):
        x = torch.full((3,), float(i + 1))
        outputs = []
        for step, state, keep in ((carry, states[0], kept[0]), (traced, states[1], kept[1])):
            keep.append(state.h)
            outputs.append(step(x, state=state))
        assert torch.equal(*outputs), f"call {i}: {outputs}"
        for a, b in zip(*kept):
            assert torch.equal(a, b), f"call {i}: a kept state changed"


class Mode(__import__("enum").Enum):
    DOUBLE = 1
    NEGATE = 2


Clip = __import__("collections").namedtuple("Clip", "low high")


def by_mode(x, *, mode, dtype, clip):
    y = x * 2 if mode is Mode.DOUBLE else -x
    return y.clamp(clip.low, clip.high).to(dtype)


def test_without_the_host_keywords_that_are_not_numbers_are_guarded():
    """An enum, a dtype, a namedtuple of numbers: a changed one made the program's recorded path
    and values come back. Now such a call runs the function: a new number is followed, a new
    path raises TraceMismatchError as a checked call does. A NaN in one is the same NaN."""
    traced = tracejit.trace(by_mode, without_host=True)
    x = torch.arange(4.0)
    for _ in range(3):
        clip = Clip(float("nan"), 2.5)  # a new NaN object on every call
        got, expected = (f(x, mode=Mode.DOUBLE, dtype=torch.float64, clip=clip) for f in (traced, by_mode))
        assert torch.allclose(got, expected, rtol=0, atol=0, equal_nan=True)
    assert traced.stats.host_free_calls >= 1 and traced.stats.host_free_misses == 0
    clip = Clip(0.5, 3.0)
    assert torch.equal(traced(x, mode=Mode.DOUBLE, dtype=torch.float64, clip=clip),
                       by_mode(x, mode=Mode.DOUBLE, dtype=torch.float64, clip=clip))
    with pytest.raises(tracejit.TraceMismatchError, match="dtype: torch.float16 instead of torch.float64"):
        traced(x, mode=Mode.DOUBLE, dtype=torch.float16, clip=clip)
    with pytest.raises(tracejit.TraceMismatchError, match="a different op ran"):
        traced(x, mode=Mode.NEGATE, dtype=torch.float64, clip=clip)


class Schedule:
    def __init__(self):
        self.temperature = 1.0


def annealed(x, *, schedule):
    y = x / schedule.temperature
    schedule.temperature *= 0.5  # the step anneals its own setting
    return y


def test_without_the_host_a_setting_the_call_changes_is_refused():
    traced = tracejit.trace(annealed, without_host=True)
    schedule = Schedule()
    with pytest.raises(tracejit.HostDependencyError, match=r"schedule.temperature: 1.0 -> 0.5"):
        for _ in range(3):
            traced(torch.ones(3), schedule=schedule)


def input_step(x, y, *, m):
    """An adversarial step: the gradient of the loss with respect to the input."""
    loss = F.cross_entropy(m(x), y)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("variant", ["fresh input", "grad set to None", "grad zeroed in place"])
def test_without_the_host_an_input_requiring_grad_gets_its_gradient(variant):
    torch.manual_seed(0)
    models = [nn.Linear(6, 3)]
    models.append(copy.deepcopy(models[0]))
    y = torch.randint(0, 3, (4,))
    inputs = [torch.randn(4, 6, requires_grad=True)]
    inputs.append(inputs[0].detach().clone().requires_grad_())
    traced = tracejit.trace(input_step, without_host=True)
    for i in range(CALLS):
        for k, step in enumerate((input_step, traced)):
            if variant == "fresh input":
                inputs[k] = inputs[k].detach().clone().requires_grad_()
            x = inputs[k]
            step(x, y, m=models[k])
            with torch.no_grad():
                x += 0.1 * x.grad.sign()  # the attack's update
            if variant == "grad set to None":
                x.grad = None
            elif variant == "grad zeroed in place":
                x.grad.zero_()
            models[k].zero_grad()
        assert torch.equal(inputs[0], inputs[1]), f"call {i}"
    assert traced.stats.host_free_calls >= 3


def clipped_step(x, y, *, m, opt):
    loss = F.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    m.weight.data = m.weight.data.clamp(-0.1, 0.1)  # WGAN-style clipping by assignment
    return loss.detach()


def toggling_step(x, y, *, m, opt, freeze):
    m.bias.requires_grad_(not freeze)
    return sgd_step(x, y, m=m, opt=opt)


def test_without_the_host_tensors_changed_by_python_inside_the_call_are_refused():
    """`p.data = ...` and `requires_grad_()` inside the step change Python state, not by an op: a
    call without the function kept the weights unclipped and the flag unchanged."""
    torch.manual_seed(0)
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    x, y = torch.randn(5, 4), torch.randn(5, 2)
    traced = tracejit.trace(clipped_step, without_host=True)
    with pytest.raises(tracejit.HostDependencyError, match=r"m.weight has new memory \(`.data = ...`\)"):
        for _ in range(3):
            traced(x, y, m=m, opt=opt)
    traced = tracejit.trace(toggling_step, without_host=True)
    with pytest.raises(tracejit.HostDependencyError, match=r"m.bias.requires_grad_\((True|False)\)"):
        for i in range(6):
            traced(x, y, m=m, opt=opt, freeze=i % 2 == 1)


def _doubled_input(x):
    x.data = x.data * 2
    return x + 1


def _transposed_input(x):
    x.data = x.data.t()
    return x * 1


def _replaced_intermediate(x):
    y = x * 2
    y.data = x.t().contiguous()
    return y * 1


@pytest.mark.parametrize("function", [_doubled_input, _transposed_input, _replaced_intermediate])
def test_without_the_host_data_assigned_to_an_input_or_intermediate_is_refused(function):
    """Only the tensors found by name were compared for new memory: `.data = ...` on an input or an
    intermediate was dropped by host-free calls (other values, the input neither doubled nor
    transposed, the recorded shape). Every assignment is noticed now, by its line; the calls
    before the refusal ran the function, as eager."""
    traced = tracejit.trace(function, without_host=True, backend="aten")
    with pytest.raises(tracejit.HostDependencyError,
                       match=rf"`\.data` assigned at test_state_findings\.py:\d+ in {function.__name__}: \w+\.data = "):
        for i in range(4):
            x = torch.arange(6.0).view(2, 3) + i
            x_eager = x.clone()
            got, want = traced(x), function(x_eager)
            assert got.shape == want.shape and torch.equal(got, want), i
            assert x.shape == x_eager.shape and torch.equal(x, x_eager), i
    assert traced.stats.host_free_calls == 0


def _moved_to_its_dtype(x, *, m):
    m.to(torch.float32)  # torch's Module._apply assigns `p.data = p`, which changes nothing
    x.data = x.data
    return m(x)


def test_without_the_host_data_assigned_that_changes_nothing_still_runs_without_the_host():
    m = nn.Linear(3, 2)
    traced = tracejit.trace(_moved_to_its_dtype, without_host=True, backend="aten")
    with torch.no_grad():  # inference: no graph to hand out
        for _ in range(4):
            x = torch.randn(4, 3)
            assert torch.equal(traced(x, m=m), m(x))
    assert traced.stats.host_free_calls == 3


def saliency_step(x, y, *, model):
    """autograd.grad with respect to an intermediate: the weight penalty's graph below the loss is
    not run by it, and the returned penalty keeps a usable graph."""
    h = model[0](x)
    penalty = model[1].weight.pow(2).sum()
    loss = F.cross_entropy(model[1](torch.tanh(h)), y) + 0.01 * penalty
    (feature_grad,) = torch.autograd.grad(loss, h)
    return feature_grad.detach(), penalty


def test_a_graph_a_partial_autograd_grad_did_not_run_is_kept_in_checked_calls():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))]
    models.append(copy.deepcopy(models[0]))
    traced = tracejit.trace(saliency_step)
    with pytest.warns(tracejit.ReplayLevelWarning, match="returns a tensor that requires grad"):
        for i in range(CALLS):
            x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
            for f, model in ((saliency_step, models[0]), (traced, models[1])):
                feature_grad, penalty = f(x, y, model=model)
                penalty.backward()
            assert_same_model(models[0], models[1], f"call {i}")
            for model in models:
                model.zero_grad()
    assert traced.stats.checked_replays >= CALLS - 2


@pytest.mark.parametrize(("mode", "adam"), [("checked", {"foreach": False}), ("checked", {"fused": True}),
                                            ("without_host", {"fused": True})])  # the for-loop reads step counts
def test_models_trained_in_turn_each_with_its_own_optimizer(mode, adam):
    """One step function trains two models in turn (an ensemble in lockstep). The second model's
    first call replays the first one's recorded call, which created the optimizer's state; the
    first model's next call has that state: it records again instead of raising
    TraceMismatchError (it raised "aten._foreach_add_.Scalar instead of aten.zeros.default")."""
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(2)]
    twins = [copy.deepcopy(net) for net in nets]
    opts, twin_opts = ([torch.optim.Adam(m.parameters(), lr=0.01, **adam) for m in group] for group in (nets, twins))
    traced = tracejit.trace(sgd_step, **MODES[mode])
    for i in range(6):
        for k in range(2):
            x, y = torch.randn(5, 4), torch.randn(5, 2)
            assert torch.equal(traced(x, y, m=nets[k], opt=opts[k]), sgd_step(x, y, m=twins[k], opt=twin_opts[k]))
            assert_same_model(twins[k], nets[k], f"call {i} of model {k}")
            for p, q in zip(twins[k].parameters(), nets[k].parameters()):
                for name, value in twin_opts[k].state[p].items():
                    assert torch.equal(value, opts[k].state[q][name]), f"call {i} of model {k}: {name}"
    assert traced.stats.records + traced.stats.rerecords < traced.stats.calls  # it replayed


class _Deep:
    """Plain containers nested deeper than tracejit searches (names._PLAIN_DEPTH)."""

    def __init__(self, depth: int):
        self.inner = _Deep(depth - 1) if depth > 1 else None
        self.value = None


_stored: dict = {}
_stored_module = nn.Linear(2, 2)


def _keep_view_of_input(x):
    _stored["tail"] = x[1:]
    return x + 1


def _keep_view_of_output(x):
    y = x * 2
    _stored["view"] = y[1:]
    return y


def _keep_on_global_module(x):
    _stored_module.last = (x.sum() * 2).detach()
    return x + 1


def _keep_deep(x, *, box):
    box.inner.inner.inner.inner.value = x.sum() * 2
    return x + 1


def _keep_deep_view_of_input(x, *, box):
    box.inner.inner.inner.inner.value = x[1:]
    return x + 1


@pytest.mark.parametrize("case", ["view of input", "view of output", "global module", "deep", "deep view of input"])
def test_without_the_host_tensors_left_in_python_state_are_new_on_every_call(case):
    """A tensor the function leaves in Python state it reaches without a keyword module (a global
    dict, a global module's attribute) is a new tensor on every eager call. Host-free calls wrote
    the new value into the one left before: the view of an earlier input or output changed that
    input or output, and a history of them held one value. Now the place gets the new tensor; a
    place tracejit cannot find (deeper than it searches) makes the calls run the function."""
    function = {"view of input": _keep_view_of_input, "view of output": _keep_view_of_output,
                "global module": _keep_on_global_module, "deep": _keep_deep,
                "deep view of input": _keep_deep_view_of_input}[case]
    box = _Deep(5)
    kwargs = {"box": box} if case.startswith("deep") else {}
    read = {"view of input": lambda: _stored["tail"], "view of output": lambda: _stored["view"],
            "global module": lambda: _stored_module.last, "deep": lambda: box.inner.inner.inner.inner.value,
            "deep view of input": lambda: box.inner.inner.inner.inner.value}[case]
    traced = tracejit.trace(function, without_host=True)
    inputs = [torch.full((3,), float(i)) for i in range(6)]
    outputs, history = [], []
    for x in inputs:
        outputs.append(traced(x, **kwargs))
        history.append(read())
        if case.endswith("view of input"):
            assert history[-1]._base is x  # a view of this call's input, as eager's
    for i, x in enumerate(inputs):
        assert torch.equal(x, torch.full((3,), float(i))), f"input {i} changed"
        assert torch.equal(outputs[i], x * 2 if case == "view of output" else x + 1), f"output {i} changed"
    kept = {"view of input": [[float(i)] * 2 for i in range(6)], "view of output": [[2.0 * i] * 2 for i in range(6)],
            "deep view of input": [[float(i)] * 2 for i in range(6)]}
    want = kept.get(case, [6.0 * i for i in range(6)])
    assert [t.tolist() for t in history] == want
    if case.startswith("deep"):  # held where tracejit cannot find it: the function runs
        assert traced.stats.host_free_misses >= 3
    else:
        assert traced.stats.host_free_calls >= 3


# Python state the step changes below what was watched (review of 2026-12): a submodule's annealed
# float, a hand-written optimizer's int step count, an EMA helper's counter reached by closure or
# through a global dict. Checked calls run the function and follow them; a call without the host
# froze them silently, and is now refused as a keyword object's changed setting is.


class Annealed(nn.Module):
    """A Gumbel-softmax-like head that anneals its own temperature in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.tau = 1.0

    def forward(self, x):
        self.tau = max(0.1, self.tau * 0.8)
        return self.fc(x) / self.tau


class IntStepAdam(torch.optim.Optimizer):
    """A hand-written Adam whose step count is a Python int in its state."""

    def __init__(self, params, lr=0.01, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["m"], state["v"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                size = group["lr"] * (1 - b2 ** t) ** 0.5 / (1 - b1 ** t)
                p.addcdiv_(state["m"], state["v"].sqrt().add_(group["eps"]), value=-size)


class EMA:
    def __init__(self, model):
        self.shadow = [p.detach().clone() for p in model.parameters()]
        self.updates = 0

    @torch.no_grad()
    def update(self, model):
        self.updates += 1
        decay = min(0.999, (1 + self.updates) / (10 + self.updates))  # the usual warm-up
        for s, p in zip(self.shadow, model.parameters()):
            s.mul_(decay).add_(p, alpha=1 - decay)


_EMAS = {}


def _counting_steps(case: str, ema: EMA):
    """The step of each case, reaching the EMA (if any) as the case says."""
    def plain(x, y, *, model, opt):
        return sgd_step(x, y, m=model, opt=opt)

    def closure(x, y, *, model, opt):
        loss = sgd_step(x, y, m=model, opt=opt)
        ema.update(model)
        return loss

    def global_dict(x, y, *, model, opt):
        loss = sgd_step(x, y, m=model, opt=opt)
        _EMAS["ema"].update(model)
        return loss

    return {"submodule": plain, "int step": plain, "ema closure": closure, "ema global": global_dict}[case]


_COUNTED = {
    "submodule": r"model\.1\.tau: 1\.0 -> 0\.8 -> 0\.64",
    "int step": r"opt\.state\[model\.0\.weight\]\.step: 1 -> 2 -> 3",
    "ema closure": r"ema\.updates: 0 -> 1 -> 2",
    "ema global": r"_EMAS\['ema'\]\.updates: 0 -> 1 -> 2",
}


def _counting_setup(case: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Annealed() if case == "submodule" else nn.Linear(4, 3))
    opt = IntStepAdam(model.parameters()) if case == "int step" else torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, EMA(model)


def _counted(model, opt, ema, case):
    """The Python numbers the case's step changes."""
    if case == "submodule":
        return model[1].tau
    if case == "int step":
        return [state["step"] for state in opt.state.values()]
    return ema.updates


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", _COUNTED)
def test_python_numbers_the_step_changes_below_its_keywords(case, mode):
    """The numbers follow eager's in checked calls; without the host the trace is refused, naming
    the number and its changes, and no call ran with them frozen before (the state is eager's)."""
    eager, traced_state = _counting_setup(case), _counting_setup(case)
    data = [(torch.randn(5, 4), torch.randn(5, 3)) for _ in range(CALLS)]
    steps = [_counting_steps(case, eager[2]), tracejit.trace(_counting_steps(case, traced_state[2]), **MODES[mode])]
    for i, (x, y) in enumerate(data):
        losses = []
        for k in (1, 0):  # traced first: a refused call leaves both at the same step
            model, opt, ema = (eager, traced_state)[k]
            _EMAS["ema"] = ema
            # the second call that changed the number found it as the first one left it, and
            # changed it again; the one after is refused (the optimizer's state begins in the first)
            if mode == "without_host" and k == 1 and i == (3 if case == "int step" else 2):
                with pytest.raises(tracejit.HostDependencyError, match=_COUNTED[case]):
                    steps[k](x, y, model=model, opt=opt)
                break
            losses.append(steps[k](x, y, model=model, opt=opt))
        assert_same_model(eager[0], traced_state[0], f"call {i}")
        assert _counted(*eager, case) == _counted(*traced_state, case), f"call {i}"
        for s, t in zip(eager[2].shadow, traced_state[2].shadow):
            assert torch.equal(s, t), f"call {i}"
        if len(losses) < 2:
            return
        assert torch.equal(*losses), f"call {i}"
    assert mode == "checked", "without_host did not refuse a number the call changes"
    assert fast_calls(steps[1], mode) >= 3


class LazyFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.ready = False

    def forward(self, x):
        self.ready = True  # set once: the calls after the first leave it as they find it
        return self.fc(x)


def make_eval_step(model):
    def evaluate(x):
        model.eval()
        with torch.no_grad():
            return model(x)
    return evaluate


def test_without_the_host_a_setting_the_call_sets_once_still_runs_without_the_host():
    """`model.eval()` on a closure model that starts in train mode, a flag set on the first call:
    the first call changes them, the next ones do not, so calls after that run without the host."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), LazyFlag())]
    models.append(copy.deepcopy(models[0]))
    steps = [make_eval_step(models[0]), tracejit.trace(make_eval_step(models[1]), without_host=True)]
    for i in range(CALLS):
        x = torch.randn(5, 4)
        outputs = [step(x) for step in steps]
        assert torch.equal(*outputs), f"call {i}"
        assert not models[1].training and models[1][2].ready
    assert steps[1].stats.host_free_calls >= CALLS - 3


_accuracies: list = []


def _append_accuracy(x):
    _accuracies.append((x > 0).float().mean())
    return x * 2


def test_without_the_host_a_tensor_appended_to_a_list_is_appended_on_every_call():
    """`history.append(acc)` on a global list: host-free calls wrote the new value into the tensor
    the last host-run call appended and appended nothing (3-9 entries after 10 calls, depending on
    hash order). A tensor kept where tracejit cannot find the place makes the calls run the function."""
    _accuracies.clear()
    traced = tracejit.trace(_append_accuracy, without_host=True)
    inputs = [torch.linspace(-1, 1, 8) + 0.1 * i for i in range(10)]
    for x in inputs:
        traced(x)
    assert [a.item() for a in _accuracies] == [(x > 0).float().mean().item() for x in inputs]
    assert traced.stats.host_free_calls == 0


def _running_sum(x, *, hist):  # an RNN-like history: read the last entry, append the new one
    y = hist[-1] + x
    hist.append(y)
    return y


def _appended_and_read(x, *, hist):
    hist.append(x * 2)
    return hist[-1]


_FRONT: list = []


def _inserted_in_front(x, *, hist):
    _FRONT.insert(0, x * 2)
    return x + 1


def _window(x, *, hist):  # the last two values: shifted, the length stays
    hist.append(x * 2)
    hist.pop(0)
    return x + 1


def _shifted(x, *, hist):
    hist["prev"] = hist["cur"]
    hist["cur"] = x * 2
    return x + 1


class _Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.outputs = []

    def forward(self, x):
        y = x * 3
        self.outputs.append(y)
        return y


def _recorded(x, *, hist):
    return hist(x)


_REARRANGING = {  # function, a fresh `hist`, the tensors it holds after the calls
    "hist[-1] read, then appended to": (_running_sum, lambda: [torch.zeros(2)], list),
    "appended to, then hist[-1] read": (_appended_and_read, lambda: [torch.ones(2)], list),
    "global insert(0, ...)": (_inserted_in_front, _FRONT.clear, lambda _: _FRONT),  # hist: None
    "window shifted": (_window, lambda: [torch.zeros(2), torch.ones(2)], list),
    "full deque appended to": (_appended_and_read, lambda: collections.deque([torch.ones(2)] * 2, maxlen=2), list),
    "dict entries shifted": (_shifted, lambda: {"prev": torch.zeros(2), "cur": torch.ones(2)},
                             lambda hist: list(hist.values())),
    "module's list appended to": (_recorded, _Recorder, lambda hist: hist.outputs),
}


@pytest.mark.parametrize("case", _REARRANGING)
def test_without_the_host_a_list_or_dict_the_call_rearranges_runs_the_function(case):
    """The tensor a call appends was found at a position (`hist[-1]` as `hist[1]`), or it is
    returned too, or the call shifts tensors between places: host-free calls wrote into the
    recorded position, returned the new value without appending it, or left the window unshifted
    (the length guard took the length after the recorded append). A call that adds, removes or
    moves items of a list or dict the function reaches makes the next call run the function."""
    function, fresh, held = _REARRANGING[case]
    traced = tracejit.trace(function, without_host=True, backend="aten")

    def six_calls(step):  # from a fresh history: the outputs, then what the history holds
        hist = fresh()
        outputs = [step(torch.full((2,), float(i)), hist=hist) for i in range(6)]
        return outputs + [t.clone() for t in held(hist)]

    eager, got = six_calls(function), six_calls(traced)
    assert len(got) == len(eager) and all(map(torch.equal, got, eager)), (got, eager)
    assert traced.stats.host_free_calls == 0 and traced.stats.checked_replays == 5


def _cached(x, *, cache):
    cache["last"] = x * 2
    return x + 1


def test_without_the_host_a_key_added_once_costs_one_call():
    """A dict entry the first call adds and later calls assign anew: only that call rearranged the
    dict, so the calls after the next one run without the host, leaving each call's value there."""
    traced = tracejit.trace(_cached, without_host=True, backend="aten")
    cache = {}
    for i in range(6):
        traced(torch.full((2,), float(i)), cache=cache)
        assert torch.equal(cache["last"], torch.full((2,), 2.0 * i)), i
    assert traced.stats.host_free_calls == 4


def _step_logging_metrics(x, *, model, opt, metrics):
    out = model(x)
    loss = (out * out).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    metrics["loss"] = loss.detach()  # frees the last call's: a tensor made next may get its id
    metrics["mean"] = out.mean().detach()
    return loss.detach()


@pytest.mark.parametrize("slots", ["filled", "none"])
def test_without_the_host_metrics_assigned_to_the_same_keys_keep_the_fast_path(slots):
    """Items were compared by id(): the freed tensor's id, taken by the next value, looked like an
    item moved to another key, and calls at random ran the function. Slots that hold None before
    are no object that could move."""
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(40)]
    runs = []
    for traced in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        metrics = {"loss": None, "mean": None} if slots == "none" else {}
        step = tracejit.trace(_step_logging_metrics, without_host=True, backend="aten") if traced else _step_logging_metrics
        runs.append([(step(x, model=model, opt=opt, metrics=metrics), dict(metrics)) for x in xs])
    for i, ((want, wanted), (got, found)) in enumerate(zip(*runs)):
        assert torch.equal(got, want) and all(torch.equal(found[k], v) for k, v in wanted.items()), i
    assert step.stats.host_free_calls == 37, step.stats


def test_an_item_freed_in_the_call_whose_id_a_new_item_takes_did_not_move():
    # Deterministic form of the above: the new value under "mean" takes the id of the "loss" freed
    # by the call; nothing moved.
    from tracejit.record.names import _items, _rearranged

    metrics = {"loss": torch.ones(1), "mean": torch.ones(1)}
    before = _items(metrics)
    freed = id(metrics["loss"])
    metrics["loss"] = None
    reused = None
    for _ in range(1000):  # CPython hands a freed object's memory to the next one of its size
        candidate = torch.zeros(1)
        if id(candidate) == freed:
            reused = candidate
            break
    if reused is None:
        pytest.skip("no new tensor took the freed one's id")
    metrics["loss"], metrics["mean"] = torch.zeros(1), reused
    assert not _rearranged(before, _items(metrics))
    metrics["loss"], metrics["mean"] = metrics["mean"], metrics["loss"]  # a real move still counts
    moved = _items(metrics)
    assert _rearranged(_items({"loss": metrics["mean"], "mean": metrics["loss"]}), moved)


def _scaled_step(x, y, *, m, opt, cfg):
    loss = F.mse_loss(m(x) * cfg["s"], y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    cfg["s"] *= 1.1  # the call changes its keyword dict
    return loss.detach()


def test_without_the_host_a_keyword_dict_the_call_changes_is_compared_as_the_call_found_it():
    """The guard of a keyword dict took its copy after the binding call had changed it, while the
    program kept the number that call used: the next call passed the guard and computed with a
    stale `s` (and left `cfg` unchanged). Compared with what the binding call found, every call
    now runs the function, as the value changes every call."""
    torch.manual_seed(0)
    models = [nn.Linear(4, 2)]
    models.append(copy.deepcopy(models[0]))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    configs = [{"s": 1.0}, {"s": 1.0}]
    traced = tracejit.trace(_scaled_step, without_host=True)
    for i in range(6):
        x, y = torch.randn(5, 4), torch.randn(5, 2)
        losses = [function(x, y, m=m, opt=opt, cfg=cfg)
                  for function, m, opt, cfg in zip((_scaled_step, traced), models, opts, configs)]
        assert torch.equal(*losses) and configs[0] == configs[1], f"call {i}"
        assert_same_model(models[0], models[1], f"call {i}")
    assert traced.stats.host_free_misses >= 3


def _lazy_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(2))


def _evaluate(x, y, *, m, opt=None):
    with torch.no_grad():
        return m(x)


def _lazy_calls(functions, twins, calls: int) -> None:
    """Eager and traced side by side on twin (model, optimizer) pairs, from the same generator
    state: a lazy module draws its initial weights in its first forward."""
    for i in range(calls):
        x, y = torch.randn(5, 4), torch.randn(5, 2)
        results = []
        for function, (model, opt) in zip(functions, twins):
            torch.manual_seed(100 + i)
            results.append(function(x, y, m=model, opt=opt))
        assert torch.equal(*results), f"call {i}"
        assert_same_model(twins[0][0], twins[1][0], f"call {i}")
        assert [type(m) for m in twins[1][0]] == [nn.Linear, nn.ReLU, nn.Linear], f"call {i}: not materialized"


def _momentum(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("flow", ["inference", "optimizer before the first forward",
                                  "dry run by a traced evaluation", "another lazy model"])
def test_a_lazy_module_materializes_in_the_first_call_as_in_eager(flow, mode):
    """nn.LazyLinear gets its shape, memory and initial weights in its first forward. A traced
    first call crashed on the uninitialized parameter (`untyped_storage`, record/names.py). Now
    a call that finds one runs eagerly, unrecorded (stats.eager_calls), and the calls after it
    record and replay with eager's numbers: the weights it drew, the optimizer's steps after."""
    twins = [(_lazy_net(0), None), (_lazy_net(0), None)]
    evaluations = [_evaluate, tracejit.trace(_evaluate, **MODES[mode])]
    steps = [sgd_step, tracejit.trace(sgd_step, **MODES[mode])]
    if flow == "inference":
        _lazy_calls(evaluations, twins, CALLS)
        traced, eager_calls = evaluations[1], 1
    elif flow == "optimizer before the first forward":  # torch allows it: materializing keeps the objects
        twins = [(model, _momentum(model)) for model, _ in twins]
        _lazy_calls(steps, twins, CALLS)
        traced, eager_calls = steps[1], 1
    elif flow == "dry run by a traced evaluation":  # then the optimizer, as torch's docs advise
        _lazy_calls(evaluations, twins, 1)
        assert evaluations[1].stats.eager_calls == 1 and evaluations[1].stats.records == 0
        twins = [(model, _momentum(model)) for model, _ in twins]
        _lazy_calls(steps, twins, CALLS)
        traced, eager_calls = steps[1], 0
    else:  # a trace recorded on one model, then another one still lazy: its first call replayed
        _lazy_calls(evaluations, twins, 3)
        _lazy_calls(evaluations, [(_lazy_net(1), None), (_lazy_net(1), None)], CALLS)
        traced, eager_calls = evaluations[1], 2
    assert traced.stats.eager_calls == eager_calls and traced.stats.records == 1, traced.stats
    assert fast_calls(traced, mode) >= CALLS - 3, traced.stats


class _LazyHolder:
    """Deeper than tracejit searches a keyword's plain containers (names._PLAIN_DEPTH)."""

    def __init__(self, model):
        self.inner = {"a": [{"b": model}]}


def _deep_evaluate(x, *, holder):
    with torch.no_grad():
        return holder.inner["a"][0]["b"](x)


def test_a_lazy_module_tracejit_cannot_find_is_refused_by_name():
    """A lazy module reached where tracejit does not look before the call: its first forward in a
    recording is refused by a tracejit error saying what to do (it crashed on its missing shape),
    the module left lazy; after one eager forward the traced calls run as eager's."""
    model, twin = _lazy_net(0), _lazy_net(0)
    traced = tracejit.trace(_deep_evaluate)
    with pytest.raises(RuntimeError, match=r"tracejit: _deep_evaluate\(\): .* of a lazy module .* not materialized "
                                           r"yet.* Run one forward of the model before the traced call"):
        traced(torch.randn(5, 4), holder=_LazyHolder(model))
    assert type(model[0]) is nn.LazyLinear and model[0].has_uninitialized_params()
    x = torch.randn(5, 4)
    torch.manual_seed(1)
    model(x)
    torch.manual_seed(1)
    twin(x)
    for i in range(6):
        x = torch.randn(5, 4)
        assert torch.equal(traced(x, holder=_LazyHolder(model)), twin(x).detach()), f"call {i}"
    assert traced.stats.records == 1 and traced.stats.api_replays >= 3, traced.stats


SCALE = 1.0


def _scaled(x):
    return x * SCALE


def _through_helper(x):
    return _scaled(x) + 1


def test_without_the_host_a_number_the_caller_changes_in_a_global_or_closure_is_followed():
    """`x * SCALE` has the number built into the program: a caller's `SCALE = 4.0` (or a closure
    variable it rebinds) between calls was frozen at the recorded value by host-free calls."""
    global SCALE
    factor = 1.0

    def closed(x):
        return x * factor

    for function in (_scaled, _through_helper, closed):
        SCALE, factor = 1.0, 1.0
        traced = tracejit.trace(function, without_host=True, backend="aten")
        x = torch.ones(2)
        for value in (1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 3.0):
            SCALE = factor = value
            assert torch.equal(traced(x), function(x)), (function.__name__, value)
        assert traced.stats.host_free_calls >= 3 and traced.stats.host_free_misses >= 2, function.__name__
    SCALE = 1.0


def test_without_the_host_a_global_number_the_function_changes_is_refused():
    """`global SCALE; SCALE *= 0.5` inside the step: the guard took its copy after the call had
    changed it, and every later host-free call used the recorded number with SCALE frozen."""
    global SCALE

    def decaying(x):
        global SCALE
        y = x * SCALE
        SCALE *= 0.5
        return y

    SCALE = 1.0
    traced = tracejit.trace(decaying, without_host=True, backend="aten")
    assert torch.equal(traced(torch.ones(2)), torch.ones(2))
    with pytest.raises(tracejit.HostDependencyError, match=r"SCALE: 1.0 -> 0.5"):
        traced(torch.ones(2))
    SCALE = 1.0
