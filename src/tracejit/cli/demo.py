"""`tracejit demo`: train a small classifier eagerly and traced, side by side, then dump the
trained classifier for inference, load it back as a user without the model code would, run it,
and show where its calls spend their time."""

from __future__ import annotations

import copy
import os
import statistics
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit

from ..runtime.profile import format_table


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


def classify(x, *, model):
    with torch.no_grad():
        return model(x)


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


def _median_us(times: list[float]) -> float:
    return statistics.median(times[min(5, len(times) - 1):]) * 1e6


def _training(x, y, steps: int) -> tuple[nn.Module, bool]:
    """Eager, checked replay and without_host from the same start; True when all end identical."""
    systems = {"eager": step, "traced, checked replay": tracejit.trace(step),
               "traced, without_host": tracejit.trace(step, without_host=True)}
    first = _model()
    results = {}
    for name, function in systems.items():
        model = copy.deepcopy(first)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
        times, losses = _train(function, model, opt, x, y, steps)
        results[name] = (model, times, losses)
    eager_us = _median_us(results["eager"][1])
    for name, (_, times, _) in results.items():
        note = "" if name == "eager" else f"   speedup vs eager {eager_us / _median_us(times):5.2f}x"
        print(f"  {name + ' step (median):':<40}{_median_us(times):9.1f} us{note}")
    print(f"  {'first traced call (record + compile):':<40}{results['traced, without_host'][1][0] * 1e3:9.1f} ms")
    model, _, losses = results["eager"]
    same = all(torch.equal(a, b) for other, _, _ in results.values() for a, b in zip(model.parameters(),
                                                                                     other.parameters()))
    print(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}; parameters of both traced runs identical to eager: {same}")
    return results["traced, without_host"][0], same


def _inference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, directory: str) -> bool:
    """Dump the trained classifier, load it back, run it over the data; True when it matches eager."""
    model.eval()
    traced = tracejit.trace(classify, capture_as_const=True)
    batch = x[:256]
    traced(batch, model=model)
    path = os.path.join(directory, "classifier.tjit")
    info = traced.dump(path, arg_names=["x"], output_names=["logits"], keep_param_name=True,
                       input_data="#rand(-4,4)", user_info={"classes": 10, "features": 64})
    print(f"dumped for inference (eval mode, capture_as_const=True) to {os.path.basename(path)}: {info.ops} ops, "
          f"{info.params} parameters, {info.file_size / 1024:.1f} KiB, test case max error {info.max_errors[0]:.2g}")
    loaded = tracejit.load(path, profiling=True)
    worst, correct = 0.0, 0
    for start in range(0, len(x) - len(batch) + 1, len(batch)):
        chunk = x[start:start + len(batch)]
        logits = loaded(chunk)["logits"]
        worst = max(worst, (logits - classify(chunk, model=model)).abs().max().item())
        correct += (logits.argmax(1) == y[start:start + len(batch)]).sum().item()
    seen = len(x) // len(batch) * len(batch)
    print(f"loaded back with tracejit.load: max |loaded - eager| {worst:.2g} over {seen} samples, "
          f"accuracy {correct / seen:.1%}")
    print(format_table(loaded.get_profile()))
    return worst <= 1e-5


def run_demo(steps: int = 200) -> int:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    x, y = _data()
    print(f"tracejit {tracejit.__version__} demo: MLP 64-128-128-10 classifier, batch 32, Adam(fused=True), "
          f"{steps} steps per system")
    model, same = _training(x, y, steps)
    with tempfile.TemporaryDirectory(prefix="tracejit-demo-") as directory:
        matches = _inference(model, x, y, directory)
    return 0 if same and matches else 1
