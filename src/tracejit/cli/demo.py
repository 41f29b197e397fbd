"""`tracejit demo`: train a small classifier eagerly and traced, side by side."""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def _data(n: int = 2048):
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(10, 64, generator=g) * 2
    y = torch.randint(0, 10, (n,), generator=g)
    x = centers[y] + torch.randn(n, 64, generator=g)
    return x, y


def step(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _train(step_fn, model, opt, x, y, steps: int, batch: int = 32) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for i in range(steps):
        lo = (i * batch) % (len(x) - batch)
        xb, yb = x[lo:lo + batch], y[lo:lo + batch]
        start = time.perf_counter()
        loss = step_fn(xb, yb, model=model, opt=opt)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return times, losses


def run_demo(steps: int = 200) -> int:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    x, y = _data()
    eager_model = _model()
    traced_model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.Adam(eager_model.parameters(), lr=1e-3, fused=True)
    traced_opt = torch.optim.Adam(traced_model.parameters(), lr=1e-3, fused=True)
    traced_step = tracejit.trace(step)

    print(f"tracejit {tracejit.__version__} demo: MLP 64-128-128-10, batch 32, Adam(fused=True), {steps} steps")
    eager_times, eager_losses = _train(step, eager_model, eager_opt, x, y, steps)
    traced_times, traced_losses = _train(traced_step, traced_model, traced_opt, x, y, steps)

    same = all(torch.equal(a, b) for a, b in zip(eager_model.parameters(), traced_model.parameters()))
    eager_median = statistics.median(eager_times[5:]) * 1e6
    traced_median = statistics.median(traced_times[5:]) * 1e6
    print(f"  first call (record):   {traced_times[0] * 1e3:8.2f} ms")
    print(f"  eager step (median):   {eager_median:8.1f} us")
    print(f"  traced step (median):  {traced_median:8.1f} us   (checked replay, every op verified)")
    print(f"  speedup vs eager:      {eager_median / traced_median:8.2f} x")
    print(f"  loss: {eager_losses[0]:.4f} -> {eager_losses[-1]:.4f} eager, "
          f"{traced_losses[0]:.4f} -> {traced_losses[-1]:.4f} traced")
    print(f"  parameters identical to eager: {same}")
    return 0 if same else 1
