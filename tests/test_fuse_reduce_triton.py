"""Row kernels (jit_fuse_reduce) in the Triton backend, proven without a GPU: the kernels run in
Triton's interpreter on CPU tensors against eager, and build offline for sm_80 and sm_90."""

from __future__ import annotations

import re

import pytest
import torch
import triton_support as ts
from test_fuse_reduce import (
    CASES,
    INF,
    NAN,
    NEW_CASES,
    ON,
    ROW_OP,
    SPECIAL_ROWS,
    as_tuple,
    assert_rows_close,
    member_ops,
    special_arguments,
)

import tracejit


@pytest.fixture(autouse=True)
def _interpret():
    with ts.interpreter():
        yield


def row_launchers(traced) -> list:
    """(node, Triton launcher) of every row node; records the kernels for the offline build."""
    ts.triton_launchers(traced)
    return [(n, k) for n, k in ts.fused_kernels(traced) if n.name.startswith("row") and hasattr(k, "kernel")]


def loads_per_input(source: str) -> dict[str, int]:
    """How many times the kernel source loads each input pointer."""
    counts: dict[str, int] = {}
    for pointer in re.findall(r"tl\.load\((in\d+)\b", source):
        counts[pointer] = counts.get(pointer, 0) + 1
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_kernels_match_eager_in_the_interpreter_and_build_for_cuda(dtype):
    kernels = []
    for case, (function, inputs) in CASES.items():
        traced = tracejit.trace(function, backend="triton", graph_opt_config=ON, without_host=True)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            args = inputs(g, dtype)
            copies = [a.clone() for a in args]  # batch norm updates its running statistics in place
            got, want = traced(*args), function(*copies)
            if case.endswith(("backward", "grad")) or case.startswith("layer_norm"):  # see test_fuse_reduce.py
                for got_one, want_one in zip(as_tuple(got), as_tuple(want)):
                    dims = -1 if got_one.dim() > 1 else None
                    scale = want_one.abs().amax(dim=dims, keepdim=True) * torch.finfo(dtype).eps * 32
                    assert ((got_one - want_one).abs() <= scale).all(), (case, (got_one - want_one).abs().max())
            else:
                assert_rows_close(got, want, case)
        launchers = row_launchers(traced)
        for op in ROW_OP[case]:
            assert any(op in member_ops(n) for n, _ in launchers), (op, [n.name for n, _ in ts.fused_kernels(traced)])
        assert any(len(n.members) >= 2 for n, _ in launchers)
        for node, launcher in launchers:
            # every input is loaded once per row: the whole row is one block
            counts = loads_per_input(launcher.kernel.source)
            assert counts and set(counts.values()) == {1}, (node.name, counts, launcher.kernel.source)
            kernels.append(launcher.kernel)
            if launcher.kernel.combine is not None:
                kernels.append(launcher.kernel.combine)
    if dtype == torch.float32:  # the float64 kernels differ only in their types
        problems = ts.compile_all(list({k.source: k for k in kernels}.values()))
        assert not problems, "\n\n".join(problems)


@pytest.mark.parametrize("case", NEW_CASES)
def test_special_values_of_the_new_row_ops_in_the_interpreter(case):
    function, _ = CASES[case]
    traced = tracejit.trace(function, backend="triton", graph_opt_config=ON, without_host=True)
    for scale in (1.0, -1.0, 0.5):
        args = special_arguments(case, SPECIAL_ROWS * scale)
        copies = [a.clone() for a in args]
        got, want = traced(*args), function(*copies)
        assert_rows_close(got, want, case)
        for g, w in zip(as_tuple(got), as_tuple(want)):
            zero = (w == 0) & (g == 0)
            assert torch.equal(g[zero].signbit(), w[zero].signbit()), (g, w)
    assert row_launchers(traced)


@pytest.mark.parametrize("case", ["softmax", "log_softmax"])
def test_special_values_in_the_interpreter(case):
    function, _ = CASES[case]
    specials = torch.tensor([[-INF] * 5, [0.0, NAN, 1.0, 2.0, 3.0], [INF, 1.0, 2.0, 3.0, 4.0],
                             [1e30, -1e30, 88.0, -88.0, -0.0], [-INF, 0.0, -INF, 1.0, 2.0]])
    traced = tracejit.trace(function, backend="triton", graph_opt_config=ON, without_host=True)
    for scale in (1.0, -1.0, 0.5):
        args = (specials * scale,) if case != "softmax" else ((specials * scale)[None], torch.zeros(5, 5))
        got, want = traced(*args), function(*args)
        assert torch.equal(got.isnan(), want.isnan()), (got, want)
        finite = got.isfinite()
        assert torch.equal(finite, want.isfinite())
        assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-30)
    assert row_launchers(traced)


def long_rows(x, w, b, running_mean, running_var):
    """Rows of 16384 elements (BatchNorm's channels over 4 x 64 x 64) and of 24576 (a softmax):
    longer than one block, each pass walks the row block by block."""
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    y = torch.relu(torch.nn.functional.batch_norm(x * 1.5, running_mean, running_var, w, b, training=True))
    (y * 0.5).sum().backward()
    return (y.detach(), x.grad, w.grad, b.grad, running_mean.clone(), running_var.clone(),
            torch.softmax(x.detach().reshape(2, -1) * 2, -1), x.detach().reshape(2, -1).amax(-1) * 1)


def test_rows_longer_than_a_block_loop_over_it():
    traced = tracejit.trace(long_rows, backend="triton", graph_opt_config=ON, without_host=True)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        args = [torch.randn(4, 3, 64, 64, generator=g), torch.randn(3, generator=g), torch.randn(3, generator=g),
                torch.zeros(3), torch.ones(3)]
        args[0][1, 2, 3, 4] = NAN  # its channel's statistics, and its softmax row, are NaN
        copies = [a.clone() for a in args]
        got, want = traced(*args), long_rows(*copies)
        assert_rows_close(got, want, "batch_norm_pool")
    launchers = row_launchers(traced)
    looped = [k.kernel for _, k in launchers if "for start in range(" in k.kernel.source]
    assert {"native_batch_norm", "native_batch_norm_backward", "_softmax", "amax"} <= {
        op for n, k in launchers if "for start in range(" in k.kernel.source for op in member_ops(n)}
    problems = ts.compile_all(looped)
    assert not problems, "\n\n".join(problems)
