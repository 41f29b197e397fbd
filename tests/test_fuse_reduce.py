"""graph_opt_config=GraphOptimizationConfig(jit_fuse_reduce=...): reductions (softmax and log-softmax,
layer norm, cross-entropy, sum/mean/amax) and their backward run as one C row kernel each, with the
elementwise ops around them."""

from __future__ import annotations

import copy

import pytest
import torch
from fused_support import assert_close_to_eager, fused_nodes
from models import batch, make_model, twin

import tracejit

ON = tracejit.GraphOptimizationConfig(jit_fuse_reduce=True)
INF, NAN = float("inf"), float("nan")


def row_nodes(traced) -> list:
    return [n for n in fused_nodes(traced) if n.name.startswith("row")]


def member_ops(node) -> list[str]:
    return [str(m.target).split(".")[1] for m in node.members]


def attention_scores(x, mask):
    return torch.softmax(x / 2.83 + mask, dim=-1) * 3


def log_probs(x):
    return torch.log_softmax(x * 1.5, dim=-1)


def softmax_grad(x):
    x = x.detach().requires_grad_()
    (torch.softmax(x, dim=-1) * torch.arange(x.shape[-1], dtype=x.dtype)).sum().backward()
    return x.grad / 2


def log_softmax_grad(x):
    x = x.detach().requires_grad_()
    (torch.log_softmax(x, dim=-1) * torch.arange(x.shape[-1], dtype=x.dtype)).sum().backward()
    return x.grad * 4


def layer_norm(x, w, b):
    return torch.nn.functional.layer_norm(x * 2, x.shape[-1:], w, b, eps=1e-5) + 1


def layer_norm_grad(x, w, b):
    """mean and rstd are saved for backward: the row kernel stores them too."""
    x = x.detach().requires_grad_()
    y = torch.nn.functional.layer_norm(x * 2, x.shape[-1:], w, b, eps=1e-5)
    (y * torch.arange(x.shape[-1], dtype=x.dtype)).sum().backward()
    return x.grad + y.detach()


def layer_norm_backward(x, w, b):
    """Every gradient of a layer norm: dx a row kernel, dw and db its sums over all rows."""
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    y = torch.nn.functional.layer_norm(x * 2, x.shape[-1:], w, b, eps=1e-5)
    (y * torch.arange(x.shape[-1], dtype=x.dtype)).sum().backward()
    return x.grad, w.grad, b.grad


def cross_entropy(x, t):
    """log_softmax + nll_loss in one kernel, their backward in another; some rows ignored."""
    x = x.detach().requires_grad_()
    loss = torch.nn.functional.cross_entropy(x * 2, t)
    loss.backward()
    return loss.detach(), x.grad


def cross_entropy_sum_and_none(x, t):
    x = x.detach().requires_grad_()
    total = torch.nn.functional.cross_entropy(x, t, reduction="sum")
    each = torch.nn.functional.cross_entropy(x * 3, t, reduction="none")
    (total + (each * torch.arange(len(t), dtype=x.dtype)).sum()).backward()
    return total.detach(), each.detach(), x.grad


def reductions(x):
    return x.sum(-1) * 2, (x.mean(-1, keepdim=True) - x) * 3, (x * 2).amax((-2, -1)) - 1


def batch_norm_pool(x, w, b, running_mean, running_var):
    """BatchNorm (training: running statistics updated in place), ReLU and 2x2 max pooling, and
    their backward: BN + ReLU, the pooling, the pooling's backward + ReLU's, BN's backward."""
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    y = torch.nn.functional.batch_norm(x * 1.5, running_mean, running_var, w, b, training=True, momentum=0.1, eps=1e-5)
    y = torch.nn.functional.max_pool2d(torch.relu(y), 2)
    (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    return y.detach(), x.grad, w.grad, b.grad, running_mean.clone(), running_var.clone()


def max_pool(x):
    values, indices = torch.nn.functional.max_pool2d(x * 2, 2, return_indices=True)
    return values, indices


def _batch_norm_inputs(g, dt):
    return (torch.randn(3, 4, 8, 6, generator=g, dtype=dt) * 2 + 1, torch.randn(4, generator=g, dtype=dt),
            torch.randn(4, generator=g, dtype=dt), torch.randn(4, generator=g, dtype=dt),
            torch.rand(4, generator=g, dtype=dt) + 0.5)


def _targets(g, rows, classes):
    t = torch.randint(0, classes, (rows,), generator=g)
    t[1] = -100  # ignore_index: the row counts for nothing
    return t


def _layer_norm_inputs(g, dt):
    return (torch.randn(4, 6, 33, generator=g, dtype=dt) * 3 + 1, torch.randn(33, generator=g, dtype=dt),
            torch.randn(33, generator=g, dtype=dt))


CASES = {
    "softmax": (attention_scores, lambda g, dt: (torch.randn(4, 3, 5, 7, generator=g, dtype=dt),
                                                 torch.randn(5, 7, generator=g, dtype=dt))),
    "log_softmax": (log_probs, lambda g, dt: (torch.randn(6, 33, generator=g, dtype=dt) * 4,)),
    "softmax_backward": (softmax_grad, lambda g, dt: (torch.randn(3, 40, generator=g, dtype=dt),)),
    "log_softmax_backward": (log_softmax_grad, lambda g, dt: (torch.randn(3, 40, generator=g, dtype=dt),)),
    "layer_norm": (layer_norm, _layer_norm_inputs),
    "layer_norm_grad": (layer_norm_grad, _layer_norm_inputs),
    "layer_norm_backward": (layer_norm_backward, _layer_norm_inputs),
    "cross_entropy": (cross_entropy, lambda g, dt: (torch.randn(9, 13, generator=g, dtype=dt) * 3,
                                                    _targets(g, 9, 13))),
    "cross_entropy_sum_and_none": (cross_entropy_sum_and_none, lambda g, dt: (
        torch.randn(40, 7, generator=g, dtype=dt), _targets(g, 40, 7))),
    "reductions": (reductions, lambda g, dt: (torch.randn(4, 6, 33, generator=g, dtype=dt),)),
    "batch_norm_pool": (batch_norm_pool, _batch_norm_inputs),
    "max_pool": (max_pool, lambda g, dt: (torch.randn(2, 3, 8, 10, generator=g, dtype=dt),)),
}
# per case: the ops some row kernel (with at least one more member) must hold
ROW_OP = {"softmax": ["_softmax"], "log_softmax": ["_log_softmax"], "softmax_backward": ["_softmax_backward_data"],
          "log_softmax_backward": ["_log_softmax_backward_data"], "layer_norm": ["native_layer_norm"],
          "layer_norm_grad": ["native_layer_norm"],
          "layer_norm_backward": ["native_layer_norm", "native_layer_norm_backward"],
          "cross_entropy": ["_log_softmax", "nll_loss_forward", "nll_loss_backward", "_log_softmax_backward_data"],
          "cross_entropy_sum_and_none": ["nll_loss_forward", "nll_loss_backward"],
          "reductions": ["sum", "mean", "amax"],
          "batch_norm_pool": ["native_batch_norm", "native_batch_norm_backward", "max_pool2d_with_indices",
                              "max_pool2d_with_indices_backward"],
          "max_pool": ["max_pool2d_with_indices"]}
EXACT = ("softmax", "log_softmax")  # within a few ulp of each result; the others sum rows differently


def as_tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def assert_rows_close(got, want, case: str) -> None:
    """NaN and infinities where eager has them; the rest within a few ulp of each result (softmax,
    log_softmax), or of the largest result: a sum that cancels (sum(g * y), layer norm's moments,
    a gradient summed over rows) adds left to right where eager adds in vector lanes."""
    for g, w in zip(as_tuple(got), as_tuple(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape)
        if not w.dtype.is_floating_point:  # max pooling's indices
            assert torch.equal(g, w), (g, w)
            continue
        if case in EXACT:
            assert_close_to_eager(g, w, exact=False)
            continue
        assert torch.equal(g.isnan(), w.isnan()), (g, w)
        assert torch.equal(g.isinf(), w.isinf()) and torch.equal(g[g.isinf()], w[w.isinf()]), (g, w)
        finite = w.isfinite()
        if not finite.any():
            continue
        scale = w[finite].abs().max() * torch.finfo(w.dtype).eps * 64
        assert ((g[finite] - w[finite]).abs() <= scale).all(), (g[finite] - w[finite]).abs().max()


@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_row_kernel_matches_eager(case, dtype, without_host):
    function, inputs = CASES[case]
    traced = tracejit.trace(function, backend="c", graph_opt_config=ON, without_host=without_host)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        args = inputs(g, dtype)
        copies = [a.clone() for a in args]  # batch norm updates its running statistics in place
        got, want = traced(*args), function(*copies)
        if case.endswith(("backward", "grad")) or case.startswith("layer_norm"):
            # sum(g * y) cancels, and eager's layer norm takes moments by Welford's method; the kernel
            # sums left to right, eager in vector lanes: the error is a few ulp of the row's
            # magnitude, not of each (possibly tiny) result
            for got_one, want_one in zip(as_tuple(got), as_tuple(want)):
                dims = -1 if got_one.dim() > 1 else None
                scale = want_one.abs().amax(dim=dims, keepdim=True) * torch.finfo(dtype).eps * 32
                assert ((got_one - want_one).abs() <= scale).all(), (got_one - want_one).abs().max()
        else:
            assert_rows_close(got, want, case)
    rows = [n for n in row_nodes(traced) if set(ROW_OP[case]) & set(member_ops(n))]
    for op in ROW_OP[case]:
        assert any(op in member_ops(n) for n in rows), (op, [n.name for n in fused_nodes(traced)])
    assert any(len(row.members) >= 2 for row in rows), "the ops around the row ops were not fused"
    assert all(entry.serving_program.kernels for entry in traced._entries())
    assert not any(type(k).__name__ == "ReferenceKernel" for entry in traced._entries()
                   for k in entry.serving_program.kernels.values()), "a row group did not compile"


@pytest.mark.parametrize("case", ["softmax", "log_softmax", "softmax_backward", "log_softmax_backward"])
def test_special_values_match_eager_exactly(case):
    """Rows of -inf (NaN out, as eager), a NaN in a row, +inf, huge values: NaN in the same places."""
    function, _ = CASES[case]
    specials = torch.tensor([[-INF] * 8, [0.0, NAN, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [INF, 1.0, 2.0, 3.0, 4, 5, 6, 7],
                             [1e30, -1e30, 88.0, -88.0, 0.0, -0.0, 1e-45, 3.0], [-INF, 0.0, -INF, 1.0, -INF, 2, 3, 4]])
    traced = tracejit.trace(function, backend="c", graph_opt_config=ON, without_host=True)
    for scale in (1.0, -1.0, 0.5):
        args = (specials * scale,) if case != "softmax" else ((specials * scale)[None], torch.zeros(5, 8))
        got, want = traced(*args), function(*args)
        assert torch.equal(got.isnan(), want.isnan()), (got, want)
        assert torch.equal(got.isinf(), want.isinf())
        finite = got.isfinite()
        assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-30)
    assert row_nodes(traced)


SPECIAL_ROWS = torch.tensor([[-INF] * 8, [0.0, NAN, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [INF, 1.0, 2.0, 3.0, 4, 5, 6, 7],
                             [1e30, -1e30, 88.0, -88.0, 0.0, -0.0, 1e-45, 3.0], [-INF, 0.0, -INF, 1.0, -INF, 2, 3, 4],
                             [-0.0] * 8, [0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0], [1e-45, -1e-45, 0, 0, 0, 0, 0, 0]])


def special_arguments(case: str, x: torch.Tensor) -> tuple:
    """SPECIAL_ROWS laid out as each case's inputs."""
    dtype = x.dtype
    if case == "layer_norm_backward":
        # the squares of 1e30 overflow float32: eager's Welford moments give NaN or 0 depending
        # on the order of its updates, the kernel's two passes 0 (docs/kernels.md)
        x[3] = x[3].clamp(-1e15, 1e15)
        return x[None], torch.linspace(-1, 1, 8, dtype=dtype), torch.linspace(2, 3, 8, dtype=dtype)
    if case == "reductions":
        return (x[None],)
    if case == "batch_norm_pool":  # channels: one with -inf and NaN, one of zeros and subnormals
        x = x.clone()
        x[3] = x[3].clamp(-1e15, 1e15)  # as above
        return (x.reshape(2, 2, 4, 4).transpose(0, 1).contiguous(), torch.tensor([1.0, -2.0], dtype=dtype),
                torch.tensor([0.5, 0.0], dtype=dtype), torch.zeros(2, dtype=dtype), torch.ones(2, dtype=dtype))
    if case == "max_pool":  # windows of -inf, of NaN, of ties, of signed zeros
        return (x.reshape(1, 1, 8, 8),)
    return x, torch.tensor([0, 1, 2, 3, -100, 5, 6, 7])


NEW_CASES = ["layer_norm_backward", "cross_entropy", "cross_entropy_sum_and_none", "reductions", "batch_norm_pool",
             "max_pool"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", NEW_CASES)
def test_special_values_of_the_new_row_ops(case, dtype):
    """NaN, infinities and signed zeros where eager has them (a row of -inf, a NaN in a row, +inf,
    huge and subnormal values, rows of -0.0), the rest as close as the row ops' sums allow."""
    function, _ = CASES[case]
    traced = tracejit.trace(function, backend="c", graph_opt_config=ON, without_host=True)
    for scale in (1.0, -1.0, 0.5):
        args = special_arguments(case, (SPECIAL_ROWS * scale).to(dtype))
        copies = [a.clone() for a in args]
        got, want = traced(*args), function(*copies)
        assert_rows_close(got, want, case)
        for g, w in zip(as_tuple(got), as_tuple(want)):
            zero = (w == 0) & (g == 0)
            assert torch.equal(g[zero].signbit(), w[zero].signbit()), (g, w)
    assert row_nodes(traced)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_long_rows_reduce_in_vector_lanes_with_eager_special_values(dtype):
    """Rows long enough for the C kernel's vector reductions: a row of -inf (its maximum stays
    -inf: the lanes start at -inf), a NaN among numbers, +inf, rows of signed zeros."""
    def reduce_rows(x):
        return x.amax(-1) * 1, torch.softmax(x * 1, -1), torch.log_softmax(x * 1, -1), x.sum(-1) * 1, x.mean(-1) + 0

    rows = torch.randn(7, 100, generator=torch.Generator().manual_seed(4), dtype=dtype)
    rows[0] = -INF
    rows[1, 57] = NAN
    rows[2, 99] = INF
    rows[3] = -0.0
    rows[4, ::3] = -INF
    rows[5] = 0.0
    rows[5, 70] = -0.0
    rows[6, 10], rows[6, 20] = INF, -INF
    traced = tracejit.trace(reduce_rows, backend="c", graph_opt_config=ON, without_host=True)
    for _ in range(3):
        got, want = traced(rows), reduce_rows(rows)
        assert_rows_close(got, want, "reductions")
        for g, w in zip(got, want):
            zero = (w == 0) & (g == 0)
            assert torch.equal(g[zero].signbit(), w[zero].signbit()), (g, w)
    assert {"amax", "_softmax", "_log_softmax", "sum", "mean"} <= {op for n in row_nodes(traced) for op in member_ops(n)}


def test_a_picked_negative_zero_keeps_eager_sign_in_long_rows():
    """nll_loss picks x[t] with a sum that starts at -0.0, which a vectorized sum (lanes start at
    +0.0) would turn into +0.0: eager's loss of a picked -0.0 is +0.0, never -0.0."""
    def losses(x, t):
        return (torch.nn.functional.nll_loss(x * 1, t, reduction="none"), torch.nn.functional.nll_loss(x * 1, t),
                torch.nn.functional.nll_loss(x * 1, t, reduction="sum"))

    traced = tracejit.trace(losses, backend="c", graph_opt_config=ON, without_host=True)
    for x in (torch.full((4, 64), -0.0), torch.full((4, 64), 0.0)):
        t = torch.tensor([3, 10, 40, 63])
        for _ in range(3):
            got, want = traced(x, t), losses(x, t)
        for g, w in zip(got, want):
            assert torch.equal(g, w) and torch.equal(g.signbit(), w.signbit()), (g, w)


def test_a_target_out_of_range_raises_as_eager():
    """The C kernel checks each target: out of range, aten runs the group and raises eager's error."""
    traced = tracejit.trace(cross_entropy, backend="c", graph_opt_config=ON, without_host=True)
    x, t = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    for _ in range(2):
        assert_rows_close(traced(x, t), cross_entropy(x, t), "cross_entropy")
    for bad in (5, -1, 100):
        with pytest.raises(IndexError, match="out of bounds"):
            cross_entropy(x, torch.tensor([0, bad, 2, 3]))
        with pytest.raises(IndexError, match="out of bounds"):
            traced(x, torch.tensor([0, bad, 2, 3]))
    assert_rows_close(traced(x, t), cross_entropy(x, t), "cross_entropy")
    assert {"nll_loss_forward", "nll_loss_backward"} <= {op for n in row_nodes(traced) for op in member_ops(n)}


def test_option_is_validated_and_defaults_keep_todays_program():
    with pytest.raises(TypeError, match="jit_fuse_reduce must be None, False or True"):
        tracejit.GraphOptimizationConfig(jit_fuse_reduce=1)
    with pytest.raises(TypeError, match="graph_opt_config must be a tracejit.GraphOptimizationConfig"):
        tracejit.trace(log_probs, graph_opt_config={"jit_fuse_reduce": True})
    x = torch.randn(6, 33)
    for options, rows in [({}, 0), ({"graph_opt_config": tracejit.GraphOptimizationConfig()}, 0),
                          ({"opt_level": 3}, 1), ({"opt_level": 3, "graph_opt_config":
                                                   tracejit.GraphOptimizationConfig(jit_fuse_reduce=False)}, 0)]:
        traced = tracejit.trace(log_probs, backend="c", without_host=True, **options)
        for _ in range(3):
            assert_close_to_eager(traced(x), log_probs(x), exact=False)
        assert len(row_nodes(traced)) == rows, options


def test_strided_or_other_dim_reductions_stay_unfused():
    def other_dim(x):
        return torch.softmax(x * 2, dim=0)

    def transposed(x):
        return torch.softmax(x.t() * 2, dim=-1)

    x = torch.randn(9, 5)
    for function in (other_dim, transposed):
        traced = tracejit.trace(function, backend="c", graph_opt_config=ON, without_host=True)
        for _ in range(3):
            assert_close_to_eager(traced(x), function(x), exact=False)
        if function is other_dim:
            assert not row_nodes(traced)


def step_keeping_gradients(x, y, *, model, opt):
    """A training step that zeroes the gradients first, so each step's gradients can be compared."""
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def train_and_compare(kind: str, steps: int, without_host: bool, backend: str = "c", graph_opt_config=ON):
    """Eager and fused training side by side: the loss, every gradient, parameter, buffer and
    momentum buffer after each step within 1e-5 + 1e-4 relative (the row kernels sum rows in
    another order than eager). SGD with momentum: Adam divides tiny noisy gradients by their own
    size (see test_fused_training)."""
    (model_a, opt_a), (model_b, opt_b) = twin(make_model(kind), "sgd_momentum")
    traced = tracejit.trace(step_keeping_gradients, backend=backend, graph_opt_config=graph_opt_config,
                            without_host=without_host)
    for step in range(steps):
        x, y = batch(kind, step)
        torch.manual_seed(100 + step)
        loss_a = step_keeping_gradients(x, y, model=model_a, opt=opt_a)
        torch.manual_seed(100 + step)
        loss_b = traced(x, y, model=model_b, opt=opt_b)
        assert torch.allclose(loss_a, loss_b, rtol=1e-5, atol=0), f"step {step}: {loss_a} vs {loss_b}"
        for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
            assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5), f"step {step} {name}.grad"
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), f"step {step} {name}: {(a - b).abs().max()}"
            momentum_a, momentum_b = opt_a.state[a]["momentum_buffer"], opt_b.state[b]["momentum_buffer"]
            assert torch.allclose(momentum_a, momentum_b, rtol=1e-4, atol=1e-5), f"step {step} {name} momentum"
        for (name, a), b in zip(model_a.named_buffers(), model_b.buffers()):
            assert torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5), f"step {step} {name}"
    return traced


@pytest.mark.parametrize("without_host", [False, True])
def test_cnn_training_step_matches_eager(without_host):
    """BatchNorm + ReLU, max pooling and their backward in row kernels: running statistics too."""
    traced = train_and_compare("cnn", 4, without_host)
    kinds = {op for n in row_nodes(traced) for op in member_ops(n)}
    assert {"native_batch_norm", "native_batch_norm_backward", "max_pool2d_with_indices",
            "max_pool2d_with_indices_backward", "threshold_backward", "relu"} <= kinds, kinds


@pytest.mark.parametrize("without_host", [False, True])
def test_transformer_training_step_matches_eager(without_host):
    traced = train_and_compare("transformer", 5, without_host)
    kinds = {op for n in row_nodes(traced) for op in member_ops(n)}
    assert {"_softmax", "_softmax_backward_data", "native_layer_norm", "native_layer_norm_backward", "_log_softmax",
            "nll_loss_forward", "nll_loss_backward", "_log_softmax_backward_data"} <= kinds, kinds


@pytest.mark.parametrize("without_host", [False, True])
def test_a_prologue_value_read_elsewhere_is_stored_by_the_row_kernel(without_host):
    def residual(x, y):
        s = x + y  # feeds the layer norm and the residual after it
        return torch.nn.functional.layer_norm(s, s.shape[-1:]) * 2 + s, s * 3

    traced = tracejit.trace(residual, backend="c", graph_opt_config=ON, without_host=without_host)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(5, 9, generator=g), torch.randn(9, generator=g)
        for got, want in zip(traced(x, y), residual(x, y)):
            assert ((got - want).abs() <= want.abs().amax() * torch.finfo(want.dtype).eps * 32).all()
    (row,) = row_nodes(traced)
    assert member_ops(row)[:2] == ["add", "native_layer_norm"], member_ops(row)


def test_row_groups_run_by_the_reference_backend_are_bitwise_eager():
    """The grouping alone changes no number: backend="reference" runs each row group op by op."""
    traced = tracejit.trace(attention_scores, backend="reference", graph_opt_config=ON, without_host=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        args = CASES["softmax"][1](g, torch.float32)
        assert torch.equal(traced(*args), attention_scores(*args))
    assert member_ops(row_nodes(traced)[0]) == ["div", "add", "_softmax", "mul"]


def test_a_forward_whose_returned_graph_is_kept_stores_what_backward_saved():
    """A training-mode BatchNorm + ReLU forward traced with its input requiring grad, backward run
    by the caller: the returned graph saved BatchNorm's batch statistics, which the row kernel did
    not store and cannot compute again (it updates the running statistics), so every call after
    the first raised TraceMismatchError ("kept a reference to t8"). Its kernel stores them now."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.ReLU())
    eager = copy.deepcopy(model)
    traced = tracejit.trace(lambda x: model(x), backend="c", graph_opt_config=ON)
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        x = torch.randn(2, 3, 4, 4, generator=g, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        got, want = traced(x), eager(x_eager)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        got.square().sum().backward()
        want.square().sum().backward()
        torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-4, atol=1e-5)
        for a, b in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model[0].running_mean, eager[0].running_mean)
    assert traced.stats.checked_replays == 3
    assert member_ops(row_nodes(traced)[0])[:2] == ["native_batch_norm", "relu"]
