"""Memory that tensors the function reaches share now and did not when recorded (two parameters'
`.grad` over one memory), found by review.

Each test failed before its fix (see the stop note of 2026-11-27).
"""

import copy
import gc
import re
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit


def _model_and_sgd() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _accumulating_step(x, y, *, do_step, model, opt):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    if do_step:
        opt.step()
        opt.zero_grad()
    return loss.detach()


def _share_bias_grads(model: nn.Module) -> None:
    model[2].bias.grad = model[0].bias.grad.detach()  # one memory, two tensor objects


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=generator), torch.randn(4, 8, generator=generator)) for _ in range(count)]


def _close(a: torch.Tensor, b: torch.Tensor, backend: str) -> bool:
    return torch.equal(a, b) if backend == "aten" else torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["aten", pytest.param("c", marks=pytest.mark.skipif(
    tracejit.backends.resolve_backend("c") is None, reason="no C compiler"))])
@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_gradients_sharing_memory_after_recording_match_eager_or_raise(without_host, backend):
    """Two parameters' `.grad` made one memory after the record: backward accumulates both into it
    in eager, the program into two (a parameter drifted by 0.03). The binding compared the
    gradients' ids, the aten-level replay did not compare memory at all. Now such a call runs the
    ops themselves (aten backend) or raises where the compiled program would compute it."""
    eager_model, eager_opt = _model_and_sgd()
    model, opt = _model_and_sgd()
    traced = tracejit.trace(_accumulating_step, without_host=without_host, backend=backend)
    batches = _batches(14)
    for index, (x, y) in enumerate(batches[:8]):
        do_step = index % 2 == 1
        want = _accumulating_step(x, y, do_step=do_step, model=eager_model, opt=eager_opt)
        got = traced(x, y, do_step=do_step, model=model, opt=opt)
        assert _close(got, want, backend)
        for p, q in zip(model.parameters(), eager_model.parameters()):
            assert _close(p, q, backend)
    assert traced.stats.records == 2 and traced.stats.checked_replays + traced.stats.host_free_calls >= 5
    for index, (x, y) in enumerate(batches[8:]):
        do_step = index % 2 == 1
        if do_step:
            _share_bias_grads(eager_model)
            _share_bias_grads(model)
        want = _accumulating_step(x, y, do_step=do_step, model=eager_model, opt=eager_opt)
        try:
            got = traced(x, y, do_step=do_step, model=model, opt=opt)
        except tracejit.TraceMismatchError as error:
            assert do_step and backend != "aten"
            assert re.search(r"shares memory with t\d+ \(model\.\d\.bias\.grad\) now", str(error))
            return
        assert _close(got, want, backend)
        for p, q in zip(model.parameters(), eager_model.parameters()):
            assert _close(p, q, backend)
    assert backend == "aten"


def test_gradients_sharing_memory_from_the_record_on_match_eager():
    """The recorder notes memory shared when it records: such a trace computes it as eager does."""
    eager_model, eager_opt = _model_and_sgd()
    model, opt = _model_and_sgd()
    traced = tracejit.trace(_accumulating_step)
    x, y = _batches(1)[0]
    for m, o in ((eager_model, eager_opt), (model, opt)):
        _accumulating_step(x, y, do_step=False, model=m, opt=o)
        _share_bias_grads(m)
    for x, y in _batches(4):
        want = _accumulating_step(x, y, do_step=False, model=eager_model, opt=eager_opt)
        got = traced(x, y, do_step=False, model=model, opt=opt)
        assert torch.equal(got, want)
        for p, q in zip(model.parameters(), eager_model.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert model[2].bias.grad.data_ptr() == model[0].bias.grad.data_ptr()
    assert traced.stats.checked_replays == 3


class _WithAnEmptyHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.empty = nn.Linear(4, 0)  # a head with no classes: its gradients have no memory

    def forward(self, x):
        return torch.cat([self.body(x), self.empty(x)], 1)


def _no_zeroing_step(x, *, model, opt):
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss


def test_empty_gradients_do_not_count_as_sharing_memory():
    """Every empty `.grad` has address 0: the address guard took them for one memory and no call
    ran without the host (found by review of the guard)."""
    torch.manual_seed(0)
    model = _WithAnEmptyHead()
    eager = copy.deepcopy(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, model)]
    traced = tracejit.trace(_no_zeroing_step, without_host=True)
    generator = torch.Generator().manual_seed(5)
    for i in range(6):
        x = torch.randn(2, 4, generator=generator)
        assert torch.equal(traced(x, model=model, opt=optimizers[1]), _no_zeroing_step(x, model=eager, opt=optimizers[0]))
        for p, q in zip(model.parameters(), eager.parameters()):
            assert torch.equal(p, q), i
    assert traced.stats.host_free_calls == 4 and traced.stats.host_free_misses == 0, traced.stats


# -- globals and inputs that come to share memory after the record (the stop note of 2026-11-28) --

_C = pytest.param("c", marks=pytest.mark.skipif(tracejit.backends.resolve_backend("c") is None, reason="no C compiler"))
_MODES = [({}, "api"), ({"without_host": True}, "api"), ({}, "aten")]
_MODE_IDS = ["checked", "without_host", "checked-aten-level"]

SCALE = torch.ones(8)
OFFSET = torch.full((8,), 2.0)


def _scale_between_reads(x):
    """Reads OFFSET, writes SCALE, reads OFFSET again: a fused kernel computes both reads from one
    load where the record saw two memories."""
    before = OFFSET * 3 + x
    SCALE.mul_(2)
    return before, OFFSET * 3 + x


def _trace_in_mode(function, mode, backend, monkeypatch):
    options, level = mode
    monkeypatch.setenv("TRACEJIT_REPLAY", level)  # read when the trace is made
    return tracejit.trace(function, backend=backend, **options)


def _eager_or_memory_error(traced, eager, x, backend, pattern):
    """Each call matches eager bitwise, or raises where a fused kernel would compute otherwise."""
    for _ in range(3):
        want = eager(x)
        try:
            got = traced(x)
        except tracejit.TraceMismatchError as error:
            assert backend != "aten", str(error)
            assert re.search(pattern, str(error)), str(error)
            return
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert backend == "aten"


@pytest.mark.parametrize("backend", ["aten", _C])
@pytest.mark.parametrize("mode", _MODES, ids=_MODE_IDS)
@pytest.mark.parametrize("how", ["rebound", "data"])
def test_globals_made_one_memory_after_recording_match_eager_or_raise(how, mode, backend, monkeypatch):
    """`SCALE = base; OFFSET = base[:]` (or the same through `.data`, which keeps the objects) after
    three calls: the fused kernel read OFFSET once for both results (6 where eager has 3). The
    generated steps of the aten level bound such globals without the memory check, and the compiled
    program's guards compared neither objects' memory."""
    global SCALE, OFFSET
    SCALE, OFFSET = torch.ones(8), torch.full((8,), 2.0)
    traced = _trace_in_mode(_scale_between_reads, mode, backend, monkeypatch)
    x = torch.zeros(8)
    for _ in range(3):
        traced(x)
    assert traced.stats.records == 1 and traced.stats.checked_replays + traced.stats.host_free_calls == 2
    base = torch.ones(8)
    if how == "rebound":
        SCALE, OFFSET = base, base[:]
    else:
        SCALE.data, OFFSET.data = base, base[:]
    eager_base = torch.ones(8)

    def eager(x):
        before = eager_base[:] * 3 + x
        eager_base.mul_(2)
        return before, eager_base[:] * 3 + x

    _eager_or_memory_error(traced, eager, x, backend, r"shares memory with t\d+ \((OFFSET|SCALE)\) now")


WEIGHT = torch.full((8,), 2.0)


def _bump_then_scale(x):
    x.add_(1)
    return (x * WEIGHT,)


@pytest.mark.parametrize("backend", ["aten", _C])
@pytest.mark.parametrize("mode", _MODES, ids=_MODE_IDS)
def test_an_input_that_is_a_global_the_function_reads_matches_eager_or_raises(mode, backend, monkeypatch):
    """`f(WEIGHT)` where f writes its input and reads WEIGHT: the fused kernel read WEIGHT before
    the write (6 where eager has 9). Inputs were compared with one another, never with the
    externals."""
    global WEIGHT
    WEIGHT = torch.full((8,), 2.0)
    traced = _trace_in_mode(_bump_then_scale, mode, backend, monkeypatch)
    for _ in range(3):
        traced(torch.zeros(8))
    assert traced.stats.checked_replays + traced.stats.host_free_calls == 2
    eager_weight = WEIGHT.clone()
    want = (eager_weight.add_(1) * eager_weight,)
    try:
        got = traced(WEIGHT)
    except tracejit.TraceMismatchError as error:
        assert re.search(r"t\d+ \((external |)WEIGHT", str(error)), str(error)
        return
    assert torch.equal(got[0], want[0]) and torch.equal(WEIGHT, eager_weight)


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_a_parameter_given_new_memory_of_its_own_keeps_training_like_eager(without_host):
    """`.data = w.clone()` moves a parameter to memory of its own: no sharing, so after one call that
    runs the function (and binds the new memory) the fast path serves again, matching eager."""
    models = [_model_and_sgd() for _ in range(2)]
    traced = tracejit.trace(_accumulating_step, without_host=without_host, backend="aten")
    for index, (x, y) in enumerate(_batches(10)):
        if index == 5:
            for model, _ in models:
                model[0].weight.data = model[0].weight.data.clone()
        want = _accumulating_step(x, y, do_step=True, model=models[0][0], opt=models[0][1])
        got = traced(x, y, do_step=True, model=models[1][0], opt=models[1][1])
        assert torch.equal(got, want)
        assert all(map(torch.equal, models[1][0].parameters(), models[0][0].parameters()))
    fast = traced.stats.host_free_calls if without_host else traced.stats.api_replays
    assert fast >= 6


# -- found by the review of this change (stop note of 2026-11-28) --

FLAT = torch.zeros(16)
HALF = FLAT[0:8]


def _bump_then_scale_half(x):
    x.add_(1)
    return (x * HALF,)


@pytest.mark.parametrize("mode", _MODES[:2], ids=_MODE_IDS[:2])
def test_an_input_moving_onto_an_externals_bytes_in_its_storage_raises(mode, monkeypatch):
    """Inputs beside HALF in its flat buffer bound the program; then the caller passes HALF's own
    bytes. The guard compared which storage an input lies in, not where: 6 where eager has 9."""
    if tracejit.backends.resolve_backend("c") is None:
        pytest.skip("no C compiler")
    global FLAT, HALF
    FLAT = torch.zeros(16)
    HALF = FLAT[0:8]
    HALF.fill_(2.0)
    traced = _trace_in_mode(_bump_then_scale_half, mode, "c", monkeypatch)
    for _ in range(3):
        traced(torch.zeros(8))
    for _ in range(3):
        FLAT[8:16].zero_()
        traced(FLAT[8:16])
    with pytest.raises(tracejit.TraceMismatchError, match=r"shares memory with t\d+ \(x\) now"):
        traced(FLAT[0:8])


@pytest.mark.parametrize("mode", _MODES[:2], ids=_MODE_IDS[:2])
def test_a_read_only_global_moved_onto_a_written_ones_bytes_raises(mode, monkeypatch):
    """`OFFSET.data = S[0:8]` where SCALE is S[0:8] after a binding with the two side by side in S:
    OFFSET is only read (its memory is checked where it lies), and the check compared storages."""
    if tracejit.backends.resolve_backend("c") is None:
        pytest.skip("no C compiler")
    global SCALE, OFFSET
    SCALE, OFFSET = torch.ones(8), torch.full((8,), 2.0)
    traced = _trace_in_mode(_scale_between_reads, mode, "c", monkeypatch)
    x = torch.zeros(8)
    for _ in range(3):
        traced(x)
    shared = torch.ones(16)
    SCALE.data, OFFSET.data = shared[0:8], shared[8:16]
    for _ in range(3):
        traced(x)
    OFFSET.data = shared[0:8]
    with pytest.raises(tracejit.TraceMismatchError, match=r"shares memory with t\d+ \((OFFSET|SCALE)\) now"):
        traced(x)


DOTTED = torch.full((4,), 1.0)
FUSED_READ = torch.full((4,), 2.0)
FILLED = torch.zeros(8)
FILL_AT = torch.arange(4, 8)


def _fill_between_fused_reads(x):
    dotted = DOTTED @ DOTTED
    before = FUSED_READ * 3 + x
    FILLED.index_fill_(0, FILL_AT, 5.0)
    return before, FUSED_READ * 3 + x, dotted


@pytest.mark.parametrize("mode", _MODES, ids=_MODE_IDS)
def test_every_tensor_an_external_overlaps_is_checked_not_only_the_first(mode, monkeypatch):
    """FILLED made to cover DOTTED (read by no fused kernel) and FUSED_READ: the check stopped at
    DOTTED, a harmless pair, and never looked at FUSED_READ (15 where eager has 6)."""
    if tracejit.backends.resolve_backend("c") is None:
        pytest.skip("no C compiler")
    global DOTTED, FUSED_READ, FILLED
    DOTTED, FUSED_READ, FILLED = torch.full((4,), 1.0), torch.full((4,), 2.0), torch.zeros(8)
    traced = _trace_in_mode(_fill_between_fused_reads, mode, "c", monkeypatch)
    x = torch.zeros(4)
    for _ in range(3):
        traced(x)
    flat = torch.zeros(8)
    DOTTED.data, FUSED_READ.data, FILLED.data = flat[0:4], flat[4:8], flat[0:8]
    flat[0:4].fill_(1.0)
    flat[4:8].fill_(2.0)
    with pytest.raises(tracejit.TraceMismatchError, match=r"shares memory with t\d+ \(FUSED_READ\) now"):
        traced(x)


class _Source:
    """Hands out a tensor tracejit cannot find by a path (only its weak reference does)."""

    latest = None

    def get(self):
        return self.latest()


SOURCE = _Source()
WEIGHTS = torch.randn(256)


def _reads_from_the_source(y):
    x = SOURCE.get()
    y.add_(1)  # the program writes memory the caller owns: its memory is guarded
    return (x @ WEIGHTS + y).sum()


def test_a_binding_that_stops_part_way_lets_go_of_the_calls_tensors():
    """A binding that stopped early (a tensor reached for the first time without a path) left the
    call's externals in the runner's memory-guard lists: the batch lived on after the call."""
    traced = tracejit.trace(_reads_from_the_source, without_host=True)
    batch = torch.randn(256, 256)
    SOURCE.latest = weakref.ref(batch)
    traced(torch.ones(256))
    assert traced.stats.records == 1  # the call recorded and the binding ran (and stopped part-way)
    freed = weakref.ref(batch)
    del batch
    gc.collect()
    assert freed() is None
