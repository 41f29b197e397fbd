"""The functions the Triton tests trace, each with its first call: `CASES[name]()` gives
(function, positional inputs, keyword arguments, extra information). The interpreter tests run them
for several calls against eager; the offline build test calls each `info.get("calls", 1)` times
(a first call records and builds the kernels) to collect every kernel they generate."""

from __future__ import annotations

import dataclasses
import random

import torch
import triton_support as ts
from models import batch, make_model

import tracejit
from tracejit.backends.optable import OP_TABLE
from tracejit.backends.triton.render import render_kernel


def trace(function, **options):
    return tracejit.trace(function, backend="triton", **options)


def sweep_case(dtype):
    return ts.sweep_function(dtype), ts.random_inputs(dtype, 0), {}, {}


CHAIN_ENTRIES = [e for e in OP_TABLE.values() if e.dtypes in ("float", "number")]
CHAIN_TYPES = [(torch.float32,) * 3, (torch.float64,) * 3, (torch.float32, torch.float16, torch.float32),
               (torch.bfloat16, torch.float32, torch.float16)]


def chain_case(seed):
    rng = random.Random(seed)
    entries = [rng.choice(CHAIN_ENTRIES) for _ in range(rng.randint(3, 6))]
    dtypes = CHAIN_TYPES[seed % len(CHAIN_TYPES)]

    def chain(x, y, z):
        a, b = x, y
        for entry in entries:
            result = entry.example(a, b, z)
            a, b = (result.to(x.dtype) if result.dtype == torch.bool else result), a
        return a * 1, b * 1

    inputs = tuple(t.to(d) for t, d in zip(ts.random_inputs(torch.float64, seed), dtypes))
    return chain, inputs, {}, {"entries": entries, "dtypes": dtypes}


def elementwise_chain(x, y):
    return ((x * y + 1).sigmoid() * x - y).tanh() * 0.5 + x


def bias_add(x, b, column, s):
    return ((x + b).relu() * s + column).sigmoid()


def noncontiguous(x, y):
    a = x.t() * 2 + y[:, ::2]  # a transposed and a strided view: N-d index math
    return a.relu(), (a * y[:, 1::2]).t()


def in_place(x, y, acc):
    x.mul_(0.5).add_(y).clamp_(-1.0, 1.0)
    acc.add_(x * y)
    return (x + acc).tanh()


def foreach_lists(*tensors):
    xs, ys = list(tensors[:4]), list(tensors[4:])
    torch._foreach_mul_(xs, 0.9)
    torch._foreach_add_(xs, ys, alpha=0.1)
    return torch._foreach_sigmoid(xs)


def list_inputs(seed):
    """Two lists of four tensors: larger than a block, 2-d, 0-d and small."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(3000,), (40, 33), (), (7,)] * 2
    return tuple(torch.randn(s, generator=g) for s in shapes)


def masked(x, keep):
    return torch.where(keep, x, 0.0).relu() * 2, keep.logical_not()  # bool loads and stores


def small_ints(a, b, c):
    return (a + b) * c, (a * 3).abs(), b.to(torch.float16) * 0.5  # int8, uint8, int16: promotion, wrap-around


def small_int_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-128, 128, (500,), generator=g, dtype=torch.int8),
            torch.randint(0, 256, (500,), generator=g, dtype=torch.uint8),
            torch.randint(-300, 300, (500,), generator=g, dtype=torch.int16))


def foreach_ints(*tensors):
    return torch._foreach_mul(torch._foreach_add(list(tensors), 3), -2)  # int scalars in the lane table


def scaled(x, y, *, lr, k):
    return (x * lr + y).relu() + k


def log_of_powers(x, y):
    # log2 and log10 are exact at powers of their base (floor of them counts bits and digits)
    return torch.floor(torch.log2(x * 1.0)), torch.floor(torch.log10(y * 1.0))


def powers_of_the_base(dtype):
    return (torch.tensor([2.0 ** k for k in range(-20, 21)], dtype=dtype),
            torch.tensor([10.0 ** k for k in range(-5, 11)], dtype=dtype))


def half_truths(x, y):
    # a half value as a condition: -0.0 is false (its bits are not zero: compare it widened)
    return (x * 1).to(torch.bool), torch.where((y * 1).bool(), x, y)


def signed_zeros(dtype):
    return (torch.tensor([0.0, -0.0, 1.5, -2.0, float("nan")], dtype=dtype),
            torch.tensor([-0.0, 0.0, 0.0, 3.0, -0.0], dtype=dtype))


CASES = {
    **{f"sweep-{str(d).split('.')[-1]}": (lambda d=d: sweep_case(d)) for d in ts.FLOAT_TYPES + ts.INT_TYPES},
    **{f"chain-{seed}": (lambda seed=seed: chain_case(seed)) for seed in range(12)},
    "elementwise_chain": lambda: (elementwise_chain, (torch.randn(1000), torch.randn(1000)), {}, {}),
    "bias_add": lambda: (bias_add, (torch.randn(24, 40), torch.randn(40), torch.randn(24, 1), torch.tensor(0.7)),
                         {}, {}),
    "noncontiguous": lambda: (noncontiguous, (torch.randn(40, 24), torch.randn(24, 80)), {}, {}),
    "in_place": lambda: (in_place, (torch.randn(300), torch.randn(300), torch.zeros(300)), {}, {}),
    "foreach_lists": lambda: (foreach_lists, list_inputs(0), {}, {}),
    "masked": lambda: (masked, (torch.randn(64, 8), torch.randn(64, 8) > 0), {}, {}),
    "small_ints": lambda: (small_ints, small_int_inputs(0), {}, {}),
    "foreach_ints": lambda: (foreach_ints, (torch.arange(2000), torch.arange(5), torch.tensor(7)), {}, {}),
    "scaled": lambda: (scaled, (torch.randn(100), torch.randn(100)), {"lr": 0.1, "k": 3}, {}),
    **{f"log_powers-{str(d).split('.')[-1]}": (lambda d=d: (log_of_powers, powers_of_the_base(d), {}, {}))
       for d in (torch.float32, torch.float64)},
    **{f"half_truths-{str(d).split('.')[-1]}": (lambda d=d: (half_truths, signed_zeros(d), {}, {}))
       for d in (torch.float16, torch.bfloat16)},
}


# -- training steps: forward, backward and a multi-tensor optimizer step ----------------------------

def optimizer(name, params, lr=1e-2):
    if name == "adam_foreach":
        return torch.optim.Adam(params, lr=lr, foreach=True)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=True)


def train_step(x, y, *, model, opt):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def training_case(opt_name, without_host=False):
    """The first step creates the optimizer state, the second records again with it: three calls
    build every kernel a training run uses."""
    model = make_model("mlp")
    return train_step, batch("mlp", 0), {"model": model, "opt": optimizer(opt_name, model.parameters())}, {
        "options": {"without_host": without_host}, "calls": 3}


CASES.update({f"train-{o}-{h}": (lambda o=o, h=h: training_case(o, h)) for o, h in
              [("adam_foreach", False), ("sgd_momentum", False), ("sgd_momentum", True)]})


# -- rendered only ----------------------------------------------------------------------------------------

def huge_kernel():
    """The elementwise_chain kernel rendered for 3 * 2^30 elements (rendered only: too big to run here)."""
    traced = trace(elementwise_chain)
    traced(torch.randn(1000), torch.randn(1000))
    (launcher,) = ts.triton_launchers(traced)
    lane = dataclasses.replace(launcher.spec.lanes[0], shape=(3 * 2**30,))
    return render_kernel(dataclasses.replace(launcher.spec, lanes=(lane,)))
