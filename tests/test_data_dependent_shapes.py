"""Data-dependent output shapes (issue 14.2): an op whose output size depends on tensor values gets a
trace variant per size in checked replay (runtime/variants.py); without_host refuses such traces.

Checked calls run at the aten level: the API level refuses these traces (tested once below), and
the `level` fixture runs each test with both settings of TRACEJIT_REPLAY.
"""

import copy

import pytest
import torch

import tracejit

pytestmark = [
    pytest.mark.filterwarnings("ignore::tracejit.ReplayLevelWarning"),
    pytest.mark.skip_mode("symbolic", reason="symbolic recording refuses data-dependent shapes (test_symbolic.py)"),
]


@pytest.fixture(params=["api", "aten"])
def level(request, monkeypatch):
    monkeypatch.setenv("TRACEJIT_REPLAY", request.param)
    return request.param


def _repeat_interleave(x, r):
    return (torch.repeat_interleave(x * 2, r) + 1).exp()


def _nonzero(x, r):
    return torch.nonzero(r).float() * x.sum()


def _masked_select(x, r):
    return torch.masked_select(x + 1, r > 0).neg()


def _unique(x, r):
    values, counts = torch.unique(r, return_counts=True)
    return values * 3, counts + x.numel()


def _boolean_index(x, r):
    return (x * 2)[r > 0].sin()


OPS = {"repeat_interleave": _repeat_interleave, "nonzero": _nonzero, "masked_select": _masked_select,
       "unique": _unique, "boolean_index": _boolean_index}
# three `repeats`/masks of different data-dependent output sizes, cycled
SIZES = [torch.tensor([1, 0, 2, 1]), torch.tensor([0, 0, 1, 0]), torch.tensor([3, 1, 2, 4])]


def _equal(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("name", list(OPS))
def test_each_size_gets_a_variant_and_later_calls_replay_it(trace, level, name):
    body = OPS[name]
    f = trace(body)
    calls = 7
    for i in range(calls):
        x, r = torch.randn(4), SIZES[i % 3].clone()
        assert _equal(f(x, r), body(x, r)), f"call {i}"
    assert f.stats.records == 1
    assert f.stats.shape_variants == 2  # the second and third size, once each
    assert f.stats.checked_replays == calls - 3
    assert f.stats.api_replays == 0
    entry = f._entries()[0]
    assert len(entry.variants) == 3


def test_python_code_after_the_op_may_take_another_path_per_size(trace, level):
    def body(x, r):
        idx = torch.nonzero(r).squeeze(1)
        if len(idx) > 2:  # a shape read: the variant of this size records the other branch
            return x[idx].cumsum(0)
        return x[idx] * 2

    f = trace(body)
    for i in range(6):
        x, r = torch.randn(4), SIZES[i % 3].clone()
        assert _equal(f(x, r), body(x, r))
    assert f.stats.shape_variants == 2 and f.stats.checked_replays == 3


def test_two_data_dependent_ops_move_between_variants(trace, level):
    def body(x, r, m):
        a = torch.repeat_interleave(x, r) + 1
        b = torch.masked_select(x, m).exp()
        return a * 2, b - 1

    f = trace(body)
    r_small, r_big = torch.tensor([1, 0, 1, 0]), torch.tensor([2, 2, 1, 0])
    m_small, m_big = torch.tensor([True, False, False, False]), torch.tensor([True, True, False, True])
    pattern = [(r_small, m_small), (r_small, m_big), (r_big, m_small), (r_small, m_big), (r_big, m_small),
               (r_small, m_small), (r_big, m_big), (r_big, m_big)]
    for r, m in pattern:
        x = torch.randn(4)
        assert _equal(f(x, r, m), body(x, r, m))
    assert f.stats.records == 1
    assert f.stats.shape_variants == 3  # (small, big), (big, small), (big, big)
    assert f.stats.checked_replays == 4


def test_with_a_compiled_fused_backend(level):
    if tracejit.backends.resolve_backend("c") is None:
        pytest.skip("no C compiler")

    def body(x, r):
        y = (x * 2 + 1).tanh()  # fused before the op
        z = torch.repeat_interleave(y, r)
        return (z * z - 1).exp()  # and after it, in another group

    f = tracejit.trace(body, backend="c")
    for i in range(6):
        x, r = torch.randn(4), SIZES[i % 3].clone()
        got, want = f(x, r), body(x, r)
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert f.stats.shape_variants == 2 and f.stats.checked_replays == 3
    assert sum(entry.program.groups_fired for entry in f._entries()) > 0  # fused kernels ran


def test_max_traces_bounds_the_variants_and_names_the_op(trace):
    f = trace(_nonzero, max_traces=2)
    x = torch.randn(4)
    f(x, SIZES[0].clone())
    f(x, SIZES[1].clone())  # the second variant
    with pytest.raises(tracejit.TraceCacheFullError,
                       match=r"(?s)op #\d+ aten\.nonzero\.default at .*_nonzero.*int64\[4, 1\].*max_traces=2.*int64\[3, 1\]"):
        f(x, SIZES[2].clone())
    for i in range(4):  # the trace is left clean: sizes seen before keep replaying
        r = SIZES[i % 2].clone()
        assert _equal(f(x, r), _nonzero(x, r))
    assert f.stats.shape_variants == 1 and f.stats.checked_replays == 4


def test_a_new_input_signature_counts_the_variants(trace):
    f = trace(_masked_select, max_traces=2)
    f(torch.randn(4), SIZES[0].clone())
    f(torch.randn(4), SIZES[1].clone())  # a variant: two traces now
    with pytest.raises(tracejit.TraceCacheFullError, match="new input signature"):
        f(torch.randn(5), torch.tensor([1, 0, 1, 0, 1]))


def test_without_host_refuses_data_dependent_shapes(trace):
    f = trace(_repeat_interleave, without_host=True)
    x = torch.randn(4)
    assert _equal(f(x, SIZES[0].clone()), _repeat_interleave(x, SIZES[0]))  # recording runs eagerly
    with pytest.raises(tracejit.HostDependencyError,
                       match=r"(?s)data-dependent shape.*aten\.repeat_interleave\.Tensor at .*_repeat_interleave"):
        f(x, SIZES[0].clone())


def test_api_level_refuses_saying_why(monkeypatch):
    monkeypatch.setenv("TRACEJIT_REPLAY", "api")
    f = tracejit.trace(_nonzero)
    f(torch.randn(4), SIZES[0].clone())
    with pytest.warns(tracejit.ReplayLevelWarning, match="aten.nonzero.default .* data-dependent output shape"):
        f(torch.randn(4), SIZES[0].clone())
    assert f.stats.checked_replays == 1 and f.stats.api_replays == 0


def test_training_step_with_a_boolean_mask(trace, level):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    reference = copy.deepcopy(model)

    def step(x, y, *, model, opt):
        opt.zero_grad()
        keep = y > 0  # the loss covers a data-dependent number of samples
        loss = ((model(x).squeeze(1)[keep] - y[keep]) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_eager = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    f = trace(step)
    for i in range(8):
        x = torch.randn(8, 4)
        y = torch.randn(8).abs() + 0.1
        y[: i % 3] *= -1  # 8, 7 and 6 samples kept, cycled
        assert torch.equal(f(x, y, model=model, opt=opt), step(x, y, model=reference, opt=opt_eager))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    # a trace without and one with .grad; then the other two sizes get variants, and the rest replays
    assert f.stats.records == 2 and f.stats.shape_variants == 2 and f.stats.checked_replays == 4


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam_fused"])
def test_a_size_first_seen_when_the_optimizer_made_its_state_replays_later(trace, level, optimizer):
    # The first call's size comes back after another size was replayed: its variant was recorded by
    # the call that created the optimizer's state lazily, which later calls do not create again.
    def make(params):
        if optimizer == "sgd_momentum":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.Adam(params, lr=0.01, fused=True)

    def step(x, *, model, opt):
        h = model(x)
        loss = h[x[:, 0] > 0].sum() + h.mean()  # one or two rows selected
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    reference = copy.deepcopy(model)
    opt, opt_eager = make(model.parameters()), make(reference.parameters())
    one = torch.tensor([[1.0, 0, 0, 0], [-1, 0, 0, 0]])
    two = torch.tensor([[1.0, 0, 0, 0], [1, 0, 0, 0]])
    f = trace(step)
    for x in [one, two, two, one, one, one, two, one]:
        assert torch.equal(f(x, model=model, opt=opt), step(x, model=reference, opt=opt_eager))
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p, q)
    for state, state_eager in zip(opt.state.values(), opt_eager.state.values()):
        for key in state:
            assert torch.equal(torch.as_tensor(state[key]), torch.as_tensor(state_eager[key]))
    # the first size's variant is recorded again once, by its first call after the state existed
    assert f.stats.records == 1 and f.stats.shape_variants == 1 and f.stats.rerecords == 1
    assert f.stats.checked_replays == 5


def _gather_step(x, idx, rows, cols, *, model, opt):
    opt.zero_grad()
    h = model(x)[idx]  # integer indexing: the result has idx's size
    loss = (h[rows, cols] ** 2).mean() + h.mean()
    loss.backward()
    opt.step()
    return loss.detach(), h.detach()


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_integer_indexing_is_not_data_dependent(without_host, monkeypatch):
    monkeypatch.setenv("TRACEJIT_REPLAY", "api")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_eager = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    f = tracejit.trace(_gather_step, backend="aten", without_host=without_host)

    def call(function, model, opt, idx):
        x = torch.randn(10, 4)
        rows, cols = torch.randint(0, 6, (5,)), torch.randint(0, 3, (5,))
        return function(x, idx, rows, cols, model=model, opt=opt)

    for i in range(6):
        idx = torch.randint(0, 10, (6,))
        torch.manual_seed(i)
        got = call(f, model, opt, idx)
        torch.manual_seed(i)
        want = call(_gather_step, reference, opt_eager, idx)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"call {i}"
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters())), f"call {i}"
    if without_host:
        assert f.stats.host_free_calls >= 3
    else:  # each of the two records (before and after .grad exists) replays at the aten level once
        assert f.stats.api_replays == f.stats.checked_replays - 2 >= 2 and f.stats.api_fallbacks == 0
    # an index out of range raises torch's IndexError, as eager does, at the lookup: the parameters
    # are untouched, and the zero_grad() before it has cleared every gradient
    before = [p.clone() for p in model.parameters()]
    for function, m, o in ((f, model, opt), (_gather_step, reference, opt_eager)):
        with pytest.raises(IndexError, match="out of bounds"):
            call(function, m, o, torch.tensor([0, 1, 2, 3, 4, 10]))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None and q.grad is None for p, q in zip(model.parameters(), reference.parameters()))
    idx = torch.randint(0, 10, (6,))
    torch.manual_seed(9)
    got = call(f, model, opt, idx)
    torch.manual_seed(9)
    want = call(_gather_step, reference, opt_eager, idx)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
