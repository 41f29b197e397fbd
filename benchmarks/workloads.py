"""The workloads of BENCHMARKS.md: each row builds a fresh, seeded Case that one system runs.

A Case is a step function with its arguments. Training rows call `train_step` (forward, backward,
`opt.step()`, `opt.zero_grad()`); forward rows also carry a module computing the same result, for
torch.jit.trace. Every build starts from the same seed, so every system starts from identical
parameters, optimizer settings and inputs, and its results can be compared with eager's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import models

SEED = 0
ADAM_VARIANTS = {"foreach=False": {"foreach": False}, "foreach=True": {"foreach": True}, "fused=True": {"fused": True}}


def train_step(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def clipped_train_step(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def logged_train_step(x, y, *, model, opt):
    """The tutorials' loop: the loss read on the host after the update, on every call."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    LOSSES.append(loss.item())
    del LOSSES[:-100]  # a running window: the log does not grow with the run
    return loss.detach()


LOSSES: list[float] = []


def infer(x, *, model):
    with torch.no_grad():
        return model(x)


def optimizer_step(*, opt):
    opt.step()


@dataclass
class Case:
    function: Callable[..., Any]
    args: tuple
    kwargs: dict
    module: nn.Module | None = None  # forward rows: module(*args) computes function's result

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor a step may change: parameters, gradients, buffers, optimizer state."""
        tensors = {}
        for name, value in self.kwargs.items():
            if isinstance(value, nn.Module):
                for key, param in value.named_parameters():
                    tensors[f"{name}.{key}"] = param
                    if param.grad is not None:
                        tensors[f"{name}.{key}.grad"] = param.grad
                tensors.update({f"{name}.{key}": buffer for key, buffer in value.named_buffers()})
            elif isinstance(value, torch.optim.Optimizer):
                params = [p for group in value.param_groups for p in group["params"]]
                for index, param in enumerate(params):
                    tensors[f"{name}.param{index}"] = param
                    tensors.update({f"{name}.state{index}.{key}": v for key, v in value.state.get(param, {}).items()
                                    if isinstance(v, torch.Tensor)})
        return tensors


@dataclass(frozen=True)
class Workload:
    name: str  # the table row, e.g. "mlp_train_small[fused=True]"
    kind: str  # "train", "forward" or "optimizer"
    description: str
    build: Callable[[], Case]
    ideal_bytes: int | None = None  # bandwidth-bound rows: bytes one ideal pass reads and writes
    random: bool = False  # draws random numbers (dropout)
    report_recording: bool = False  # issue 2: also time the recording call in this process

    @property
    def family(self) -> str:
        return self.name.split("[")[0]


def _generator() -> torch.Generator:
    torch.manual_seed(SEED)
    return torch.Generator().manual_seed(SEED)


def _training(model_factory: Callable[[], nn.Module], x_shape: tuple, classes: int, adam: dict,
              step: Callable[..., Any] = train_step) -> Callable[[], Case]:
    def build() -> Case:
        generator = _generator()
        model = model_factory()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, **adam)
        x = torch.randn(*x_shape, generator=generator)
        y = torch.randint(0, classes, (x_shape[0],), generator=generator)
        return Case(step, (x, y), {"model": model, "opt": opt})
    return build


def _mlp_infer() -> Case:
    generator = _generator()
    model = models.mlp((64, 128, 128, 10)).eval()
    return Case(infer, (torch.randn(1, 64, generator=generator),), {"model": model}, module=model)


def _elementwise(numel: int) -> Callable[[], Case]:
    def build() -> Case:
        generator = _generator()
        x, y = (torch.randn(numel, generator=generator) for _ in range(2))
        return Case(models.elementwise_chain, (x, y), {}, module=models.ElementwiseChain())
    return build


def _adam_only(tensors: int, numel: int, adam: dict) -> Callable[[], Case]:
    def build() -> Case:
        generator = _generator()
        params = [nn.Parameter(torch.randn(numel, generator=generator)) for _ in range(tensors)]
        for param in params:
            param.grad = torch.randn(numel, generator=generator)
        return Case(optimizer_step, (), {"opt": torch.optim.Adam(params, lr=1e-3, **adam)})
    return build


def _rows() -> list[Workload]:
    small = (64, 128, 128, 10)
    rows = [
        Workload(f"mlp_train_small[{variant}]", "train",
                 f"MLP 64-128-128-10, batch 32, cross_entropy, backward, Adam(lr=1e-3, {variant}) step, zero_grad",
                 _training(lambda: models.mlp(small), (32, 64), 10, adam), report_recording=True)
        for variant, adam in ADAM_VARIANTS.items()
    ]
    rows += [
        Workload("mlp_train_clipped", "train",
                 "mlp_train_small's step with clip_grad_norm_(model.parameters(), 1.0) before Adam(lr=1e-3, fused=True)",
                 _training(lambda: models.mlp(small), (32, 64), 10, {"fused": True}, clipped_train_step)),
        Workload("mlp_train_logged", "train",
                 "mlp_train_small's step reading the loss on the host after the update (`losses.append(loss.item())`), "
                 "Adam(lr=1e-3, fused=True)",
                 _training(lambda: models.mlp(small), (32, 64), 10, {"fused": True}, logged_train_step)),
        Workload("mlp_train_medium", "train",
                 "MLP 784-512-512-10, batch 128, same step, Adam(lr=1e-3, fused=True)",
                 _training(lambda: models.mlp((784, 512, 512, 10)), (128, 784), 10, {"fused": True})),
        *(Workload(f"adam_only_large[{variant}]", "optimizer",
                   f"Adam(lr=1e-3, {variant}).step() over 20 x 500k float32 parameters, grads pre-filled",
                   _adam_only(20, 500_000, ADAM_VARIANTS[variant]), ideal_bytes=7 * 4 * 10_000_000)
          for variant in ("foreach=True", "fused=True")),
        Workload("elementwise_chain", "forward",
                 "((x*y + 1).sigmoid() * x - y).tanh() * 0.5 + x on 4M float32 (8 ops)",
                 _elementwise(4 * 2**20), ideal_bytes=3 * 4 * 4 * 2**20),
        Workload("mlp_infer_small", "forward", "mlp_train_small's MLP in eval mode, batch 1, under torch.no_grad()",
                 _mlp_infer),
        Workload("cnn_train", "train",
                 "Conv3-16+BN+ReLU, maxpool, Conv16-32+BN+ReLU, avgpool, Dropout(0.25), Linear; batch 16 of "
                 "3x32x32; same step, Adam(lr=1e-3, fused=True)",
                 _training(models.SmallCNN, (16, 3, 32, 32), 10, {"fused": True}), random=True),
        Workload("transformer_train", "train",
                 "pre-norm block, width 64, 4 heads, softmax attention, GELU MLP, mean-pooled head; batch 8 x 32 "
                 "tokens; same step, Adam(lr=1e-3, fused=True)",
                 _training(models.TransformerBlock, (8, 32, 64), 10, {"fused": True})),
    ]
    return rows


WORKLOADS: dict[str, Workload] = {w.name: w for w in _rows()}
# Warms each system's one-time machinery up (in first-call subprocesses): the chain on 16 floats.
TINY = Workload("tiny", "forward", "elementwise_chain on 16 float32", _elementwise(16))
QUICK_ROWS = ("mlp_train_small[fused=True]", "elementwise_chain", "mlp_infer_small")


def select(only: str | None) -> list[Workload]:
    """Rows named by --only: a comma list of row names or families (mlp_train_small = its 3 rows)."""
    if not only:
        return list(WORKLOADS.values())
    names = [name.strip() for name in only.split(",") if name.strip()]
    rows = [w for w in WORKLOADS.values() if w.name in names or w.family in names]
    unknown = [n for n in names if not any(n in (w.name, w.family) for w in WORKLOADS.values())]
    if unknown:
        raise SystemExit(f"--only: unknown workload(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted({w.family for w in WORKLOADS.values()}))} "
                         f"or a row name such as {next(iter(WORKLOADS))}")
    return rows
