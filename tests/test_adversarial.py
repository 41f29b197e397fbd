"""Programs a demanding PyTorch user writes, against eager, over several calls.

Each either matches eager bit for bit (outputs and every piece of state) or raises a clear
TraceMismatchError; none may compute something else silently. without_host=True cases found the
same way live in test_without_host.py.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import CNN, MLP, batch
from side_by_side import assert_replayed, mse, same_tree, seeded, side_by_side, state_of, step_of

from tracejit import TraceMismatchError

# -- values that change between calls without changing the program ----------------------------------


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = 1.0
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x).relu() * self.scale)


def test_module_float_attributes_changed_between_calls(trace):
    def forward(x, *, model):
        return model(x)

    def between(i, objects):
        objects["model"].scale = 1.0 + i
        objects["model"].drop.p = 0.1 * (i + 1)

    side_by_side(trace(forward), forward, {"model": Scaled()}, seeded(3, 4), 4, between)


def test_keyword_float_scales(trace):
    def f(x, *, model, scale, temperature):
        return (model(x) * scale).softmax(-1) / temperature + F.leaky_relu(x, negative_slope=scale)

    objects = {"model": nn.Linear(3, 3)}
    traced = trace(f)
    for i in range(4):
        x = torch.randn(2, 3)
        want = f(x, model=objects["model"], scale=0.5 * (i + 1), temperature=2.0 + i)
        assert torch.equal(traced(x, model=objects["model"], scale=0.5 * (i + 1), temperature=2.0 + i), want)
    assert_replayed(traced, 4)


def test_where_and_masked_fill_with_changing_python_scalars(trace):
    fill = {"v": 0.0}

    def f(x):
        y = torch.where(x > 0, x, fill["v"]) + torch.where(x < 0, 1.5, x)
        return y.masked_fill_(x.abs() < 0.2, fill["v"] * 2).clamp(min=fill["v"])

    def between(i, objects):
        fill["v"] = i - 1.5

    side_by_side(trace(f), f, {}, seeded(8), 4, between)


def test_integer_tensors_with_a_changing_divisor(trace):
    k = {"v": 3}

    def f(x, y):
        a = x // k["v"] + x % k["v"]
        return a, (y * k["v"]).clamp(max=20), torch.bitwise_and(a, 7) + y.sum(), x.float() / k["v"]

    def between(i, objects):
        k["v"] = 2 + i

    side_by_side(trace(f), f, {}, lambda i: (torch.arange(10) * (i + 1), torch.arange(10) - i), 4, between)


def test_python_counter_inside_a_module(trace):
    class Warmup(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.fc(x) * min(1.0, self.calls / 3)

    def forward(x, *, model):
        return model(x)

    twins = side_by_side(trace(forward), forward, {"model": Warmup()}, seeded(1, 3), 5)
    assert twins["model"].calls == 5


def test_value_read_on_the_host_fed_back_as_a_scalar(trace):
    if trace.mode == "symbolic":
        pytest.skip("reads a computed value on the host (test_symbolic.py checks the refusal)")

    def f(x):
        s = x.abs().max().item()
        return x / s, torch.full((2,), s), x.add_(s)

    side_by_side(trace(f), f, {}, lambda i: (torch.randn(4, generator=torch.Generator().manual_seed(i)) * (i + 1),), 4)


def test_explicit_generator_keeps_drawing(trace):
    def f(x, *, g):
        return x + torch.randn(x.shape, generator=g) + torch.rand(3, generator=g)

    traced = trace(f)
    g_eager, g_traced = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    outs = []
    for _ in range(4):
        x = torch.ones(3)
        outs.append(traced(x, g=g_traced))
        assert torch.equal(outs[-1], f(x, g=g_eager))
    assert not torch.equal(outs[0], outs[1])
    assert_replayed(traced, 4)


# -- autograd, aliasing, in-place -------------------------------------------------------------------


def test_no_grad_blocks_and_grad_mode_of_the_caller(trace):
    def f(x, *, model):
        with torch.no_grad():
            s = model(x).sum()
        return model(x) * s

    model = nn.Linear(4, 2)
    traced = trace(f)
    for i in range(6):
        x = torch.randn(3, 4)
        with torch.set_grad_enabled(i % 2 == 0):
            want, got = f(x, model=model), traced(x, model=model)
        assert torch.equal(got, want) and got.requires_grad == want.requires_grad == (i % 2 == 0)
    assert_replayed(traced, 6, records=2)  # one trace per grad mode of the caller


def test_detach_and_clone_aliasing(trace):
    def f(x):
        y = x * 2
        y.detach().add_(1)  # writes y: detach shares memory
        c = y.clone()
        c.mul_(3)  # does not write y
        return y, c

    side_by_side(trace(f), f, {}, seeded(3), 4)


def test_in_place_on_views_of_parameters_in_a_training_step(trace):
    def step(x, *, model, opt):
        loss = model(x).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model.weight[:, 0].mul_(0.5)
            model.bias.clamp_(-0.1, 0.1)
        return loss

    model = nn.Linear(4, 3)
    side_by_side(trace(step), step, {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)},
                 seeded(2, 4), 5)


def test_gradient_of_the_input_with_autograd_grad(trace):
    def f(x, *, model):
        x = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(model(x).tanh().sum(), x)
        return g

    side_by_side(trace(f), f, {"model": nn.Linear(3, 1)}, seeded(4, 3), 4)


def test_weight_tying(trace):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 6)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(self.emb(idx).tanh())

    model = Tied()
    step = step_of(lambda model, idx, y: F.cross_entropy(model(idx), y))
    twins = side_by_side(trace(step), step, {"model": model, "opt": torch.optim.AdamW(model.parameters(), fused=True)},
                         lambda i: (torch.randint(0, 10, (7,)), torch.randint(0, 10, (7,))), 5)
    assert twins["model"].head.weight is twins["model"].emb.weight


def test_buffer_replaced_by_a_new_tensor_every_call(trace):
    class Ema(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("ema", torch.zeros(3))

        def forward(self, x):
            self.ema = self.ema * 0.9 + x.mean(0) * 0.1
            return x - self.ema

    def forward(x, *, model):
        return model(x)

    side_by_side(trace(forward), forward, {"model": Ema()}, seeded(4, 3), 5)


def test_in_place_on_a_keyword_tensor(trace):
    def f(x, *, acc):
        acc.add_(x)
        acc[0] = acc[0] * 2
        return acc.sum()

    side_by_side(trace(f), f, {"acc": torch.zeros(3)}, lambda i: (torch.ones(3) * i,), 4)


def test_returning_one_tensor_twice_and_the_input(trace):
    def f(x):
        y = x.exp()
        return {"a": y, "b": y, "x": x}

    traced = trace(f)
    for _ in range(3):
        x = torch.randn(3)
        out = traced(x)
        assert out["a"] is out["b"] and out["x"] is x and torch.equal(out["a"], x.exp())
    assert_replayed(traced, 3)


# -- optimizers and modules -------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["sgd_groups", "adam_fused_groups"])
def test_two_param_groups_with_their_own_changing_lrs(trace, optimizer):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    if optimizer == "sgd_groups":
        opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                               {"params": model[2].parameters(), "lr": 0.01, "momentum": 0.5}], lr=0.05)
    else:
        opt = torch.optim.Adam([{"params": model[0].parameters(), "lr": 0.1},
                                {"params": model[2].parameters(), "lr": 0.01, "weight_decay": 0.1}], fused=True)

    def between(i, objects):
        objects["opt"].param_groups[0]["lr"] = 0.1 / (i + 1)
        objects["opt"].param_groups[1]["lr"] = 0.01 * (i + 1)

    step = step_of(mse)
    side_by_side(trace(step), step, {"model": model, "opt": opt}, seeded(5, 4), 5, between)


def test_train_and_eval_switching(trace):
    def step(x, y, *, model, opt):
        loss = F.cross_entropy(model(x), y)
        if model.training:
            loss.backward()
            opt.step()
            opt.zero_grad()
        return loss

    def between(i, objects):
        objects["model"].train(i % 3 != 2)

    model = CNN()
    side_by_side(trace(step), step, {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)},
                 lambda i: batch("cnn", i), 7, between, records=2)  # one trace for train, one for eval


def test_submodule_replaced_between_calls(trace):
    def forward(x, *, model):
        return model(x)

    def between(i, objects):
        if i == 2:
            torch.manual_seed(7)
            objects["model"][0] = nn.Linear(4, 4)

    side_by_side(trace(forward), forward, {"model": nn.Sequential(nn.Linear(4, 4), nn.ReLU())},
                 lambda i: (torch.ones(2, 4),), 4, between)


def test_gradient_clipping_and_nesterov_with_a_keyword_loss_scale(trace):
    def step(x, y, *, model, opt, k):
        loss = F.cross_entropy(model(x), y) / k
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss, norm

    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, nesterov=True)
    traced = trace(step)
    twins = copy.deepcopy({"model": model, "opt": opt})
    for i in range(5):
        x, y = batch("mlp", i)
        want = step(x, y, model=model, opt=opt, k=float(i + 1))
        got = traced(x, y, **twins, k=float(i + 1))
        assert same_tree(got, want)
        assert same_tree(state_of(twins["model"]), state_of(model))
    assert_replayed(traced, 5, records=2)  # the first call creates .grad, later ones write into it


# -- changes that alter the program raise a clear error ---------------------------------------------


@pytest.mark.parametrize("change, message", [
    ("module_flag", r"op #4: a different op ran \(aten.empty_like.default instead of aten.relu.default\)"),
    ("interpolate_scale", (r"op #0: aten.upsample_nearest2d.default got different non-tensor arguments "
                           r"\(argument 1: \(12, 12\) instead of \(8, 8\)\)")),
    ("dropout_p_zero", r"op #0: premature end: the function returned after 0 of"),
])
def test_program_changes_are_refused_clearly(trace, change, message):
    config = {"act": True, "scale": 2.0, "p": 0.5}
    linear = nn.Linear(4, 4)

    def f(x):
        if change == "module_flag":
            y = linear(x[0, 0])
            return F.dropout(y.relu() if config["act"] else y, 0.5)
        if change == "interpolate_scale":
            return F.interpolate(x, scale_factor=config["scale"], mode="nearest")
        return F.dropout(x, config["p"], training=True)

    traced = trace(f)
    x = torch.randn(1, 1, 4, 4)
    traced(x)
    config.update(act=False, scale=3.0, p=0.0)
    with pytest.raises(TraceMismatchError, match=message):
        traced(x)
