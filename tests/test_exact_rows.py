"""Max pooling's row kernels at the default opt_level: they give eager's numbers bit for bit (nothing
is summed), so they are on from opt_level=2 with an unset jit_fuse_reduce, as elementwise fusion is.
The C kernel runs a window unrolled and neighbouring windows in vector lanes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fused_support import fused_nodes
from models import batch, make_model, twin

import tracejit

INF, NAN = float("inf"), float("nan")


def row_members(traced) -> list[list[str]]:
    return [[str(m.target).split(".")[1] for m in n.members] for n in fused_nodes(traced) if n.name.startswith("row")]


def kernel_sources(traced) -> list[str]:
    return [k.source for entry in traced._entries() for k in entry.serving_program.kernels.values()
            if hasattr(k, "source")]


def pool_and_grad(x, weight, *, kernel, activate=True):
    """(relu,) max pooling (values and indices) and the gradient of a weighted sum back to x (a
    leaf that requires grad)."""
    values, indices = F.max_pool2d(F.relu(x) if activate else x * 1, kernel, return_indices=True)
    (values * weight).sum().backward()
    return values.detach(), indices, x.grad


def windows_of_special_values(shape, kernel, dtype) -> torch.Tensor:
    """Random windows, then windows of NaN (one, two), of ties, of -inf, of signed zeros, of
    infinities, of subnormals."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g, dtype=dtype)
    kh, kw = kernel
    n = kh * kw
    specials = [[NAN] + [1.0] * (n - 1), [2.0] + [NAN] * (n - 1), [3.0] * n, [-INF] * n, [-0.0, 0.0] * (n // 2) + [-0.0] * (n % 2),
                [0.0] + [-0.0] * (n - 1), [-0.0] * n, [INF, 5.0] + [INF] * (n - 2), [1e-45] * n, [-2.0] * (n - 1) + [-1.0]]
    planes = x.view(-1, *shape[-2:])
    windows = [(p, r, c) for p in range(planes.shape[0]) for r in range(shape[-2] // kh) for c in range(shape[-1] // kw)]
    for (p, r, c), values in zip(windows, specials):
        planes[p, r * kh:(r + 1) * kh, c * kw:(c + 1) * kw] = torch.tensor(values, dtype=dtype).reshape(kh, kw)
    return x


@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("activate", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,kernel", [((2, 3, 8, 10), (2, 2)), ((3, 2, 9, 9), (3, 3)), ((2, 2, 4, 6), (2, 3)),
                                          ((1, 5, 2, 2), (2, 2)), ((4, 3, 6, 2), (3, 2))])
def test_max_pooling_is_one_exact_kernel_at_the_default_opt_level(shape, kernel, dtype, activate, without_host):
    traced = tracejit.trace(pool_and_grad, backend="c", without_host=without_host)
    g = torch.Generator().manual_seed(3)
    out_shape = (*shape[:2], shape[2] // kernel[0], shape[3] // kernel[1])
    for step in range(4):
        x = windows_of_special_values(shape, kernel, dtype) if step % 2 else torch.randn(shape, generator=g, dtype=dtype)
        weight = torch.randn(out_shape, generator=g, dtype=dtype)
        got = traced(x.clone().requires_grad_(), weight, kernel=kernel, activate=activate)
        want = pool_and_grad(x.clone().requires_grad_(), weight, kernel=kernel, activate=activate)
        for name, a, b in zip(("values", "indices", "grad"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a.isnan(), b.isnan()), (name, a, b)
            assert torch.equal(a[~a.isnan()], b[~b.isnan()]), (name, a, b)
            assert torch.equal(a.signbit(), b.signbit()) or a.dtype == torch.int64, (name, a, b)
    members = row_members(traced)
    assert any({"relu" if activate else "mul", "max_pool2d_with_indices"} <= set(m) for m in members), members
    assert any("max_pool2d_with_indices_backward" in m for m in members), members
    assert traced.stats.host_free_calls + traced.stats.api_replays >= 2


def test_the_window_kernel_runs_windows_in_vector_lanes_without_branches():
    traced = tracejit.trace(pool_and_grad, backend="c", without_host=True)
    weight = torch.randn(2, 3, 4, 4)
    for _ in range(2):
        traced(torch.randn(2, 3, 8, 8, requires_grad=True), weight, kernel=2)
    windows = [s for s in kernel_sources(traced) if 'optimize("no-tree-pre")' in s]
    assert len(windows) == 2, kernel_sources(traced)  # forward and backward
    for source in windows:
        assert "if (j == 0" not in source and "#pragma omp simd" in source, source
    (forward,) = [s for s in windows if "const bool c" in s]  # the maximum by selects


@pytest.mark.parametrize("options", [{"opt_level": 1},
                                     {"graph_opt_config": tracejit.GraphOptimizationConfig(jit_fuse_reduce=False)},
                                     {"backend": "aten"}])
def test_no_row_kernel_where_the_options_say_so(options):
    traced = tracejit.trace(pool_and_grad, **{"backend": "c", "without_host": True, **options})
    x, weight = torch.randn(2, 3, 8, 8), torch.randn(2, 3, 4, 4)
    for _ in range(3):
        got = traced(x.clone().requires_grad_(), weight, kernel=2)
        want = pool_and_grad(x.clone().requires_grad_(), weight, kernel=2)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert row_members(traced) == []


def test_the_default_opt_level_fuses_no_summing_row_op():
    """softmax, log_softmax, layer norm and sums stay aten ops: their row kernels sum in another order."""
    def summing(x):
        return torch.softmax(x * 2, -1), torch.log_softmax(x + 1, -1), F.layer_norm(x * 3, (x.shape[-1],)), x.sum(-1) * 2

    traced = tracejit.trace(summing, backend="c", without_host=True)
    x = torch.randn(4, 16)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(traced(x), summing(x)))
    assert row_members(traced) == []


@pytest.mark.parametrize("without_host", [False, True])
def test_cnn_training_matches_eager_bit_for_bit_at_the_default_opt_level(without_host):
    """Conv, BatchNorm + ReLU, max pooling twice, Adam: every parameter, gradient, running statistic
    and moment equal to eager's after each step."""
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("cnn"), "adam_fused")

    def step(x, y, *, model, opt):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    traced = tracejit.trace(step, backend="c", without_host=without_host)
    for i in range(6):
        x, y = batch("cnn", i)
        torch.manual_seed(i)  # the same Dropout masks
        want = step(x, y, model=model_a, opt=opt_a)
        torch.manual_seed(i)
        got = traced(x, y, model=model_b, opt=opt_b)
        assert torch.equal(got, want), i
        for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
            assert torch.equal(a, b) and torch.equal(a.grad, b.grad), (i, name)
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt_a.state[a][key], opt_b.state[b][key]), (i, name, key)
        for (name, a), b in zip(model_a.named_buffers(), model_b.buffers()):
            assert torch.equal(a, b), (i, name)
    assert sum("max_pool2d_with_indices" in m for m in row_members(traced)) >= 2
    assert traced.stats.host_free_calls + traced.stats.api_replays >= 3


def test_triton_runs_the_same_kernels_at_the_default_opt_level_and_builds_them_for_cuda():
    """On CUDA the default opt_level gives max pooling to Triton's row kernels: bit for bit eager's in
    the interpreter (CPU tensors), and built offline for sm_80 and sm_90."""
    import triton_support as ts

    with ts.interpreter():
        traced = tracejit.trace(pool_and_grad, backend="triton", without_host=True)
        for step in range(3):
            x = windows_of_special_values((2, 3, 8, 10), (2, 2), torch.float32) if step else torch.randn(2, 3, 8, 10)
            weight = torch.randn(2, 3, 4, 5)
            got = traced(x.clone().requires_grad_(), weight, kernel=2)
            want = pool_and_grad(x.clone().requires_grad_(), weight, kernel=2)
            for a, b in zip(got, want):
                assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), (a, b)
        launchers = [(n, k) for n, k in ts.fused_kernels(traced) if n.name.startswith("row") and hasattr(k, "kernel")]
        ts.triton_launchers(traced)
    assert {"max_pool2d_with_indices", "max_pool2d_with_indices_backward"} <= {
        str(m.target).split(".")[1] for n, _ in launchers for m in n.members}
    problems = ts.compile_all([k.kernel for _, k in launchers])
    assert not problems, "\n\n".join(problems)


def pool_with(**options):
    def pool(x, weight):
        values, indices = F.max_pool2d(F.relu(x), return_indices=True, **options)
        (values * weight).sum().backward()
        return values.detach(), indices, x.grad
    return pool


LAYOUTS = {  # name -> (max_pool2d options, input maker, whether its windows tile the input)
    "channels_last": ({"kernel_size": 2}, lambda g: torch.randn(2, 3, 8, 8, generator=g).contiguous(
        memory_format=torch.channels_last), True),
    "unbatched": ({"kernel_size": 2}, lambda g: torch.randn(3, 8, 8, generator=g), True),
    "transposed": ({"kernel_size": 2}, lambda g: torch.randn(2, 3, 8, 6, generator=g).transpose(2, 3), True),
    "ceil_mode": ({"kernel_size": 2, "ceil_mode": True}, lambda g: torch.randn(2, 3, 7, 7, generator=g), False),
    "padding": ({"kernel_size": 2, "padding": 1}, lambda g: torch.randn(2, 3, 8, 8, generator=g), False),
    "overlapping": ({"kernel_size": 3, "stride": 1}, lambda g: torch.randn(2, 3, 8, 8, generator=g), False),
    "partial": ({"kernel_size": 2}, lambda g: torch.randn(2, 3, 9, 9, generator=g), False),
}


@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_other_layouts_are_exact_and_untiled_windows_stay_aten(layout, without_host):
    """Strided inputs (channels-last, transposed, unbatched) run the row kernels bit for bit, strides
    included; pooling whose windows do not tile the input stays aten's, with eager's numbers."""
    options, make, tiled = LAYOUTS[layout]
    pool = pool_with(**options)
    traced = tracejit.trace(pool, backend="c", without_host=without_host)
    g = torch.Generator().manual_seed(11)
    for _ in range(4):
        x = make(g)
        with torch.no_grad():
            weight = torch.randn(F.max_pool2d(x, **options).shape, generator=g)
        got = traced(x.detach().clone(memory_format=torch.preserve_format).requires_grad_(), weight)
        want = pool(x.detach().clone(memory_format=torch.preserve_format).requires_grad_(), weight)
        for a, b in zip(got, want):
            assert torch.equal(a, b) and a.stride() == b.stride(), (layout, a.stride(), b.stride())
    assert bool(row_members(traced)) == tiled, row_members(traced)
    assert traced.stats.host_free_calls + traced.stats.api_replays >= 2
