"""graph_opt_config=GraphOptimizationConfig(jit_fuse_dimshuffle=True): views of the buffers a program
keeps are made once (no view op per call), fused kernels write into kept buffers, and a copy of a
transposed tensor (or an op reading a broadcast one) runs as a strided kernel. None of it changes a
number: every test compares with eager bit for bit where the kernels compute exactly."""

from __future__ import annotations

import pytest
import torch
from fused_support import fused_nodes
from test_fuse_reduce import train_and_compare

import tracejit
from tracejit.ir import Op

DIMSHUFFLE = tracejit.GraphOptimizationConfig(jit_fuse_dimshuffle=True)
BOTH = tracejit.GraphOptimizationConfig(jit_fuse_reduce=True, jit_fuse_dimshuffle=True)


def attention(q, k, v, w):
    """Heads split by view + transpose, bmm, merged by transpose + reshape (a copy), a projection."""
    b, t, d = q.shape
    q, k, v = (x.view(b, t, 4, d // 4).transpose(1, 2) for x in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / 4.0
    out = (scores @ v).transpose(1, 2).reshape(b, t, d)
    return (out.reshape(b * t, d) @ w).view(b, t, -1)


def serving_graphs(traced) -> list:
    return [entry.serving_program.graph for entry in traced._entries()]


def attention_inputs(g):
    return [torch.randn(2, 8, 16, generator=g) for _ in range(3)] + [torch.randn(16, 16, generator=g)]


def test_views_of_kept_buffers_are_made_once_and_change_no_number():
    """backend="aten": no kernel at all, so the results are eager's bit for bit; the views of the
    matmuls' arena buffers become static and the program runs fewer ops per call."""
    plain = tracejit.trace(attention, backend="aten", without_host=True)
    shuffled = tracejit.trace(attention, backend="aten", without_host=True, graph_opt_config=DIMSHUFFLE)
    g = torch.Generator().manual_seed(0)
    results = []
    for _ in range(4):
        args = attention_inputs(g)
        want = attention(*args)
        got = shuffled(*args)
        assert torch.equal(got, want)
        assert torch.equal(plain(*args), want)
        results.append((got, want))
    for got, want in results:  # a returned tensor is the caller's: later calls never overwrite it
        assert torch.equal(got, want)
    (graph,) = serving_graphs(shuffled)
    static = [n for n in graph.nodes if n.static_view]
    assert len(static) >= 2, graph
    running = [n for n in graph.nodes if n.op in (Op.CALL, Op.FUSED) and not n.static_view and not n.hoisted]
    (plain_graph,) = serving_graphs(plain)
    plain_running = [n for n in plain_graph.nodes if n.op in (Op.CALL, Op.FUSED) and not n.hoisted]
    assert len(running) + len(static) == len(plain_running)


@pytest.mark.parametrize("backend", ["c", "aten"])
def test_static_views_follow_new_values_every_call(backend):
    """A static view reads its buffer's contents on each call: values that change every call."""
    def chain(x, w):
        y = (x @ w).view(4, 2, 8).transpose(0, 1)  # views of a kept buffer
        return (y * 2).sum(0) + y.amax(-1, keepdim=True)

    traced = tracejit.trace(chain, backend=backend, without_host=True, graph_opt_config=BOTH)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, w = torch.randn(8, 5, generator=g), torch.randn(5, 8, generator=g)
        assert torch.allclose(traced(x, w), chain(x, w), rtol=1e-6, atol=1e-6)
    assert any(n.static_view for graph in serving_graphs(traced) for n in graph.nodes)


def test_a_copy_of_a_transposed_tensor_and_a_lone_foreach_op_are_kernels():
    def copies(x, y, *, steps):
        torch._foreach_add_(steps, 1)  # an optimizer's step count: one kernel for the whole list
        return x.transpose(1, 2).contiguous(), y.unsqueeze(1).expand(4, 3, 5) / 3

    traced = tracejit.trace(copies, backend="c", without_host=True, graph_opt_config=DIMSHUFFLE)
    steps_traced, steps_eager = [torch.zeros(()) for _ in range(3)], [torch.zeros(()) for _ in range(3)]
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(4, 5, 6, generator=g), torch.randn(4, 5, generator=g)
        got, want = traced(x, y, steps=steps_traced), copies(x, y, steps=steps_eager)
        for a, b in zip(got, want):
            assert torch.equal(a, b) and a.stride() == b.stride()
    assert all(torch.equal(a, b) for a, b in zip(steps_traced, steps_eager))
    ops = {str(m.target).split(".")[1] for n in fused_nodes(traced) for m in n.members}
    assert {"clone", "div", "_foreach_add_"} <= ops, ops
    # the default opt_level has them too (they change no number); turned off, an op alone stays aten's
    default = tracejit.trace(copies, backend="c", without_host=True)
    plain = tracejit.trace(copies, backend="c", without_host=True,
                           graph_opt_config=tracejit.GraphOptimizationConfig(jit_fuse_dimshuffle=False))
    for _ in range(3):
        x, y = torch.randn(4, 5, 6), torch.randn(4, 5)
        default(x, y, steps=steps_traced)
        plain(x, y, steps=steps_eager)
    assert {"clone", "div", "_foreach_add_"} <= {str(m.target).split(".")[1] for n in fused_nodes(default) for m in n.members}
    assert not fused_nodes(plain)


def test_fused_kernels_write_into_kept_buffers():
    """A kernel's result the call does not return goes to the arena; a returned one does not."""
    def block(x, w):
        h = torch.relu(x @ w) * 2 + 1  # a fused kernel; its result only feeds the next matmul
        return torch.softmax((h @ w.t()) / 3, dim=-1)

    traced = tracejit.trace(block, backend="c", without_host=True, graph_opt_config=BOTH)
    g = torch.Generator().manual_seed(3)
    kept = []
    for _ in range(4):
        x, w = torch.randn(6, 8, generator=g), torch.randn(8, 8, generator=g)
        got = traced(x, w)
        kept.append((got, block(x, w)))
    for got, want in kept:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    planned = [n for graph in serving_graphs(traced) for n in graph.nodes if n.op is Op.FUSED and any(n.buffers)]
    assert planned, serving_graphs(traced)


def test_option_resolution():
    assert tracejit.GraphOptimizationConfig(jit_fuse_dimshuffle=True).fuse_dimshuffle(1)
    assert not tracejit.GraphOptimizationConfig().fuse_dimshuffle(1)
    assert tracejit.GraphOptimizationConfig().fuse_dimshuffle(2)  # it changes no number: on by default
    assert tracejit.GraphOptimizationConfig().fuse_dimshuffle(3)
    # of jit_fuse_reduce, the default level has only the row kernels that sum nothing
    assert not tracejit.GraphOptimizationConfig().fuse_reduce(2) and tracejit.GraphOptimizationConfig().fuse_reduce(3)
    assert tracejit.GraphOptimizationConfig().fuse_exact_rows(2) and not tracejit.GraphOptimizationConfig().fuse_exact_rows(1)
    assert not tracejit.GraphOptimizationConfig(jit_fuse_reduce=False).fuse_exact_rows(3)
    assert not tracejit.GraphOptimizationConfig(jit_fuse_dimshuffle=False).fuse_dimshuffle(3)
    with pytest.raises(TypeError, match="jit_fuse_dimshuffle must be None, False or True"):
        tracejit.GraphOptimizationConfig(jit_fuse_dimshuffle="yes")


@pytest.mark.parametrize("kind", ["transformer", "cnn"])
@pytest.mark.parametrize("without_host", [False, True])
def test_training_with_every_graph_optimization_matches_eager(kind, without_host):
    train_and_compare(kind, 4, without_host, graph_opt_config=BOTH)
