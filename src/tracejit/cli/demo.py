"""`tracejit demo`: train a small classifier eagerly and traced, side by side, then dump the
trained classifier for inference, load it back as a user without the model code would, run it,
and show where its calls spend their time."""

from __future__ import annotations

import copy
import os
import statistics
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


ROUND_STEPS = 10  # one system's turn: the systems alternate in rounds this short
WARMUP_STEPS = 5  # per system, not timed: the first call records and compiles
MIN_STEPS = WARMUP_STEPS + 1  # fewer would time nothing


def _batches(x, y, steps: int, batch: int = 32):
    for i in range(steps):
        lo = (i * batch) % (len(x) - batch)
        yield x[lo:lo + batch], y[lo:lo + batch]


def _train_in_rounds(systems: dict, x, y, steps: int) -> dict:
    """Train every system on the same batches, in turns of ROUND_STEPS steps, each round in another
    order: a busy neighbour slows every system alike, so the ratios stay meaningful. Returns, per
    system, (model, step times in seconds, per-round times, losses)."""
    first = _model()
    state = {}
    for name, function in systems.items():
        model = copy.deepcopy(first)
        state[name] = (function, model, torch.optim.Adam(model.parameters(), lr=1e-3, fused=True), [], [], [])
    batches = list(_batches(x, y, steps))
    names = list(systems)
    for round_index, lo in enumerate(range(0, steps, ROUND_STEPS)):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            function, model, opt, times, rounds, losses = state[name]
            this_round = []
            for i in range(lo, min(lo + ROUND_STEPS, steps)):
                xb, yb = batches[i]
                start = time.perf_counter()
                loss = function(xb, yb, model=model, opt=opt)
                elapsed = time.perf_counter() - start
                times.append(elapsed)
                if i >= WARMUP_STEPS:
                    this_round.append(elapsed)
                losses.append(loss.item())
            rounds.append(this_round)
    return {name: (model, times, rounds, losses) for name, (_, model, _, times, rounds, losses) in state.items()}


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return (values[0],) * 3 if values else (float("nan"),) * 3
    low, median, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, median, high


def _training(x, y, steps: int) -> tuple[nn.Module, bool]:
    """Eager, checked replay and without_host from the same start; True when all end identical."""
    systems = {"eager": step, "traced, checked replay": tracejit.trace(step),
               "traced, without_host": tracejit.trace(step, without_host=True)}
    results = _train_in_rounds(systems, x, y, steps)
    timed = {name: [t for r in rounds for t in r] for name, (_, _, rounds, _) in results.items()}
    eager_rounds = results["eager"][2]
    print(f"  step times after {WARMUP_STEPS} warm-up steps, systems alternating every {ROUND_STEPS} steps "
          f"(median, p25-p75):")
    for name, times in timed.items():
        low, median, high = _quartiles(times)
        line = f"  {name + ':':<26}{median * 1e6:9.1f} us ({low * 1e6:.1f}-{high * 1e6:.1f})"
        if name != "eager":
            ratios = [statistics.median(e) / statistics.median(r) for e, r in zip(eager_rounds, results[name][2])
                      if e and r]
            r_low, r_median, r_high = _quartiles(ratios)
            line += f"   speedup vs eager {r_median:5.2f}x ({r_low:.2f}-{r_high:.2f}x over {len(ratios)} rounds)"
        print(line)
    print(f"  {'first traced call (record + compile):':<40}{results['traced, without_host'][1][0] * 1e3:9.1f} ms")
    model, _, _, losses = results["eager"]
    same = all(torch.equal(a, b) for other, _, _, _ in results.values() for a, b in zip(model.parameters(),
                                                                                        other.parameters()))
    print(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}; parameters of both traced runs identical to eager: {same}")
    return results["traced, without_host"][0], same


def _inference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, path: str) -> bool:
    """Dump the trained classifier to `path`, load it back, run it over the data; True when it matches eager."""
    model.eval()
    traced = tracejit.trace(classify, capture_as_const=True)
    batch = x[:256]
    traced(batch, model=model)
    info = traced.dump(path, arg_names=["x"], output_names=["logits"], keep_param_name=True,
                       input_data="#rand(-4,4)", user_info={"classes": 10, "features": 64})
    print(f"dumped for inference (eval mode, capture_as_const=True) to {path}: {info.ops} ops, "
          f"{info.params} parameters, {info.file_size / 1024:.1f} KiB, test case max error {info.max_errors[0]:.2g}")
    print(f"  (full path {os.path.abspath(path)}; try `tracejit show {path}` and "
          f"`tracejit run {path} --check --profile`)")
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


def output_path(out: str | None) -> str:
    """Where the demo writes its dump: `--out` (a file, or a directory to put classifier.tjit in),
    by default classifier.tjit in the current directory, where docs/cli.md's commands find it."""
    if out is None:
        return DUMP_NAME
    if os.path.isdir(out) or out.endswith(os.sep):
        return os.path.join(out, DUMP_NAME)
    return out


DUMP_NAME = "classifier.tjit"


def check_writable(path: str) -> None:
    """Fail before minutes of training rather than after: create and remove a file where the dump's
    temporary file will go (the dump writes `path` through one, next to it)."""
    probe = f"{path}.tmp{os.getpid()}"
    try:
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as error:
        raise ValueError(f"--out: cannot write the dump to {path!r}: {error.strerror or error}") from None


def run_demo(steps: int = 200, out: str | None = None) -> int:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    path = output_path(out)
    check_writable(path)
    x, y = _data()
    print(f"tracejit {tracejit.__version__} demo: MLP 64-128-128-10 classifier, batch 32, Adam(fused=True), "
          f"{steps} steps per system, {torch.get_num_threads()} threads")
    model, same = _training(x, y, steps)
    matches = _inference(model, x, y, path)
    return 0 if same and matches else 1
