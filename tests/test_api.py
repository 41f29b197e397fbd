"""The public API: decorator forms, options, introspection."""

import pytest
import torch

import tracejit


def test_decorator_forms(trace):
    @trace
    def a(x):
        return x + 1

    @trace(opt_level=0, max_traces=3)
    def b(x):
        return x + 1

    c = trace(lambda x: x + 1, capture_as_const=True)
    x = torch.randn(2)
    for f in (a, b, c):
        assert torch.equal(f(x), x + 1)
        assert torch.equal(f(x), x + 1)
    assert a.__name__ == "a" and b.options.opt_level == 0 and b.options.max_traces == 3


@pytest.mark.parametrize("options, error, text", [
    ({"opt_level": 4}, ValueError, "opt_level must be an int from 0 to 3"),
    ({"opt_level": "2"}, ValueError, "opt_level must be an int from 0 to 3"),
    ({"max_traces": 0}, ValueError, "max_traces must be a positive int"),
    ({"capture_as_const": 1}, TypeError, "capture_as_const must be a bool"),
    ({"backend": "cuda"}, ValueError, "backend must be one of auto, triton, c, aten"),
    ({"verify_every": 3}, ValueError, "verify_every only applies with without_host=True"),
])
def test_bad_options(options, error, text):
    with pytest.raises(error, match=text):
        tracejit.trace(lambda x: x, **options)


def test_unknown_option_is_rejected():
    with pytest.raises(TypeError):
        tracejit.trace(lambda x: x, not_an_option=True)


def test_trace_of_a_non_callable():
    with pytest.raises(TypeError, match="expected a function to trace, got int"):
        tracejit.trace(3)


def test_listing_names_ops_handles_and_lines(trace):
    w = torch.randn(3)

    @trace
    def f(x):
        return (x * w).relu()

    f(torch.randn(3))
    text = f.listing()
    assert "# record of f: 2 ops" in text
    assert "t0: arg x cpu float32[3]" in text
    assert "t1: external w cpu float32[3]" in text
    assert "#0 t2 = aten.mul.Tensor(t0, t1)" in text
    assert "test_api.py" in text
    assert text.rstrip().endswith("return t3")


def test_errors_are_runtime_errors():
    assert issubclass(tracejit.TraceMismatchError, RuntimeError)
    assert issubclass(tracejit.TraceCacheFullError, RuntimeError)
