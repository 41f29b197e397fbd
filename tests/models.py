"""Small real models and training steps shared by the tests."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from tracejit.ir import Op
from tracejit.record.calls import is_view_op


class MLP(nn.Module):
    def __init__(self, sizes=(64, 128, 128, 10)):
        super().__init__()
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.drop(x.flatten(1)))


class TransformerBlock(nn.Module):
    def __init__(self, dim=32, heads=4, hidden=64, classes=10):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(x.mean(dim=1))


class DropoutAttention(nn.Module):
    """Attention with dropout: backward takes views (bmm's transposes) of the recomputed softmax
    and of the hidden values it multiplies."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        att = self.drop(torch.softmax(h @ h.transpose(-1, -2), -1))
        h2 = att @ h
        return torch.tanh(torch.tanh(self.b(h2)) * h2)


def attention_step(x, *, model, opt):
    opt.zero_grad()  # first, so that the step leaves its gradients for the comparison
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss


def train_attention_beside_eager(traced, eager_pair, traced_pair, without_host: bool, steps: int = 6) -> None:
    """attention_step eager and traced from the same inputs and dropout seeds, state compared
    exactly after every step; and proof that the compiled program served calls."""
    (model_a, opt_a), (model_b, opt_b) = eager_pair, traced_pair
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        x = torch.randn(4, 8, 16, generator=g)
        torch.manual_seed(100 + i)  # dropout draws the same numbers in both
        expected = attention_step(x, model=model_a, opt=opt_a)
        torch.manual_seed(100 + i)
        assert torch.equal(traced(x, model=model_b, opt=opt_b), expected), i
        assert_same_state(model_a, opt_a, model_b, opt_b)
    if without_host:
        assert traced.stats.host_free_calls > 0, traced.stats
    else:
        assert traced.stats.api_replays > 0, traced.stats


def views_outside_their_storage(graph):
    """Views whose root is no storage their node reads: plan_memory takes a view's root for the
    storage it keeps alive, so such a view's own storage may be reused while the view is read."""
    wrong = []
    for node in graph.nodes:
        if node.op is not Op.CALL or not is_view_op(node.target):
            continue
        read = {graph.values[v].root for v in node.inputs}
        for vid in node.outputs:
            value = graph.values[vid] if vid is not None else None
            if value is not None and value.root != value.handle and value.root not in read:
                wrong.append(f"{node.name} -> t{vid} (root {value.root}, reads {sorted(read)})")
    return wrong


def batch(kind: str, step: int, batch_size: int = 8):
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "mlp":
        x = torch.randn(batch_size, 64, generator=g)
    elif kind == "cnn":
        x = torch.randn(batch_size, 3, 16, 16, generator=g)
    else:
        x = torch.randn(batch_size, 6, 32, generator=g)
    y = torch.randint(0, 10, (batch_size,), generator=g)
    return x, y


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {"mlp": MLP, "cnn": CNN, "transformer": TransformerBlock}[kind]()


def make_optimizer(name: str, params, lr: float = 1e-2):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    family, _, variant = name.partition("_")
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[family]
    options = {"": {}, "foreach": {"foreach": True}, "fused": {"fused": True}, "loop": {"foreach": False}}[variant]
    return cls(params, lr=lr, **options)


def train_step(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def mse_step(x, y, *, model, opt, scale=1.0):
    """A regression step; `scale` multiplies the loss (a number backward also uses)."""
    loss = F.mse_loss(model(x), y) * scale
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def closure_mse_step(model: nn.Module, opt):
    """mse_step with the model and optimizer held in its closure, not given by keyword."""
    def step(x, y):
        return mse_step(x, y, model=model, opt=opt)
    return step


class _Holder:
    def __init__(self, model, opt):
        self.model, self.opt = model, opt


def _held_step(holder: _Holder, x, y):
    return mse_step(x, y, model=holder.model, opt=holder.opt)


def helper_mse_step(model: nn.Module, opt):
    """mse_step reached through a helper function and an object of the user's: the step's closure
    holds neither the model nor the optimizer itself."""
    holder = _Holder(model, opt)

    def step(x, y):
        return _held_step(holder, x, y)
    return step


def twin(model: nn.Module, opt_name: str, lr: float = 1e-2):
    """Two identical (model, optimizer) pairs: one for eager, one for the traced run."""
    a = model
    b = copy.deepcopy(model)
    return (a, make_optimizer(opt_name, a.parameters(), lr)), (b, make_optimizer(opt_name, b.parameters(), lr))


def assert_same_state(model_a, opt_a, model_b, opt_b, exact=True, atol=1e-6):
    check = (lambda a, b: torch.equal(a, b)) if exact else (lambda a, b: torch.allclose(a, b, atol=atol, rtol=1e-5))
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        assert check(a, b), f"{name} differs: max |diff| {(a.double() - b.double()).abs().max().item()}"
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert (pa.grad is None) == (pb.grad is None)
        if pa.grad is not None:
            assert check(pa.grad, pb.grad)
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        for field, value in state_a[key].items():
            other = state_b[key][field]
            if isinstance(value, torch.Tensor):
                assert check(value, other), f"optimizer state {key}.{field} differs"
            else:
                assert value == other


def train_side_by_side(kind: str, opt_name: str, steps: int = 5, step_fn=train_step, scheduler_gamma=None,
                       records: int = 1, fused: bool | None = None, **trace_options):
    """Train an eager and a traced twin from the same seed, asserting equal losses at every step
    and that the JIT ran (side_by_side.assert_replayed: `records`, `fused`).

    Returns ((model, opt) eager, (model, opt) traced, traced function)."""
    from side_by_side import assert_replayed

    import tracejit

    (model_a, opt_a), (model_b, opt_b) = twin(make_model(kind), opt_name)
    schedulers = []
    if scheduler_gamma is not None:
        schedulers = [torch.optim.lr_scheduler.ExponentialLR(o, gamma=scheduler_gamma) for o in (opt_a, opt_b)]
    traced = tracejit.trace(step_fn, **trace_options)
    for i in range(steps):
        x, y = batch(kind, i)
        torch.manual_seed(100 + i)
        loss_a = step_fn(x, y, model=model_a, opt=opt_a)
        torch.manual_seed(100 + i)
        loss_b = traced(x, y, model=model_b, opt=opt_b)
        assert torch.equal(loss_a, loss_b), f"step {i}: {loss_a.item()} vs {loss_b.item()}"
        for scheduler in schedulers:
            scheduler.step()
    assert_replayed(traced, steps, records, fused)
    return (model_a, opt_a), (model_b, opt_b), traced
