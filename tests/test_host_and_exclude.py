"""Host reads inside a traced function, and exclude_from_trace."""

import numpy as np
import pytest
import torch

import tracejit

# symbolic=True records the first call without computing it and refuses to read a value it has not
# computed; tests/test_symbolic.py checks that refusal for every kind of read.
REFUSED_READ = pytest.mark.skip_mode("symbolic", reason="reads a computed value on the host during the first call")


@REFUSED_READ
def test_numpy_in_the_middle_sees_the_right_numbers_every_call(trace):
    seen = []

    @trace
    def f(x):
        y = x * 2
        seen.append(y.numpy().copy())
        return y + 1

    for i in range(4):
        x = torch.full((3,), float(i))
        out = f(x)
        np.testing.assert_array_equal(seen[-1], np.full(3, 2.0 * i, dtype=np.float32))
        assert torch.equal(out, x * 2 + 1)
    record = f.records[0]
    assert [r.what for r in record.host_reads] == ["numpy()"]
    assert len(record.ops) == 2  # the read itself is not an op of the program


READS = {
    "item": lambda y: y.item(),
    "tolist": lambda y: y.tolist(),
    "bool": lambda y: bool(y > 10),
    "float": lambda y: float(y),
    "int": lambda y: int(y),
    "index": lambda y: list(range(100, 130))[y.long()],
    "repr": lambda y: repr(y),
    "format": lambda y: f"{y:.3f}",
    "numpy": lambda y: y.numpy().copy(),
    "asarray": lambda y: float(np.asarray(y)),
}


@REFUSED_READ
@pytest.mark.parametrize("read", list(READS))
def test_host_reads_of_every_kind_see_the_values_of_each_call(trace, read):
    seen = []

    @trace
    def f(x):
        y = x.sum()
        seen.append(READS[read](y))  # in the middle of the function: y must be real, and this call's
        return y * 2

    expected = []
    for i in range(4):
        x = torch.arange(4.0) + i  # sums 6, 10, 14, 18: every read differs between calls (bool flips)
        expected.append(READS[read](x.sum()))
        assert torch.equal(f(x), x.sum() * 2)
    assert len(seen) == 4
    for got, want in zip(seen, expected):
        assert (got == want).all() if isinstance(want, np.ndarray) else got == want
    assert len(set(map(str, seen))) == (2 if read == "bool" else 4)
    record = f.records[0]
    assert len(f.records) == 1 and record.host_reads  # repr() and asarray() read through item()/numpy() too
    assert {r.position for r in record.host_reads} == {len(record.ops) - 1}  # before the last op, y * 2


def _write_into_an_intermediate(x):
    y = x * 2
    y.numpy()[0] = 100.0  # numpy() shares the tensor's memory: a later op reads the write
    return y + 1


def _write_into_the_input(x):
    y = x * 2  # eager reads x before the write below
    x.numpy()[0] = -1.0
    return y + x


def _read_a_copy(x):
    y = x * 2
    y.clone().numpy()[0] = 100.0  # a copy of its own, which no op reads
    return y + 1


def _run_as_eager(function, calls=5, **options):
    """Call `function` traced and eagerly on the same inputs; both results and inputs agree."""
    traced = tracejit.trace(function, backend="aten", **options)
    for i in range(calls):
        x = torch.arange(6.0) + i
        twin = x.clone()
        assert torch.equal(traced(x), function(twin)) and torch.equal(x, twin), f"call {i}"
    return traced


@pytest.mark.parametrize("function", [_write_into_an_intermediate, _write_into_the_input])
def test_a_write_through_numpy_keeps_checked_calls_at_the_aten_level(function):
    """At the API level the array of `y.numpy()` was over the value its read computed alone (and an
    input's over its memory while the function ran, before the program): the write was lost from the
    third call on, or reached ops that eager ran before it. A numpy() of memory the program reads,
    returns or keeps after the function ran keeps checked calls at the aten level, saying why once."""
    with pytest.warns(tracejit.ReplayLevelWarning, match=r"the host takes numpy\(\) of t\d+ at test_host_and_exclude.py:\d+ "
                                                         r".*a write through the array would not reach the program"):
        traced = _run_as_eager(function)
    assert traced.stats.checked_replays == 4 and traced.stats.api_replays == 0
    with pytest.raises(tracejit.HostDependencyError, match=r"numpy\(\) of t\d+ at test_host_and_exclude.py"):
        _run_as_eager(function, without_host=True)  # the read itself: values read would be frozen


def test_a_write_through_numpy_of_a_copy_keeps_the_api_level():
    traced = _run_as_eager(_read_a_copy)
    assert traced.stats.api_replays == 3 and traced.stats.api_fallbacks == 0


@REFUSED_READ
def test_data_dependent_python_branch_is_caught(trace):
    @trace
    def f(x):
        s = x.sum()
        return x * 2 if s.item() > 0 else x - 2

    f(torch.ones(3))
    with pytest.raises(tracejit.TraceMismatchError, match="aten.sub.Tensor instead of aten.mul.Tensor"):
        f(-torch.ones(3))


@REFUSED_READ
def test_print_every_n_calls_is_not_a_mismatch(trace, capsys):
    @trace
    def f(x, *, step):
        loss = (x * x).sum()
        if step % 2 == 0:
            print(f"loss {loss.item():.2f}")
        return loss

    for step in range(5):
        x = torch.full((2,), float(step))
        assert f(x, step=step).item() == 2 * step * step
    assert capsys.readouterr().out.split("\n")[:3] == ["loss 0.00", "loss 8.00", "loss 32.00"]


def test_exclude_from_trace_seed_example(trace):
    # The MegEngine guide's example: outputs 3, 2, 3 for i = 0, 1, 2.
    i = 0

    @trace
    def f(x):
        x += 1
        with tracejit.exclude_from_trace():
            if i % 2 == 0:
                x += 1
        return x

    outputs = []
    for i in range(3):  # noqa: B007 - f reads the global i
        x = torch.tensor([1])
        outputs.append(f(x).item())
    assert outputs == [3, 2, 3]
    assert len(f.records[0].ops) == 1
    assert len(f.records[0].excluded_blocks) == 1


def test_exclude_block_reads_traced_values_and_feeds_new_tensors_back(trace):
    log = []

    @trace
    def f(x):
        y = x.exp()
        with tracejit.exclude_from_trace():
            assert not tracejit.is_tracing()
            log.append(y.sum().item())
            bias = torch.full_like(y, len(log))  # created outside the trace
        return y + bias

    for i in range(3):
        x = torch.full((2,), float(i))
        out = f(x)
        assert torch.equal(out, x.exp() + (i + 1))
        assert log[-1] == pytest.approx(2 * np.exp(i))


def test_exclude_from_trace_outside_a_trace_is_a_no_op():
    with tracejit.exclude_from_trace():
        assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))


def test_exclude_from_trace_refused_under_capture_as_const(trace):
    @trace(capture_as_const=True)
    def f(x):
        with tracejit.exclude_from_trace():
            pass
        return x * 2

    with pytest.raises(RuntimeError, match="exclude_from_trace\\(\\) inside f\\(\\), which is traced with capture_as_const=True"):
        f(torch.randn(2))


def test_is_tracing(trace):
    states = []

    @trace
    def f(x):
        states.append(tracejit.is_tracing())
        return x + 1

    assert not tracejit.is_tracing()
    f(torch.randn(2))
    f(torch.randn(2))
    assert states == [True, True]
    assert not tracejit.is_tracing()
