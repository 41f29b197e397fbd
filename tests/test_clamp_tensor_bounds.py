"""`clamp`, `clamp_min` and `clamp_max` with tensor bounds (issue 15.2). Unfused (backend="aten",
float16 on the C backend) the host-free program once wrote them through the scalar overload's
`out=` variant (`clamp.out`, whose bounds are numbers) and crashed from call 2 on. Every mode, over
several calls with fresh values, against eager."""

from __future__ import annotations

import pytest
import torch

import tracejit


def clamp_min(a, b, c):
    return torch.clamp(a, min=b) * 1


def clamp_max(a, b, c):
    return torch.clamp(a, max=c) * 1


def clamp_both(a, b, c):
    return torch.clamp(a, min=b, max=c) * 1


def clamp_method(a, b, c):
    return a.clamp(b, c) * 1


def clamp_min_op(a, b, c):
    return torch.clamp_min(a, b) + torch.clamp_max(a, c)


def clamp_broadcast_bound(a, b, c):
    return torch.clamp(a, min=b[:1], max=c) * 1


def clamp_in_place(a, b, c):
    x = a * 1
    x.clamp_(min=b, max=c)
    y = a * 1
    torch.clamp_min_(y, b)
    return x + y


FUNCTIONS = [clamp_min, clamp_max, clamp_both, clamp_method, clamp_min_op, clamp_broadcast_bound, clamp_in_place]
MODES = {
    "checked": dict(),
    "without_host_aten": dict(without_host=True, backend="aten"),
    "without_host_c": dict(without_host=True, backend="c"),
}


def _inputs(dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randn(6, 5, generator=g) * 50 for _ in range(3))
    b, c = torch.minimum(b, c), torch.maximum(b, c)
    return tuple(t.to(dtype) for t in (a, b, c))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.uint8])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("function", FUNCTIONS, ids=lambda f: f.__name__)
def test_tensor_bounds_match_eager(function, mode, dtype):
    traced = tracejit.trace(function, **MODES[mode])
    for seed in range(4):
        inputs = _inputs(dtype, seed)
        got, want = traced(*inputs), function(*inputs)
        assert got.dtype == want.dtype and torch.equal(got, want), (function.__name__, seed)
    stats = traced.stats
    assert stats.records == 1
    if mode == "checked":
        assert stats.checked_replays == 3
    else:
        assert stats.host_free_calls == 3 and stats.host_free_misses == 0


def test_out_overload_matches_argument_types():
    from tracejit.passes.plan_memory import out_overload
    aten = torch.ops.aten
    assert out_overload(aten.clamp.Tensor) is aten.clamp.Tensor_out
    assert out_overload(aten.clamp.default) is aten.clamp.out
    assert out_overload(aten.clamp_min.Tensor) is aten.clamp_min.Tensor_out
    assert out_overload(aten.add.Scalar) is aten.add.Scalar_out  # not add.out: its `other` is a tensor
    assert out_overload(aten.div.Tensor_mode) is aten.div.out_mode  # found by signature, not by name
