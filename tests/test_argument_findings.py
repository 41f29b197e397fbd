"""Arguments of a traced call (hunt I): a failed first call fixes no keyword's kind, nested and
quantized tensor inputs are refused by name before anything runs, and a trace of an object
without a qualified name refuses pickling clearly."""

import functools
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn

import tracejit
from tracejit.errors import TraceMismatchError


@pytest.mark.parametrize("without_host", [False, True])
def test_a_first_call_that_raises_fixes_no_keyword_kind(without_host):
    """The call with mask=None raised in user code, recording nothing; the corrected call with a
    tensor mask raised "keyword argument 'mask' was a non-tensor when traced" on every call."""
    @tracejit.trace(without_host=without_host)
    def f(x, *, mask):
        if mask is None:
            raise ValueError("mask required")
        return x * mask

    x, mask = torch.arange(3.0), torch.tensor([1.0, 0.0, 2.0])
    for _ in range(2):  # twice: a second failure fixes nothing either
        with pytest.raises(ValueError, match="mask required"):
            f(x, mask=None)
    assert f.stats.records == 0
    for _ in range(4):
        assert torch.equal(f(x, mask=mask), x * mask)
    stats = f.stats
    assert stats.records == 1
    replays = stats.host_free_calls if without_host else stats.checked_replays
    assert replays == 3
    # once a call recorded with a tensor mask, its kind is fixed as before
    with pytest.raises(TraceMismatchError, match="keyword argument 'mask' was a tensor when traced"):
        f(x, mask=None)
    assert torch.equal(f(x, mask=mask), x * mask)


def test_a_first_call_that_raises_with_a_tensor_keyword_leaves_it_free():
    @tracejit.trace
    def f(x, *, scale):
        if isinstance(scale, torch.Tensor):
            raise TypeError("scale must be a float")
        return x * scale

    x = torch.ones(2)
    with pytest.raises(TypeError, match="scale must be a float"):
        f(x, scale=torch.tensor(2.0))
    for _ in range(3):
        assert torch.equal(f(x, scale=2.0), x * 2)
    assert f.stats.records == 1 and f.stats.checked_replays == 2


def _nested():
    return torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)])


def _jagged():
    return torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)], layout=torch.jagged)


def _quantized():
    return torch.quantize_per_tensor(torch.ones(3, 4), 0.1, 0, torch.quint8)


UNSUPPORTED = {
    "nested": (_nested, r"a nested tensor \(layout torch\.strided\).*to_padded_tensor"),
    "jagged": (_jagged, r"a nested tensor \(layout torch\.jagged\)"),
    "quantized": (_quantized, r"a quantized tensor \(torch\.quint8\).*dequantize\(\)"),
}


@pytest.mark.parametrize("kind", list(UNSUPPORTED))
@pytest.mark.parametrize("as_keyword", [False, True])
@pytest.mark.parametrize("without_host", [False, True])
def test_a_nested_or_quantized_input_is_refused_by_name_before_anything_runs(kind, as_keyword, without_host):
    """A nested input crashed inside torch ("NestedTensorImpl doesn't support sizes") and a
    quantized one with a QuantizedMeta error while recording."""
    make, what = UNSUPPORTED[kind]
    ran = torch.zeros(())  # how many calls ran: a torch op, which host-free calls run too

    @tracejit.trace(without_host=without_host)
    def f(x, *, other=None):
        ran.add_(1)
        return x * 2 if other is None else x * 2 + other.sum()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype / deprecation warnings
        bad = make()
    where = r"keyword argument 'other'" if as_keyword else r"positional argument 0 \(x\)"
    call = (lambda: f(torch.ones(3, 4), other=bad)) if as_keyword else (lambda: f(bad))
    with pytest.raises(NotImplementedError, match=rf"tracejit: {where} of f\(\) is {what}"):
        call()
    assert ran.item() == 0 and f.stats.records == 0  # nothing ran, nothing is left
    x = torch.randn(3, 4)
    for _ in range(3):  # the next valid calls record and replay; a trace there changes nothing
        assert torch.equal(f(x), x * 2)
    with pytest.raises(NotImplementedError, match=rf"tracejit: {where} of f\(\) is {what}"):
        call()
    assert ran.item() == 3
    assert torch.equal(f(x), x * 2) and f.stats.records == 1


def test_a_nested_input_after_host_free_calls_is_refused_not_aborted():
    """The host-free call's C++ metadata guard read the sizes of a nested input: std::terminate."""
    code = textwrap.dedent("""
        import warnings, torch, tracejit
        warnings.simplefilter("ignore")
        f = tracejit.trace(lambda x: x * 2, without_host=True)
        for _ in range(4):
            f(torch.ones(2, 4))
        try:
            f(torch.nested.nested_tensor([torch.ones(2, 4), torch.ones(3, 4)]))
        except NotImplementedError as error:
            assert "is a nested tensor" in str(error), error
            print("refused")
        assert torch.equal(f(torch.ones(2, 4)), torch.full((2, 4), 2.0))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "refused", done.stderr[-2000:]


def _added(x, y):
    return x + y


@pytest.mark.parametrize("wrapped", ["module", "partial"])
def test_a_trace_without_a_qualified_name_refuses_pickling_clearly(wrapped):
    """AttributeError "'trace' object has no attribute '__qualname__'" from __reduce__."""
    function = nn.Linear(2, 2) if wrapped == "module" else functools.partial(_added, y=torch.ones(2))
    traced = tracejit.trace(function)
    with pytest.raises(pickle.PicklingError, match="pickles by its qualified name, which only a module-level function"):
        pickle.dumps(traced)
    assert pickle.loads(pickle.dumps(_tripled)) is _tripled  # a module-level one still pickles by name


@tracejit.trace
def _tripled(x):
    return x * 3
