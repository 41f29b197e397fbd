"""symbolic_shape findings (2026-11-27): ops torch runs differently on the stand-ins that
symbolic-shape recording uses than on real tensors. `F.one_hot` skips its value-range check on a
stand-in, `torch.arange` with a step computed from a size breaks torch's own fake run. Each case
checks that symbolic_shape=True refuses clearly (a SymbolicTraceError naming the op and the user's
line, with the state untouched) and that the automatic mode (the default) matches eager exactly:
outputs, parameters and gradients, call by call."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracejit
from tracejit import SymbolicTraceError

BATCHES = (4, 4, 6, 4, 6, 3)


def one_hot_step(x, y, *, model, opt):
    logp = model(x).log_softmax(-1)
    loss = -(F.one_hot(y, 5) * logp).sum() / x.shape[0]  # the line the refusal names
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def arange_step(x, y, *, model, opt):
    positions = torch.arange(0, 1, 1 / x.shape[0])  # the line the refusal names
    loss = F.mse_loss(model(x) * positions[:, None], y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def one_hot_inputs(n):
    return torch.randn(n, 8), torch.randint(0, 5, (n,))


def arange_inputs(n):
    return torch.randn(n, 8), torch.randn(n, 2)


CASES = {
    "one_hot": (one_hot_step, one_hot_inputs, 5, "one_hot", "F.one_hot(y, 5)"),
    "arange": (arange_step, arange_inputs, 2, "aten.arange", "torch.arange(0, 1, 1 / x.shape[0])"),
}


def make_model(case):
    torch.manual_seed(0)
    return nn.Linear(8, CASES[case][2])


def assert_same_model(eager: nn.Module, traced: nn.Module, where: str) -> None:
    for (name, a), b in zip(eager.named_parameters(), traced.parameters()):
        assert torch.equal(a, b), f"{where}: {name}"
        assert (a.grad is None) == (b.grad is None), f"{where}: {name}.grad"
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), f"{where}: {name}.grad"


@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_symbolic_shape_true_refuses_naming_the_line(case, without_host):
    """The first call raises a SymbolicTraceError naming the op and the user's line (one_hot: before,
    it recorded a trace without the range check and the second call raised TraceMismatchError;
    arange: torch's INTERNAL ASSERT RuntimeError), and leaves parameters, gradients and optimizer
    state as they were."""
    step, inputs, _, op, code = CASES[case]
    x, y = inputs(5)
    model = make_model(case)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = copy.deepcopy(model)
    traced = tracejit.trace(step, symbolic_shape=True, without_host=without_host)
    with pytest.raises(SymbolicTraceError) as raised:
        traced(x, y, model=model, opt=opt)
    message = str(raised.value)
    assert op in message and "test_shape_findings.py" in message and code in message, message
    assert "symbolic_shape" in message, message
    assert_same_model(before, model, "after the refusal")
    assert opt.state_dict()["state"] == {}
    assert traced.stats.records == 0


@pytest.mark.parametrize("case", list(CASES))
def test_automatic_mode_matches_eager(case):
    """The default (symbolic_shape=None) falls back to one static trace per shape, exact as eager."""
    step, inputs, _, _, _ = CASES[case]
    model = make_model(case)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    emodel = copy.deepcopy(model)
    eopt = torch.optim.SGD(emodel.parameters(), lr=0.1, momentum=0.9)
    eopt.load_state_dict(opt.state_dict())
    traced = tracejit.trace(step)
    for i, n in enumerate(BATCHES):
        x, y = inputs(n)
        want = step(x.clone(), y.clone(), model=emodel, opt=eopt)
        got = traced(x.clone(), y.clone(), model=model, opt=opt)
        assert torch.equal(got, want), f"call {i}"
        assert_same_model(emodel, model, f"call {i}")
    stats = traced.stats
    assert stats.eager_calls == 0 and stats.shape_specializations == 0, stats
    assert stats.records == len(set(BATCHES)) and stats.calls == len(BATCHES), stats


def half_batch_step(x, *, model, opt):
    batch = x.shape[0]
    out = model(x)
    loss = out.mean() + out[:batch // 2].sum()  # size 1 at batches 2 and 3: a pinned layout
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("options", [{}, {"symbolic_shape": True}, {"without_host": True}],
                         ids=["automatic", "symbolic_shape", "without_host"])
def test_view_of_pinned_size_runs_with_concrete_arguments(options):
    """`out[:B // 2]` at B = 3: the slice has size 1, which the guards pin, so its backward's
    `expand(grad, [s//2, 8])` runs for real, and it was handed the SymInt (torch refused: "expected
    to contain only concrete integers"; the automatic mode then raised SymbolicTraceError on every
    call of batch 3). Every batch now matches eager."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    emodel = copy.deepcopy(model)
    eopt = torch.optim.SGD(emodel.parameters(), lr=0.1, momentum=0.9)
    traced = tracejit.trace(half_batch_step, **options)
    batches = (4, 4, 3, 5, 3, 2, 3)
    for i, n in enumerate(batches):
        x = torch.randn(n, 8)
        want = half_batch_step(x.clone(), model=emodel, opt=eopt)
        got = traced(x.clone(), model=model, opt=opt)
        assert torch.equal(got, want), f"call {i}"
        assert_same_model(emodel, model, f"call {i}")
    for a, b in zip(eopt.state_dict()["state"].values(), opt.state_dict()["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    stats = traced.stats
    assert stats.calls == len(batches) and stats.eager_calls == 0, stats
    assert stats.records <= 3 and stats.records + stats.rerecords < len(batches), stats


MAX_LEN = 6


def truncating_step(x, *, model, opt):
    head, tail = x[:, :MAX_LEN], x[:, -MAX_LEN:]  # the whole sequence when it is at most MAX_LEN long
    loss = model(head).pow(2).mean() + model(tail).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("options", [{"symbolic_shape": True}, {"symbolic_shape": True, "without_host": True}],
                         ids=["symbolic_shape", "without_host"])
@pytest.mark.parametrize("lengths", [(10, 10, 8, 5, 5, 12, 4), (5, 5, 10, 10, 4, 12, 6)], ids=["long_first", "short_first"])
def test_truncating_slices_match_eager_at_every_length(options, lengths):
    """`x[:, :6]` on a sequence of at most 6 is the whole dim, for which torch's indexing
    dispatches `aten.alias` instead of the recorded `aten.slice`: every such call of a trace of
    symbolic sizes raised TraceMismatchError. The recorded slice now answers it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    emodel = copy.deepcopy(model)
    eopt = torch.optim.SGD(emodel.parameters(), lr=0.1)
    traced = tracejit.trace(truncating_step, **options)
    generator = torch.Generator().manual_seed(2)
    for i, n in enumerate(lengths):
        x = torch.randn(3, n, 4, generator=generator)
        want = truncating_step(x.clone(), model=emodel, opt=eopt)
        got = traced(x.clone(), model=model, opt=opt)
        assert torch.equal(got, want), f"call {i}"
        assert_same_model(emodel, model, f"call {i}")
    stats = traced.stats
    # a new trace where the guards of the negative start's size (`x[:, -6:]`) say so, no more
    assert stats.records <= 3 and stats.eager_calls == 0, stats
    assert stats.checked_replays + stats.host_free_calls == len(lengths) - stats.records, stats


def padding_step(x, *, model, opt):
    h = F.pad(model(x), (0, 0, 0, 1))  # one slot at the end of the sequence
    loss = h.pow(2).mean() + F.pad(h, (1, 1), value=0.5).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_constant_padding_keeps_one_trace_of_symbolic_sizes():
    """`F.pad` under symbolic sizes: its meta kernel reads every size as an int, which pinned them
    all, so each sequence length recorded a trace of its own and the ninth raised
    TraceCacheFullError. Its layout now comes from torch's decomposition."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    emodel = copy.deepcopy(model)
    eopt = torch.optim.SGD(emodel.parameters(), lr=0.1)
    traced = tracejit.trace(padding_step)
    lengths = (5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 17, 6, 7)
    generator = torch.Generator().manual_seed(3)
    for i, n in enumerate(lengths):
        x = torch.randn(4, n, 8, generator=generator)
        want = padding_step(x.clone(), model=emodel, opt=eopt)
        got = traced(x.clone(), model=model, opt=opt)
        assert torch.equal(got, want), f"call {i}"
        assert_same_model(emodel, model, f"call {i}")
    stats = traced.stats
    assert stats.records == 2 and stats.eager_calls == 0, stats  # the first length's, then one of symbols
    assert stats.checked_replays == len(lengths) - 2, stats


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_upsampling_under_symbolic_shape_replays_every_size_it_saw(mode, without_host):
    """`F.interpolate` reads its input's sizes in C++: on a stand-in of symbolic size that
    dispatched `aten.size`, which the record kept as an op, so the second call at a size seen
    before raised TraceMismatchError ("aten.upsample_nearest2d instead of aten.size")."""
    def upsample(x):
        return F.interpolate(x * 2, scale_factor=2.0, mode=mode) + 1

    traced = tracejit.trace(upsample, symbolic_shape=True, without_host=without_host)
    generator = torch.Generator().manual_seed(4)
    batches = (2, 2, 3, 2, 3, 3)
    for i, n in enumerate(batches):
        x = torch.randn(n, 2, 4, 4, generator=generator)
        assert torch.equal(traced(x), upsample(x)), f"call {i}"
    stats = traced.stats
    assert stats.eager_calls == 0 and stats.records <= 2, stats
    assert stats.checked_replays + stats.host_free_calls == len(batches) - stats.records, stats


def cropping_step(x):
    y = F.pad(x.transpose(0, 1), (-1, 0))  # crops a column of a strided input
    return y * 1, y.reshape(-1) + 0


def test_cropping_a_strided_input_keeps_atens_layout():
    """`F.pad` by amounts none above 0 clones a narrowed view in ATen, keeping the input's layout;
    torch's decomposition allocates contiguous there, and a record of its layout made the
    `reshape` a view the real run could not take (found by review of the decomposition)."""
    traced = tracejit.trace(cropping_step)
    generator = torch.Generator().manual_seed(6)
    for i, n in enumerate((5, 6, 7, 6, 8, 7)):
        x = torch.randn(n, 4, generator=generator)
        for got, want in zip(traced(x), cropping_step(x)):
            assert torch.equal(got, want), f"call {i}"
    assert traced.stats.eager_calls == 0 and traced.stats.checked_replays >= 2, traced.stats
