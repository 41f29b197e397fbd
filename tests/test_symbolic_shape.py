"""symbolic_shape: one trace of symbolic sizes serves many input shapes (issue 13.1).

Every test compares with eager call by call (outputs and all state, bitwise: the suite runs
backend="aten") and proves from `traced.stats` how many traces were recorded and that the other
calls replayed.
"""

import copy
import functools
import itertools
import re

import pytest
import torch
import torch.nn.functional as F
from models import MLP
from side_by_side import assert_replayed, same_tree, side_by_side, state_of

import tracejit
from benchmarks import models as bench_models
from benchmarks.workloads import train_step
from tracejit import SymbolicTraceError, TraceCacheFullError, TraceMismatchError
from tracejit.record.symbolic_shapes import readable

_DEEP: dict = {"a": {"b": {"c": {"d": {"e": []}}}}}  # deeper than a dropped attempt's snapshot reaches
LENGTHS = (5, 7, 9, 12, 16, 17, 20, 23, 24, 29, 31, 32, 40, 47, 48, 64)  # 16 sequence lengths
BATCHES = (2, 3, 8, 13)  # 4 batch sizes


def mlp_step(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _mlp_objects():
    torch.manual_seed(0)
    model = MLP((32, 64, 10))
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)}


def _batch(n, width=32, classes=10, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=generator), torch.randint(0, classes, (n,), generator=generator)


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_mlp_many_batch_sizes_one_trace(without_host):
    sizes = [4, 4, 9, 9, 33, 33, 17, 17, 9, 4, 2, 2]
    traced = tracejit.trace(mlp_step, symbolic_shape=True, without_host=without_host)
    side_by_side(traced, mlp_step, _mlp_objects(), lambda i: _batch(sizes[i], seed=i), len(sizes))
    assert traced.stats.records == 1 and len(traced._shape_traces) == 1
    assert traced.stats.shape_specializations == len(set(sizes)) - 1  # the recorded size is the first
    if without_host:
        assert traced.stats.host_free_calls >= 4


@pytest.mark.parametrize("mode", [None, True], ids=["automatic", "symbolic"])
@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_dropout_and_sgd_momentum_over_batch_sizes(mode, without_host):
    """Random ops draw what eager draws from the same seed, at every size (the program draws in
    recorded order); SGD's momentum buffers are lazy state (the symbolic trace is recorded again)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(32, 4))
    objects = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}
    sizes = [5, 5, 7, 9, 7, 12, 5, 7]
    traced = tracejit.trace(mlp_step, symbolic_shape=mode, without_host=without_host)
    side_by_side(traced, mlp_step, objects, lambda i: _batch(sizes[i], width=16, classes=4, seed=i), len(sizes),
                 records=1 if mode else 2)


def test_returns_inputs_and_views_of_them():
    def views(x):
        return x, x[1:], x.t()

    traced = tracejit.trace(views, symbolic_shape=True)
    for n in (3, 4, 4, 5):
        x = torch.randn(n, 2)
        assert same_tree(traced(x), views(x))
    assert traced.stats.records == 1 and traced.stats.shape_specializations == 2


def test_mlp_inference_returns_real_tensors_of_each_size():
    model = MLP((32, 64, 10)).eval()

    def infer(x, *, model):
        with torch.no_grad():
            return model(x)

    traced = tracejit.trace(infer, symbolic_shape=True, without_host=True)
    for i, n in enumerate([3, 5, 5, 8, 8, 8, 3]):
        x = torch.randn(n, 32)
        got = traced(x, model=model)
        assert type(got) is torch.Tensor and got.shape == (n, 10)
        assert torch.equal(got, infer(x, model=model))
    assert traced.stats.records == 1 and traced.stats.host_free_calls >= 3


def _transformer_objects():
    torch.manual_seed(0)
    model = bench_models.TransformerBlock()
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)}


def _transformer_inputs(shapes):
    def inputs(i):
        batch, tokens = shapes[i]
        generator = torch.Generator().manual_seed(i)
        return torch.randn(batch, tokens, 64, generator=generator), torch.randint(0, 10, (batch,), generator=generator)
    return inputs


def test_transformer_train_16_lengths_4_batches_checked():
    """The issue's criterion: 64 shapes, at most 2 traces, every call bitwise eager (loss,
    parameters, gradients, Adam's state). Automatic mode: the first call is recorded static, the
    second (a new length) symbolic, and that trace serves every later batch size and length."""
    shapes = list(itertools.product(BATCHES, LENGTHS))
    traced = tracejit.trace(train_step)
    side_by_side(traced, train_step, _transformer_objects(), _transformer_inputs(shapes), len(shapes), records=2)
    assert traced.stats.shape_specializations == len(shapes) - 2 and len(traced._shape_traces) == 1


def test_transformer_train_16_lengths_4_batches_without_host():
    """symbolic_shape=True: one trace from the first call; each size's first call is checked (it
    binds the host-free program), later calls at a size run without the host."""
    shapes = list(itertools.product(BATCHES, LENGTHS))
    shapes += shapes[-8:]  # sizes seen lately (32 are kept), now host-free
    traced = tracejit.trace(train_step, symbolic_shape=True, without_host=True)
    side_by_side(traced, train_step, _transformer_objects(), _transformer_inputs(shapes), len(shapes), records=1)
    assert traced.stats.host_free_calls == 8 and traced.stats.shape_specializations == 62  # 2 sizes recorded


def _sum_or_add(x, y):
    if x.shape[0] == y.shape[0]:  # a Python branch on sizes: the trace guards the equality
        return x * 2 + y
    return x.sum() + y.sum()


def test_guard_of_equal_sizes_broken_records_a_new_trace():
    traced = tracejit.trace(_sum_or_add, symbolic_shape=True)
    calls = [(5, 5), (7, 7), (9, 9), (7, 4), (3, 8), (6, 6), (4, 7)]
    for n, m in calls:
        x, y = torch.randn(n), torch.randn(m)
        assert torch.equal(traced(x, y), _sum_or_add(x, y))
    assert traced.stats.records == 2  # equal sizes, then unequal ones
    assert_replayed(traced, len(calls), records=2)


def _scale_rows(x, w):
    return (x * w).sum(1)  # w broadcasts against x's rows, or is one per row


def test_size_becoming_one_breaks_the_zero_one_guard():
    traced = tracejit.trace(_scale_rows, symbolic_shape=True)
    calls = [(4, 6, 6), (5, 3, 3), (5, 3, 1), (2, 7, 1), (3, 4, 4)]  # rows, columns, len(w)
    for rows, columns, width in calls:
        x, w = torch.randn(rows, columns), torch.randn(width)
        assert torch.equal(traced(x, w), _scale_rows(x, w))
    assert traced.stats.records == 2  # w of one element broadcasts: another trace
    texts = [readable(text) for text in traced._shape_traces[0].guards.texts]
    assert "w.size()[0] == x.size()[1]" in texts and "2 <= x.size()[1]" in texts


def test_cache_full_names_the_sizes_and_the_guards_they_break():
    traced = tracejit.trace(_scale_rows, symbolic_shape=True, max_traces=1)
    traced(torch.randn(4, 6), torch.randn(6))
    traced(torch.randn(3, 5), torch.randn(5))
    with pytest.raises(TraceCacheFullError) as error:
        traced(torch.randn(3, 5), torch.randn(1))
    message = str(error.value)
    assert "symbolic sizes (x: [" in message
    assert "its sizes break w.size()[0] == x.size()[1] (with x [3, 5], w [1])" in message
    assert "max_traces=1" in message


def test_symbolic_shape_false_keeps_one_trace_per_shape():
    traced = tracejit.trace(mlp_step, symbolic_shape=False)
    sizes = [4, 9, 4, 9, 17]
    side_by_side(traced, mlp_step, _mlp_objects(), lambda i: _batch(sizes[i], seed=i), len(sizes), records=3)
    assert traced._shape_traces == [] and traced.stats.shape_specializations == 0


def test_automatic_records_the_first_call_static_then_symbolic():
    traced = tracejit.trace(mlp_step)  # symbolic_shape=None
    sizes = [4, 4, 9, 17, 33, 4, 9]
    side_by_side(traced, mlp_step, _mlp_objects(), lambda i: _batch(sizes[i], seed=i), len(sizes), records=2)
    static = [e for e in traced._entries() if e.shape_trace is None]
    assert [e.key[0][0][0] for e in static] == [torch.Size([4, 32])]
    assert len(traced._shape_traces) == 1 and traced.stats.shape_specializations == 2


def test_symbolic_shape_true_is_symbolic_from_the_first_call():
    traced = tracejit.trace(mlp_step, symbolic_shape=True)
    traced(*_batch(4), **_mlp_objects())
    assert traced.stats.records == 1 and len(traced._shape_traces) == 1
    assert not [e for e in traced._entries() if e.shape_trace is None]


def test_automatic_stays_static_where_symbolic_recording_cannot_go():
    """A step that reads a value on the host (foreach Adam reads step.item()) cannot be recorded on
    stand-ins without values: the automatic mode keeps one trace per shape, exactly as before."""
    torch.manual_seed(0)
    model = MLP((32, 64, 10))
    objects = {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)}
    traced = tracejit.trace(mlp_step)
    sizes = [4, 9, 4, 9]
    side_by_side(traced, mlp_step, objects, lambda i: _batch(sizes[i], seed=i), len(sizes), records=2)
    assert traced._shape_traces == []


def _head(x, *, n):
    return x[:n] * 2  # `n` comes from the caller, not from x's sizes: the record holds the number


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_a_size_that_is_not_the_expression_is_a_mismatch(without_host):
    traced = tracejit.trace(_head, symbolic_shape=True, without_host=without_host)
    for n, size in ((5, 10), (5, 10), (5, 12), (5, 12)):
        x = torch.randn(size)
        assert torch.equal(traced(x, n=n), _head(x, n=n))
    with pytest.raises(TraceMismatchError, match="different non-tensor arguments"):
        traced(torch.randn(12), n=6)  # the trace sliced 5, as recorded: 6 is not its value


def _view_from_shape(x):
    return x.view(2, x.shape[0] // 2).sum(0)


def test_sizes_computed_in_python_are_expressions():
    traced = tracejit.trace(_view_from_shape, symbolic_shape=True, without_host=True)
    for n in (10, 12, 12, 12, 30, 30, 10):
        x = torch.randn(n)
        assert torch.equal(traced(x), _view_from_shape(x))
    assert traced.stats.records == 1 and traced.stats.host_free_calls >= 2
    view = next(op for op in traced._shape_traces[0].record.ops if op.op is torch.ops.aten.view.default)
    assert any(isinstance(s, torch.SymInt) for s in view.statics[1])
    assert "x.size()[0] == (2*(x.size()[0] // 2))" in map(readable, traced._shape_traces[0].guards.texts)


def test_an_odd_size_breaks_the_divisibility_guard():
    def rows_of_two(x):
        return x.view(-1, 2).sum(1)

    traced = tracejit.trace(rows_of_two, symbolic_shape=True)
    for n in (8, 10, 12):
        x = torch.randn(n)
        assert torch.equal(traced(x), rows_of_two(x))
    assert traced.stats.records == 1
    with pytest.raises(RuntimeError, match="invalid for input of size 7|shape"):
        traced(torch.randn(7))  # eager raises the same error: a new recording reaches it


@pytest.mark.parametrize("case", ["data_dependent", "host_read", "excluded"])
def test_refusals(case):
    def data_dependent(x):
        return x[x > 0].sum()

    def host_read(x):
        return x * float(x.sum())

    def excluded(x):
        with tracejit.exclude_from_trace():
            pass
        return x * 2

    function = {"data_dependent": data_dependent, "host_read": host_read, "excluded": excluded}[case]
    traced = tracejit.trace(function, symbolic_shape=True)
    with pytest.raises(SymbolicTraceError, match="symbolic"):
        traced(torch.randn(6))


@pytest.mark.parametrize("case", ["repeated", "shared", "requires_grad", "negative_view"])
def test_inputs_that_cannot_have_stand_ins(case):
    """True refuses; the automatic mode keeps one trace per shape, exact as before. A negative view
    (`z.conj().imag`) would have had a stand-in without its bit: the recording saw no negation."""
    def inputs(n):
        x = torch.randn(n, 4)
        if case == "repeated":
            return x, x
        if case == "shared":
            return x[:, :2], x[:, 2:]
        if case == "negative_view":
            return torch.complex(torch.randn(n, 4), x).conj().imag, torch.randn(n, 4)
        return x.requires_grad_(), torch.randn(n, 4)

    def function(a, b):
        return (a * b).sum(1)

    with pytest.raises(SymbolicTraceError, match="stand-ins"):
        tracejit.trace(function, symbolic_shape=True)(*inputs(3))
    traced = tracejit.trace(function)
    for n in (3, 5, 7, 5):
        args = inputs(n)
        assert torch.equal(traced(*args), function(*args))
    assert traced.stats.records == 3 and traced._shape_traces == []


def test_refuses_a_tensor_of_symbolic_size_that_needs_its_graph():
    model = MLP((32, 64, 10))
    traced = tracejit.trace(lambda x, *, model: model(x), symbolic_shape=True)
    with pytest.raises(SymbolicTraceError, match="requires grad"):
        traced(torch.randn(5, 32), model=model)


def test_refuses_a_tensor_of_symbolic_size_kept_beyond_the_call():
    kept = []

    def keep(x):
        y = x * 2
        kept.append(y)
        return y.sum()

    traced = tracejit.trace(keep, symbolic_shape=True)
    with pytest.raises(SymbolicTraceError, match="beyond the call"):
        traced(torch.randn(6))


def test_option_values():
    with pytest.raises(TypeError, match="symbolic_shape"):
        tracejit.trace(mlp_step, symbolic_shape="yes")
    with pytest.raises(ValueError, match="record_only"):
        tracejit.trace(mlp_step, symbolic_shape=True, record_only=True)


def test_specializations_are_bounded(monkeypatch):
    from tracejit.runtime import shape_traces

    monkeypatch.setattr(shape_traces, "MAX_SPECIALIZATIONS", 3)
    traced = tracejit.trace(_view_from_shape, symbolic_shape=True, without_host=True)
    for n in (4, 6, 8, 10, 12, 4, 4):
        x = torch.randn(n)
        assert torch.equal(traced(x), _view_from_shape(x))
    assert len(traced._entries()) == 3 and traced.stats.records == 1


def test_the_least_recently_used_specialization_is_evicted(monkeypatch):
    # a size used on every other call stays compiled while new sizes come and go (the oldest
    # specialization was evicted before, the hot size with it)
    import warnings

    from tracejit.runtime import shape_traces

    monkeypatch.setattr(shape_traces, "MAX_SPECIALIZATIONS", 3)
    traced = tracejit.trace(_view_from_shape, symbolic_shape=True, without_host=True)
    sizes = (4, 6, 8, 4, 10, 4, 12, 4, 14, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in sizes:
            x = torch.randn(n)
            assert torch.equal(traced(x), _view_from_shape(x))
    assert traced.stats.shape_specializations == len(set(sizes)) - 1  # the recorded size is not specialized
    assert not [w for w in caught if issubclass(w.category, tracejit.SpecializationWarning)]
    x = torch.randn(6)
    with pytest.warns(tracejit.SpecializationWarning, match="input sizes"):  # 6 was let go of: it comes back
        got = traced(x)
    assert torch.equal(got, _view_from_shape(x))


def test_state_after_many_shapes_matches_eager_bitwise():
    objects = _transformer_objects()
    twins = copy.deepcopy(objects)
    traced = tracejit.trace(train_step, symbolic_shape=True, without_host=True)
    for i, (batch, tokens) in enumerate([(3, 5), (8, 31), (3, 5), (8, 31), (2, 64), (2, 64)]):
        x, y = torch.randn(batch, tokens, 64), torch.randint(0, 10, (batch,))
        assert same_tree(traced(x, y, **twins), train_step(x, y, **objects))
        assert same_tree(state_of(twins["opt"]), state_of(objects["opt"]))
        assert same_tree(state_of(twins["model"]), state_of(objects["model"]))


def _slice_columns(x):
    return x[:, :2] * 2


def _diag(m):
    return torch.diag(m) + 1


def _upsample_to(x, skip):
    return F.interpolate(x, size=skip.shape[-2:], mode="nearest") + skip


def _upsample_twice(x):
    return F.interpolate(x, scale_factor=2.0, mode="nearest") * 2


def _views_of_an_intermediate(x):
    y = x * 2
    return y.T, (x + 1).view(-1), (x - 1).split(1)[0]


AUTOMATIC_CASES = {
    # a full slice on a symbolic dim, which concrete sizes elide (found by an adversarial review:
    # TraceMismatchError); now elided while recording too
    "slice": (_slice_columns, lambda n: (torch.randn(n, 3),)),
    # torch needs a concrete number on stand-ins: the automatic mode keeps a trace per shape
    "diag": (_diag, lambda n: (torch.randn(n, n),)),
    "interpolate_to": (_upsample_to, lambda n: (torch.randn(1, 2, n, n), torch.randn(1, 2, 2 * n, 2 * n))),
    "interpolate_scale": (_upsample_twice, lambda n: (torch.randn(1, 2, n, n + 1),)),
    "views_of_an_intermediate": (_views_of_an_intermediate, lambda n: (torch.randn(n, 3),)),
}


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
@pytest.mark.parametrize("case", sorted(AUTOMATIC_CASES))
def test_the_automatic_mode_serves_what_symbols_cannot_record(case, without_host):
    function, inputs = AUTOMATIC_CASES[case]
    traced = tracejit.trace(function, without_host=without_host)  # symbolic_shape=None
    torch.manual_seed(0)
    for n in (4, 5, 7, 7, 9, 5, 9, 4):
        args = inputs(n)
        assert same_tree(traced(*args), function(*args)), (case, n)
    stats = traced.stats
    assert stats.checked_replays + stats.host_free_calls >= 2, stats  # later calls of a size replay


def test_a_mixed_precision_step_the_meta_kernels_mispredict_stays_static_in_the_automatic_mode():
    """LayerNorm under bf16 autocast: torch's meta kernel predicts bf16 statistics where the CPU
    kernel makes float32; the symbolic record is not kept, and the step trains as eager does."""
    def step(x, *, model, opt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    reference = copy.deepcopy(model)
    opt, reference_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    traced = tracejit.trace(step)
    for n in (8, 5, 3, 5, 8, 3):
        x = torch.randn(n, 8)
        assert torch.equal(traced(x, model=model, opt=opt), step(x, model=reference, opt=reference_opt)), n
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters())), n
    assert traced._shape_traces == [] and traced.stats.checked_replays >= 3


def test_the_automatic_mode_puts_back_a_stand_in_kept_in_a_closure_list():
    kept = []

    def keep(x):
        y = x * 2
        kept.append(y)
        return y.sum()

    traced = tracejit.trace(keep)
    traced(torch.randn(4))
    x = torch.randn(6)
    traced(x)  # the attempt's stand-in in the closure's list is put back, and the size records static
    assert len(kept) == 2 and type(kept[-1]) is torch.Tensor and torch.equal(kept[-1], x * 2)
    assert traced.stats.records == 2 and traced._shape_traces == []


def _summed_forward(x, *, model):
    return model(x).sum(0)  # of fixed size, requires grad: its autograd graph saved stand-ins


def test_the_automatic_mode_serves_a_forward_whose_returned_graph_saved_stand_ins():
    # the graph of the returned tensor kept the stand-in of a ReLU's output: the automatic mode
    # raised SymbolicTraceError at every new size, advising the symbolic_shape=None it ran in
    model = MLP((4, 8, 2))
    twin = copy.deepcopy(model)
    traced = tracejit.trace(_summed_forward, backend="aten")
    for n in (3, 5, 7, 5, 3):
        x = torch.randn(n, 4)
        got, want = traced(x, model=model), _summed_forward(x, model=twin)
        assert torch.equal(got, want) and got.requires_grad, n
        got.sum().backward()  # the graph it returned reaches the parameters, as eager's does
        want.sum().backward()
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters())), n
    assert traced.stats.records == 3 and traced.stats.checked_replays == 2 and traced._shape_traces == []


def test_symbolic_shape_true_refuses_a_returned_graph_that_saved_stand_ins():
    traced = tracejit.trace(_summed_forward, symbolic_shape=True, backend="aten")
    with pytest.raises(SymbolicTraceError, match=r"beyond the call.*saved by the autograd graph") as raised:
        traced(torch.randn(3, 4), model=MLP((4, 8, 2)))
    assert "symbolic_shape=False" in str(raised.value) and "symbolic_shape=True" not in str(raised.value)


def test_a_bf16_model_with_layer_norm_still_shares_one_symbolic_trace():
    """Only the mixed case (bf16 input, float32 weights, as under autocast) is mispredicted; a model
    in bf16 throughout keeps one trace of symbolic sizes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16)).to(torch.bfloat16).eval()

    def infer(x, *, model):
        with torch.no_grad():
            return model(x)

    traced = tracejit.trace(infer)
    for n in (4, 5, 7, 5, 4, 9):
        x = torch.randn(n, 8, dtype=torch.bfloat16)
        assert torch.equal(traced(x, model=model), infer(x, model=model)), n
    assert len(traced._shape_traces) == 1 and traced.stats.shape_specializations >= 2


@pytest.mark.parametrize("symbolic_shape", [True, None], ids=["symbolic", "automatic"])
def test_a_backward_op_that_leaves_out_the_input_gradient(symbolic_shape):
    # BatchNorm1d over an input that needs no gradient: native_batch_norm_backward's output_mask
    # leaves out the input's gradient, which its meta kernel makes anyway. The symbolic record kept
    # that value, and realizing it raised "tracejit internal error: ... unmaterialized"
    def step(x, *, bn, opt):
        h = bn(x.transpose(1, 2).contiguous()).transpose(1, 2)
        loss = h.reshape(h.shape[0], -1).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(16)
    twin = copy.deepcopy(bn)
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (bn, twin))
    traced = tracejit.trace(step, backend="aten", symbolic_shape=symbolic_shape)
    for batch in (4, 4, 5, 6, 5, 4):
        x = torch.randn(batch, 8, 16)
        assert torch.equal(traced(x, bn=bn, opt=opt), step(x, bn=twin, opt=twin_opt)), batch
        for a, b in zip(bn.state_dict().values(), twin.state_dict().values()):
            assert torch.equal(a, b), batch
    assert traced.stats.checked_replays + traced.stats.api_replays >= 3, traced.stats


def _empty_batch_step(x, y, *, model, opt):
    loss = F.mse_loss(model(x), y)  # mean over an empty batch: eager gives nan
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _padded(x):
    return F.pad(x, (0, 0, 0, x.shape[1] % 4)) * 2  # a pad computed from a size


@pytest.mark.parametrize("case", ["empty_batch", "computed_pad"])
def test_what_torch_cannot_derive_from_symbols_is_a_symbolic_trace_error_and_a_computed_pad_is_derived(case):
    # raised ZeroDivisionError from torch's mse_loss_backward decomposition, and a RuntimeError
    # "SymIntArrayRef expected to contain only concrete integers" from constant_pad_nd
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if case == "empty_batch":
        strict = tracejit.trace(_empty_batch_step, symbolic_shape=True, backend="aten")
        strict(torch.randn(4, 6), torch.randn(4, 3), model=model, opt=opt)
        weight = model.weight.clone()
        with pytest.raises(SymbolicTraceError, match=r"mse_loss_backward.*ZeroDivisionError.*symbolic_shape=None"):
            strict(torch.randn(0, 6), torch.randn(0, 3), model=model, opt=opt)
        assert torch.equal(model.weight, weight)
        automatic = tracejit.trace(_empty_batch_step, backend="aten")
        twin = copy.deepcopy(model)
        twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
        for batch in (4, 0, 5, 0, 4):
            x, y = torch.randn(batch, 6), torch.randn(batch, 3)
            got, want = automatic(x, y, model=model, opt=opt), _empty_batch_step(x, y, model=twin, opt=twin_opt)
            assert torch.equal(got, want) or (got.isnan() and want.isnan()), batch
            assert torch.equal(model.weight, twin.weight), batch
    else:
        # torch's decomposition of constant_pad_nd derives it from symbols now: one trace for all
        strict = tracejit.trace(_padded, symbolic_shape=True, backend="aten")
        for length in (6, 8, 6, 7, 9, 5):
            x = torch.randn(3, length, 5)
            assert torch.equal(strict(x), _padded(x)), length
        assert strict.stats.records == 1 and strict.stats.checked_replays == 5, strict.stats
        automatic = tracejit.trace(_padded, backend="aten")
        for length in (8, 6, 7, 6):
            x = torch.randn(3, length, 5)
            assert torch.equal(automatic(x), _padded(x)), length


def test_an_error_eager_raises_too_names_the_calls_sizes_not_symbols():
    # Found by a review: "The size of tensor a (s77) must match the size of tensor b (s17)" where eager
    # says (4) and (5)
    strict = tracejit.trace(lambda x, y: x + y, symbolic_shape=True, backend="aten")
    strict(torch.randn(3), torch.randn(3))
    with pytest.raises(RuntimeError) as eager:
        torch.randn(4) + torch.randn(5)
    with pytest.raises(RuntimeError) as traced:
        strict(torch.randn(4), torch.randn(5))
    assert str(eager.value) == "The size of tensor a (4) must match the size of tensor b (5) at non-singleton dimension 0"
    assert str(traced.value).startswith(str(eager.value))
    assert [re.sub(r":\d+ ", ":N ", note) for note in traced.value.__notes__] == [
        "tracejit: raised by aten.add.Tensor at test_symbolic_shape.py:N in <lambda> while symbolic_shape=True derived "
        "its outputs without data"]


def test_a_failed_catch_up_does_not_hide_the_recordings_error():
    # abandon() runs what was recorded before the error; when that fails too, the recording's own
    # error (a SymbolicTraceError naming the cause) is raised, with a note, not the catch-up's
    from tracejit.trace import _abandon

    class FailingRecorder:
        def abandon(self):
            raise RuntimeError("view size is not compatible with input tensor's size and stride")

    error = SymbolicTraceError("tracejit: f() keeps t3 ...")
    _abandon(FailingRecorder(), error)
    assert any("running the ops recorded before this error failed too (RuntimeError: view size" in note
               for note in error.__notes__)


def test_keeping_the_base_of_a_returned_view_says_so():
    def f(x):
        out = (x * 2).sum(1)
        return out.detach().view(-1)  # the detached tensor lives on as the view's base

    strict = tracejit.trace(f, symbolic_shape=True, backend="aten")
    with pytest.raises(SymbolicTraceError, match=r"as the base of a view the call returns"):
        strict(torch.randn(4, 3))
    automatic = tracejit.trace(f, backend="aten")
    for batch in (4, 5, 6, 5):
        x = torch.randn(batch, 3)
        assert torch.equal(automatic(x), f(x))


@pytest.mark.parametrize("symbolic_shape", [True, None], ids=["symbolic", "automatic"])
def test_a_new_optimizer_on_a_size_specialization_records_its_state_again(symbolic_shape):
    # entries made from a symbolic trace did not know which optimizers held state after its
    # recorded call: a new optimizer raised TraceMismatchError instead of recording its lazy state
    def step(x, y, *, model, opt):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    make = functools.partial(torch.optim.Adam, lr=0.01, fused=True)
    opt, twin_opt = make(model.parameters()), make(twin.parameters())
    traced = tracejit.trace(step, backend="aten", symbolic_shape=symbolic_shape)
    for i, batch in enumerate((8, 8, 8, 6, 6, 6, 5, 5, 5, 5, 5, 6)):
        if i == 9:  # a new optimizer, without state
            opt, twin_opt = make(model.parameters()), make(twin.parameters())
        x, y = torch.randn(batch, 4), torch.randn(batch, 2)
        assert torch.equal(traced(x, y, model=model, opt=opt), step(x, y, model=twin, opt=twin_opt)), i
        for a, b in zip(model.parameters(), twin.parameters()):
            assert torch.equal(a, b), i


@pytest.fixture
def unwritten_memory_is_nan():
    """torch fills new tensors with NaN in deterministic mode: a placeholder the program never
    wrote (an uncomputed tensor left in Python state) then shows as NaN, on every run."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _sgd_objects():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}


def _same_state(a, b, where):
    assert same_tree(state_of(a["model"]), state_of(b["model"])), where
    assert same_tree(state_of(a["opt"]), state_of(b["opt"])), where
    assert same_tree(getattr(a["model"], "last", None), getattr(b["model"], "last", None)), where


def _interpolate_after_backward(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()  # sets every .grad (placeholders, while recording symbolically)
    w = F.interpolate(torch.ones(1, 1, 4), size=x.shape[0]).mean()  # = 1; torch needs the size as a number
    opt.step()
    opt.zero_grad()
    return (loss * w).detach()


def _interpolate_after_the_step(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()  # momentum buffers in the optimizer's state (placeholders, while recording symbolically)
    model.last = loss.detach()  # a module attribute the call assigns
    w = F.interpolate(torch.ones(1, 1, 4), size=x.shape[0]).mean()
    opt.zero_grad()
    return (loss * w).detach()


@pytest.mark.parametrize("step", [_interpolate_after_backward, _interpolate_after_the_step],
                         ids=["after_backward", "after_the_step"])
def test_a_dropped_symbolic_attempt_leaves_the_state_as_it_found_it(step, unwritten_memory_is_nan):
    # Found by a review: the automatic mode dropped a symbolic recording that torch could not go on
    # with (F.interpolate to a size) and recorded the call static, but the attempt had already set
    # every .grad (and the momentum buffers) to uncomputed placeholders: the static run accumulated
    # into unwritten memory, and the parameters became NaN.
    objects = _sgd_objects()
    twins = copy.deepcopy(objects)
    traced = tracejit.trace(step)  # symbolic_shape=None
    for i, n in enumerate((5, 5, 3, 3, 6, 6, 3)):
        x, y = _batch(n, width=8, classes=4, seed=i)
        want = step(x, y, **objects)
        got = traced(x, y, **twins)
        assert torch.equal(got, want), (i, n)
        _same_state(twins, objects, (i, n))
    stats = traced.stats
    # sizes 5, 3 and 6 recorded static (3 after its symbolic attempt was dropped), the others replayed
    # (the first replay records the momentum buffers' creation again)
    assert stats.records == 3 and stats.checked_replays + stats.rerecords == 4 and traced._shape_traces == [], stats


def _bad_batch_step(x, y, *, model, opt, runs):
    runs.append(None)  # a run (a size would be a symbol in the attempt: Python state the attempt drops for)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    if x.shape[0] == 3:  # a bad batch, found after backward: the function's own exception
        raise ValueError("bad batch")
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("symbolic_shape", [None, True, False], ids=["automatic", "symbolic", "static"])
def test_the_functions_own_exception_during_a_symbolic_recording(symbolic_shape, unwritten_memory_is_nan):
    # The automatic mode took a step's own exception (raised on its Python path, not by torch on
    # stand-ins) for "cannot run on stand-ins": it left NaN in .grad (see above) and kept every
    # later size of the kind static. Now the attempt's state is put back and the static run raises
    # the exception as eager does, with the gradients the call computed before it; the kind stays
    # symbolic. (A user check that fails only on stand-ins, `assert isinstance(x.shape[0], int)`,
    # must not raise: so the automatic mode cannot tell the two apart before the static run.)
    objects = _sgd_objects()
    twins = copy.deepcopy(objects)
    traced = tracejit.trace(_bad_batch_step, symbolic_shape=symbolic_shape)
    eager_runs, traced_runs = [], []
    for i, n in enumerate((5, 5, 5, 3, 6, 6, 3, 5, 5, 6)):
        x, y = _batch(n, width=8, classes=4, seed=i)
        results = []
        for function, state, runs in ((_bad_batch_step, objects, eager_runs), (traced, twins, traced_runs)):
            try:
                results.append(function(x, y, **state, runs=runs))
            except ValueError as error:
                assert str(error) == "bad batch", error
                results.append("raised")
        assert same_tree(results[1], results[0]), (i, n, results)
        _same_state(twins, objects, (i, n))
        if symbolic_shape is None:  # a bad batch at a new size: its symbolic attempt, then the static run
            bad_so_far = sum(m == 3 for m in (5, 5, 5, 3, 6, 6, 3, 5, 5, 6)[:i + 1])
            assert 0 <= len(traced_runs) - len(eager_runs) <= bad_so_far, (i, n)
        else:
            assert traced_runs == eager_runs, (i, n)  # the function ran once per call
    if symbolic_shape is None:  # one bad batch does not keep the kind static
        assert traced._shape_traces and traced.stats.shape_specializations, traced.stats
    assert traced.stats.checked_replays >= 2, traced.stats


def _conv_flatten_linear():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Flatten(), torch.nn.Linear(64, 4))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)}


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_sizes_the_guards_fix_are_numbers_in_python_state(without_host):
    # With the height and width symbols, the flattened width is 4*(H//2)*(W//2), which the Linear's
    # matmul guards equal to 64: the weight's gradient and momentum buffer have that fixed size,
    # but were stand-ins of symbolic size: the call raised SymbolicTraceError, left a FakeTensor
    # in .grad (the next eager backward crashed) and dropped a momentum buffer.
    objects = _conv_flatten_linear()
    twins = copy.deepcopy(objects)

    def step(x, y, *, model, opt):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    traced = tracejit.trace(step, symbolic_shape=True, without_host=without_host)
    for i, n in enumerate((4, 4, 6, 6, 3, 4)):
        generator = torch.Generator().manual_seed(i)
        x, y = torch.randn(n, 3, 8, 8, generator=generator), torch.randint(0, 4, (n,), generator=generator)
        assert torch.allclose(traced(x, y, **twins), step(x, y, **objects), atol=1e-6), (i, n)
        for p, q in zip(twins["model"].parameters(), objects["model"].parameters()):
            assert torch.allclose(p, q, atol=1e-6), (i, n)
        assert len(twins["opt"].state) == len(objects["opt"].state) == 4
    assert traced.stats.records == 1 and traced._shape_traces, traced.stats

    def gradients_only(x, y, *, model):
        F.cross_entropy(model(x), y).backward()

    model = _conv_flatten_linear()["model"]
    tracejit.trace(gradients_only, symbolic_shape=True)(torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,)), model=model)
    grad = model[4].weight.grad
    assert type(grad) is torch.Tensor and grad.shape == (4, 64) and torch.isfinite(grad).all()
    gradients_only(torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2,)), model=model)  # eager goes on


class _NeedsTwoRows(torch.nn.Module):
    def forward(self, h):
        if h.shape[0] < 2:
            raise ValueError("needs two rows")
        return h


@pytest.mark.parametrize("last", ["own_module", "batch_norm"])
def test_an_exception_inside_a_modules_forward_at_a_new_size_is_eagers(last):
    # nn.Module.__call__ keeps the forward's arguments in a closure that the frames of the
    # exception hold even once cleared: the attempt's tensor counted as left in Python state, and
    # the call raised SymbolicTraceError where eager raises the module's ValueError.
    torch.manual_seed(0)
    tail = _NeedsTwoRows() if last == "own_module" else torch.nn.BatchNorm1d(8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), tail)
    objects = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}
    twins = copy.deepcopy(objects)

    def step(x, *, model, opt):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    traced = tracejit.trace(step)
    for i, n in enumerate((4, 4, 1, 3, 3, 1, 4)):
        x = _batch(n, width=8, seed=i)[0]
        outcomes = []
        for function, state in ((step, objects), (traced, twins)):
            try:
                outcomes.append(function(x, **state))
            except ValueError as error:  # SymbolicTraceError is not a ValueError
                outcomes.append(type(error))
        assert same_tree(outcomes[1], outcomes[0]), (i, n, outcomes)
        _same_state(twins, objects, (i, n))
    assert traced.stats.checked_replays >= 2, traced.stats


def test_a_dropped_attempt_restores_the_gradients_of_a_closures_parameters(unwritten_memory_is_nan):
    # parameters no keyword module holds: their .grad as the attempt first saw them is put back
    weight, twin = torch.randn(4, 8, requires_grad=True), None
    twin = weight.detach().clone().requires_grad_()

    def make(w):
        def step(x):
            loss = (x @ w.T).pow(2).mean()
            loss.backward()
            scale = F.interpolate(torch.ones(1, 1, 4), size=x.shape[0]).mean()
            with torch.no_grad():
                w.sub_(0.1 * w.grad)
                w.grad = None
            return (loss * scale).detach()
        return step

    eager, traced = make(weight), tracejit.trace(make(twin))
    for i, n in enumerate((5, 5, 3, 3, 6)):
        x = _batch(n, width=8, seed=i)[0]
        assert torch.equal(traced(x), eager(x)), (i, n)
        assert torch.equal(twin, weight) and twin.grad is None, (i, n)
    assert traced.stats.records == 3 and traced.stats.checked_replays == 2, traced.stats


def test_a_dropped_attempt_that_left_a_tensor_in_a_users_list_says_so():
    # a list of the user's own that the snapshot does not reach (a helper's global, three dicts
    # deep) is not put back: falling back to a static trace would leave an uncomputed tensor in
    # it, so the call raises, with the state of an eager call that raised there
    history = _DEEP["a"]["b"]["c"]["d"]["e"]
    history.clear()

    def step(x, *, model):
        loss = model(x).pow(2).mean()
        _DEEP["a"]["b"]["c"]["d"]["e"].append(loss.detach())  # of fixed size: a placeholder until the record runs
        scale = F.interpolate(torch.ones(1, 1, 4), size=x.shape[0]).mean()
        return loss.detach() * scale

    model = torch.nn.Linear(8, 2)
    traced = tracejit.trace(step)
    traced(torch.randn(5, 8), model=model)
    with pytest.raises(SymbolicTraceError, match=r"left t\d+ \[\] \(made by op #\d+ aten.mean.* in step, "
                                                  r"not computed yet\) in Python state.*symbolic_shape=False"):
        traced(x := torch.randn(3, 8), model=model)
    assert torch.equal(history[-1], model(x).pow(2).mean().detach())  # computed, as eager had before the raise


def _masked_attention(x, pad):
    return torch.softmax(x + pad[:, None, :], -1)  # `pad[:, None, :]`: full slices of symbolic dims


def _masked_attention_step(x, pad, y, *, model, opt):
    h = model(x) + pad[:, None, :1]  # a padding mask broadcast over the tokens
    loss = F.cross_entropy(torch.softmax(h, -1).mean(1), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("symbolic_shape", [True, None], ids=["symbolic", "automatic"])
def test_a_full_slice_of_a_symbolic_dim_is_elided_as_eager_elides_it(symbolic_shape):
    # Found by a review: symbolic_shape=True recorded aten.slice(pad, 0, 0, INT64_MAX) for the `:` of
    # a symbolic dim, which eager skips at concrete sizes: every later call, even at the recorded
    # sizes, raised TraceMismatchError (unsqueeze instead of slice). The sizes' symbols are now known
    # to be at most INT64_MAX, so torch skips the slice while recording, as eager does.
    traced = tracejit.trace(_masked_attention, symbolic_shape=symbolic_shape)
    for batch, tokens in ((2, 5), (2, 5), (3, 7), (3, 7), (4, 5), (2, 5)):
        x, pad = torch.randn(batch, tokens, tokens), torch.randn(batch, tokens)
        assert torch.equal(traced(x, pad), _masked_attention(x, pad)), (batch, tokens)
    assert len(traced._shape_traces) == 1, traced.stats
    assert torch.ops.aten.slice.Tensor not in [op.op for op in traced._shape_traces[0].record.ops]
    assert not any("9223372036854775807" in text for text in traced._shape_traces[0].guards.texts)
    stats = traced.stats
    assert stats.records == 1 + (symbolic_shape is None) and stats.checked_replays >= 3 and not stats.rerecords, stats

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 6)
    objects = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}
    sizes = [(4, 3), (4, 3), (5, 3), (5, 3), (4, 9), (6, 2), (4, 3)]

    def inputs(i):
        batch, tokens = sizes[i]
        generator = torch.Generator().manual_seed(i)
        return (torch.randn(batch, tokens, 6, generator=generator), torch.randn(batch, 6, generator=generator),
                torch.randint(0, 6, (batch,), generator=generator))

    step = tracejit.trace(_masked_attention_step, symbolic_shape=symbolic_shape)
    side_by_side(step, _masked_attention_step, objects, inputs, len(sizes), records=1 + (symbolic_shape is None))
    assert len(step._shape_traces) == 1 and step.stats.shape_specializations >= 2, step.stats


SIZES_SEEN: list = []
ROWS_SEEN = 0


class _Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.n = 0

    def forward(self, x):
        self.n = x.shape[0]
        return self.fc(x)


def _counting_step(x, *, model):
    global ROWS_SEEN
    SIZES_SEEN.append(x.shape[0])
    ROWS_SEEN += x.shape[0]
    return model(x).sum()


def test_sizes_kept_in_python_state_are_numbers_as_in_eager():
    """A call recorded with symbolic sizes ran the function's Python on them: `self.n = x.shape[0]`
    left the symbol `s77` on the module, a global counter became `s77 + 16` for good, a log list
    got `s77` (and `group["lr"] = 0.01 * x.shape[0]` made the optimizer unpicklable). Such an
    attempt is dropped now (its state put back) and the call records the static trace of its sizes."""
    global ROWS_SEEN
    model = _Counting()
    traced = tracejit.trace(_counting_step, backend="aten")
    SIZES_SEEN.clear()
    ROWS_SEEN = 0
    sizes = [8, 8, 5, 8, 3, 5, 3]
    for size in sizes:
        x = torch.randn(size, 4)
        with torch.no_grad():
            assert torch.equal(traced(x, model=model), model.fc(x).sum())
        assert type(model.n) is int and model.n == size
    assert SIZES_SEEN == sizes and all(type(n) is int for n in SIZES_SEEN)
    assert type(ROWS_SEEN) is int and ROWS_SEEN == sum(sizes)


def test_a_refused_symbolic_recording_leaves_no_symbol_behind():
    """With symbolic_shape=True the attempt is refused, and the module held the symbol (or a
    stand-in tensor) afterwards: unusable even eagerly."""
    model = _Counting()
    traced = tracejit.trace(_counting_step, backend="aten", symbolic_shape=True)
    with torch.no_grad(), pytest.raises(tracejit.SymbolicTraceError, match=r"leaves a symbolic size in Python state"):
        traced(torch.randn(8, 4), model=model)
    assert type(model.n) is int and all(type(n) is int for n in SIZES_SEEN) and type(ROWS_SEEN) is int
    with torch.no_grad():
        model(torch.randn(2, 4))
    assert model.n == 2


def _rnn_step(x, *, rnn, opt):
    loss = rnn(x)[0].square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("cell", [torch.nn.GRU, torch.nn.LSTM], ids=["gru", "lstm"])
def test_recurrent_layers_under_symbolic_sizes_refuse_clearly_or_pin_and_train_per_size_by_default(cell):
    # torch's C++ needs concrete sizes there (at::native::lstm's numel(), the GRU gates' split of a
    # storage of symbolic size): a raw RuntimeError from inside torch before
    torch.manual_seed(0)
    rnn_a = cell(4, 6, batch_first=True)
    rnn_b = copy.deepcopy(rnn_a)
    opt_a, opt_b = torch.optim.SGD(rnn_a.parameters(), lr=0.1), torch.optim.SGD(rnn_b.parameters(), lr=0.1)
    refusing = tracejit.trace(_rnn_step, symbolic_shape=True)
    if cell is torch.nn.LSTM:
        with pytest.raises(SymbolicTraceError, match=r"symbolic_shape=True cannot record _rnn_step\(\) at "
                                                     r"test_symbolic_shape.py:\d+ in _rnn_step: loss = rnn\(x\)"):
            refusing(torch.randn(2, 5, 4), rnn=rnn_b, opt=opt_b)
        for a, b in zip(rnn_a.parameters(), rnn_b.parameters()):  # the failed attempt changed nothing
            assert torch.equal(a, b) and b.grad is None
    else:  # the GRU's C++ reads its sizes, which pins them: a trace per size, as eager computes
        pinned_a, pinned_b = copy.deepcopy(rnn_a), copy.deepcopy(rnn_b)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pinned_a, pinned_b)]
        for i, batch in enumerate([2, 3, 2]):
            x = torch.randn(batch, 5, 4, generator=torch.Generator().manual_seed(i))
            assert torch.equal(refusing(x, rnn=pinned_b, opt=opts[1]), _rnn_step(x, rnn=pinned_a, opt=opts[0])), i
        assert refusing.stats.records == 2 and refusing.stats.checked_replays == 1
    traced = tracejit.trace(_rnn_step, backend="aten")  # automatic: a static trace per batch size
    for i, batch in enumerate([2, 3, 2, 3, 2, 3]):
        x = torch.randn(batch, 5, 4, generator=torch.Generator().manual_seed(i))
        assert torch.equal(traced(x, rnn=rnn_b, opt=opt_b), _rnn_step(x, rnn=rnn_a, opt=opt_a)), i
        for a, b in zip(rnn_a.parameters(), rnn_b.parameters()):
            assert torch.equal(a, b), i
    assert traced.stats.checked_replays == 4


def _conv_step_returning_its_output(x, *, model, opt):
    out = model(x)
    loss = out.pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss, out


@pytest.mark.parametrize("layer", ["conv", "linear"])
@pytest.mark.parametrize("mode", [None, True], ids=["automatic", "symbolic"])
@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_a_training_step_returning_its_output_with_the_loss_is_generalized(layer, mode, without_host):
    # `return loss, out`: the backward of the call used out's graph, yet symbolic recording refused
    # out as "requires grad, runs no backward pass for it" (symbolic_shape=True raised; the automatic
    # mode dropped the attempt, recorded each size static, and the 9th size filled the cache)
    torch.manual_seed(0)
    model = (torch.nn.Conv2d(3, 4, 3, padding=1) if layer == "conv" else torch.nn.Linear(3, 4))
    objects = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}
    twins = copy.deepcopy(objects)
    traced = tracejit.trace(_conv_step_returning_its_output, symbolic_shape=mode, without_host=without_host)
    sizes = [6, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 7, 6]
    for i, n in enumerate(sizes):
        x = torch.randn(2, 3, n, n) if layer == "conv" else torch.randn(n, 3)
        want = _conv_step_returning_its_output(x.clone(), **objects)
        got = traced(x.clone(), **twins)
        assert same_tree(got, want), i
        for name in objects:
            assert same_tree(state_of(twins[name]), state_of(objects[name])), (i, name)
        # with history where eager's (used up) graph comes back, as from a static trace's checked calls;
        # else without, as from the API level and without_host
        assert got[1].requires_grad == (got[1].grad_fn is not None), i
        if i == (2 if mode is None else 0):  # the call recording symbolically returns out computed
            assert not got[1].requires_grad and len(traced._shape_traces) == 1, i
    stats = traced.stats
    assert stats.records == (2 if mode is None else 1) and len(traced._shape_traces) == 1, stats
    assert stats.shape_specializations == len(set(sizes)) - stats.records, stats
    if without_host:
        assert stats.host_free_calls >= 2, stats


def test_a_host_read_of_a_computed_value_names_symbolic_shape_and_its_remedies():
    @tracejit.trace(symbolic_shape=True)
    def scaled(x):
        return x * x.sum().item()

    with pytest.raises(tracejit.SymbolicTraceError) as raised:
        scaled(torch.randn(3))
    message = str(raised.value)
    assert "recorded with symbolic_shape=True" in message and "symbolic=True" not in message
    assert message.endswith("or trace with symbolic_shape=None (the default) or False.")
    assert "exclude_from_trace" not in message  # which symbolic_shape=True refuses


class _Meter:
    def __init__(self):
        self.last = None
        self.inner = None


_PREDICTIONS: list = []


def _keeping_step(where):
    """mlp_step that keeps its detached predictions, as epoch metrics do, `where` says where."""
    def step(x, y, *, model, opt, store):
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if where == "a global list":
            _PREDICTIONS.append(out.detach().argmax(1))
        elif where == "a keyword list":
            store["list"].append(out.detach().argmax(1))
        else:
            store["meter"].last = out.detach()
        return loss.detach()
    return step


KEEPING = ["a global list", "a keyword list", "an attribute of a keyword object"]


@pytest.mark.parametrize("where", KEEPING)
def test_the_automatic_mode_records_a_smaller_last_batch_that_keeps_predictions(where):
    """Hunt U F1: a smaller last batch was first recorded on stand-ins of symbolic size; the step
    kept one (in a global or keyword list, an attribute of the user's object) that the snapshot of
    the attempt did not put back, so the call raised SymbolicTraceError and left a FakeTensor in
    the user's list (`torch.cat(preds)` then failed). Those containers are put back now, and the
    call records the static trace of its size, as the automatic mode promises."""
    sizes = [12, 12, 12, 7, 12, 7]
    results = {}
    for traced in (False, True):
        objects = _mlp_objects()
        _PREDICTIONS.clear()
        store = {"list": [], "meter": _Meter()}
        step = _keeping_step(where)
        if traced:
            step = tracejit.trace(step, backend="aten")
        kept = []
        for i, n in enumerate(sizes):
            x, y = _batch(n, seed=i)
            step(x, y, **objects, store=store)
            kept.append(store["meter"].last)
        lists = [*_PREDICTIONS, *store["list"]]
        assert not any(type(t) is not torch.Tensor for t in [*lists, *(k for k in kept if k is not None)])
        results[traced] = (lists, kept, [state_of(v) for v in objects.values()]), step
    (want, _), (got, traced) = results[False], results[True]
    assert same_tree(got, want)
    assert traced.stats.records == 2  # the first size, and the static trace of the smaller one
    assert traced.stats.replays == len(sizes) - 2 - traced.stats.rerecords


def test_a_stand_in_kept_where_nothing_puts_it_back_is_replaced_by_its_value_when_the_call_raises():
    """The attempt's stand-in kept deeper than the snapshot reaches: the call raises, as
    documented, and the container holds what an eager call that raised there leaves (the computed
    predictions), not a FakeTensor."""
    objects, twins = _mlp_objects(), _mlp_objects()
    deep = _DEEP["a"]["b"]["c"]["d"]["e"]
    deep.clear()

    def step(x, y, *, model, opt):
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        _DEEP["a"]["b"]["c"]["d"]["e"].append(out.detach())
        return loss.detach()

    traced = tracejit.trace(step, backend="aten")
    wanted = []
    for i, n in enumerate([12, 12, 12, 7]):
        x, y = _batch(n, seed=i)
        if n == 7:
            with pytest.raises(SymbolicTraceError, match="keeps t"):
                traced(x, y, **objects)
        else:
            traced(x, y, **objects)
        out = twins["model"](x)
        wanted.append(out.detach())
        F.cross_entropy(out, y).backward()
        twins["opt"].step()
        twins["opt"].zero_grad()
    assert [type(t) for t in deep] == [torch.Tensor] * 4
    assert all(torch.equal(a, b) for a, b in zip(deep, wanted))
    assert same_tree([state_of(v) for v in objects.values()], [state_of(v) for v in twins.values()])


@pytest.mark.filterwarnings("ignore:.*keeps an output tensor beyond the call:tracejit.ReplayLevelWarning")
@pytest.mark.parametrize("where", ["a keyword list", "an attribute of a keyword object"])
def test_a_returned_tensor_also_kept_is_the_returned_tensor_at_every_size(where):
    """Review 44 F3: `d = out.detach() * 1; meter.last = d; return d` at a new size. The kept
    stand-in was left in the user's object (a FakeTensor, silently), and once such containers were
    checked, it counted as a symbol left in Python state, so every size recorded its own trace
    until TraceCacheFullError. It is the returned tensor there too now, and one symbolic trace
    serves every size."""
    def step(x, *, model, store):
        d = model(x).detach() * 1
        if where == "a keyword list":
            store["list"].append(d)
        else:
            store["meter"].last = d
        return d

    model = MLP((32, 64, 10))
    store = {"list": [], "meter": _Meter()}
    traced = tracejit.trace(step, backend="aten")
    for i, n in enumerate([4, 4, 6, 9, 5, 12, 7, 3, 8, 10, 11, 13]):
        x, _ = _batch(n, seed=i)
        got = traced(x, model=model, store=store)
        kept = store["list"][-1] if where == "a keyword list" else store["meter"].last
        assert type(kept) is torch.Tensor and kept is got, (i, n)
        assert torch.equal(got, model(x).detach()), (i, n)
    assert len(traced._shape_traces) == 1 and traced.stats.shape_specializations == 9, traced.stats
    if where == "a keyword list":
        assert len(store["list"]) == 12 and all(type(t) is torch.Tensor for t in store["list"])
