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


def assert_close_to_eager(got: torch.Tensor, want: torch.Tensor, exact: bool, ulps: int = 4,
                          reference: torch.Tensor | None = None) -> None:
    """`got` matches eager's `want` on this machine: equal (exact), or NaN and infinities in the same
    places and the rest within `ulps`. `reference`, the same computation in float64 rounded to the
    dtype, is a second opinion for each element: eager's vectorized transcendental functions differ
    between CPUs (AVX-512 gives gelu(inf) = nan, AVX2 inf), so an element that matches either passes."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.stride() == want.stride(), f"strides {got.stride()} vs eager {want.stride()}"
    if exact or not want.dtype.is_floating_point:
        assert torch.equal(got, want) or torch.equal(got.isnan(), want.isnan()) and torch.equal(
            got[~got.isnan()], want[~want.isnan()]), f"max |diff| {(got.double() - want.double()).abs().max()}"
        return
    ok = _close(got, want, ulps)
    if reference is not None:
        ok |= _close(got, reference.to(want.dtype), ulps)
    if not ok.all():
        g, w = got[~ok], want[~ok]
        raise AssertionError(f"{int((~ok).sum())} elements beyond {ulps} ulps of eager (NaN and infinities must "
                             f"agree), e.g. {g[:3].tolist()} vs eager {w[:3].tolist()}")


def _close(got: torch.Tensor, want: torch.Tensor, ulps: int) -> torch.Tensor:
    """Per element: both NaN, the same infinity, or finite and within `ulps` of `want`."""
    g, w = got.double(), want.double()
    eps = torch.finfo(want.dtype).eps
    tiny = torch.finfo(want.dtype).tiny
    bound = ulps * eps * torch.maximum(w.abs(), torch.ones_like(w)) + tiny
    finite = torch.isfinite(g) & torch.isfinite(w) & ((g - w).abs() <= bound)
    return (g.isnan() & w.isnan()) | (g.isinf() & (g == w)) | finite


def float64_reference(function, *inputs: torch.Tensor) -> torch.Tensor:
    """`function` on the floating inputs promoted to float64 (a second opinion for
    assert_close_to_eager)."""
    return function(*(i.double() if i.dtype.is_floating_point else i for i in inputs))


def trace_with(backend: str, function, **options):
    return tracejit.trace(function, backend=backend, **options)
