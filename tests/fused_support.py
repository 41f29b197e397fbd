"""Helpers for the fused-kernel tests: trace a function with a backend and look at its kernels."""

from __future__ import annotations

import torch

import tracejit
from tracejit.backends.optable import OP_TABLE
from tracejit.ir import Op

SPECIAL_VALUES = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.9, -4.2, 20.0, -20.0, 88.0, -88.0, 100.0, -110.0,
                  1e-30, -1e-30, 1e-45, 1e30, -1e30, float("inf"), float("-inf"), float("nan")]


def fused_nodes(traced) -> list:
    """FUSED nodes of the program each trace runs now (see TraceEntry.serving_program)."""
    found = []
    for entry in traced._entries():
        graph = entry.serving_program.graph
        found += [n for n in graph.nodes if n.op is Op.FUSED]
    return found


def dtypes_of(entry_name: str) -> list[torch.dtype]:
    kind = OP_TABLE[entry_name].dtypes
    if kind == "number":
        return [torch.float32, torch.float64, torch.int64, torch.int32]
    if kind == "bool":
        return [torch.float32]  # the examples build their bool operands from float comparisons
    return [torch.float32, torch.float64]


def example_inputs(dtype: torch.dtype, shape=(7, 33), seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g).to(dtype) * 2
        y = torch.randn(shape, generator=g).to(dtype) * 2
        z = torch.rand(shape, generator=g).to(dtype) + 0.25
    else:
        x = torch.randint(-20, 20, shape, generator=g).to(dtype)
        y = torch.randint(-20, 20, shape, generator=g).to(dtype)
        z = torch.randint(1, 20, shape, generator=g).to(dtype)
    return x, y, z


def assert_close_to_eager(got: torch.Tensor, want: torch.Tensor, exact: bool, ulps: int = 4) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.stride() == want.stride(), f"strides {got.stride()} vs eager {want.stride()}"
    if exact or not want.dtype.is_floating_point:
        assert torch.equal(got, want) or torch.equal(got.isnan(), want.isnan()) and torch.equal(
            got[~got.isnan()], want[~want.isnan()]), f"max |diff| {(got.double() - want.double()).abs().max()}"
        return
    assert torch.equal(got.isnan(), want.isnan()), "NaN in different places"
    finite = ~want.isnan()
    g, w = got[finite].double(), want[finite].double()
    assert torch.equal(g.isinf(), w.isinf()) and torch.equal(g[g.isinf()], w[w.isinf()]), "infinities differ"
    eps = torch.finfo(want.dtype).eps
    tiny = torch.finfo(want.dtype).tiny
    bound = ulps * eps * torch.maximum(w.abs(), torch.full_like(w, 1.0)) + tiny
    diff = (g - w).abs()
    diff[g.isinf()] = 0
    assert (diff <= bound).all(), f"max |diff| {diff.max().item()} beyond {ulps} ulps"


def trace_with(backend: str, function, **options):
    return tracejit.trace(function, backend=backend, **options)
