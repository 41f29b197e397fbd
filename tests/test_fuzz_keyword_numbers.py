"""Fuzzer: a Python number passed as a keyword changes value, type or sign between calls and sets
the dtype and bits of the result (`x_int32 * 2.0` is float32 where `* 2` stays int32, `x / -0.0`
is -inf where `/ 0.0` is inf; 2**63 wrapped to -2**63 in a kernel's int64 argument). Checked replay and without_host, aten and C kernels: every result
equals eager's dtype and bits, or the call raises TraceMismatchError (a number of another type
than recorded, the documented answer of checked replay). Found by an adversarial hunt: the guard
of calls without the host compared `!=`, for which 2 == 2.0 == True and 0.0 == -0.0.

CI runs a fixed sample (derandomize); TRACEJIT_FUZZ_EXAMPLES=n runs n programs."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracejit

EXAMPLES = int(os.environ.get("TRACEJIT_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES, derandomize="TRACEJIT_FUZZ_EXAMPLES" not in os.environ, deadline=None,
                database=None, suppress_health_check=list(HealthCheck))

NUMBERS = [2, 2.0, True, False, 1, 0.0, -0.0, 1.5, -3, math.inf, -math.inf, math.nan,
           # ints at and beyond int64's ends (kernels take int scalars as int64), a float beyond float32's
           2 ** 62, -2 ** 63, 2 ** 63, 2 ** 64 - 1, -2 ** 63 - 1, 1e39]
EXPRESSIONS = {
    "mul": lambda x, k: x * k + 1,
    "add": lambda x, k: (x + k) * 2,
    "div": lambda x, k: x / k,
    "compare": lambda x, k: torch.where(x > k, x, x * 0),
    "clamp": lambda x, k: (x * 1).clamp(max=k),
    "masked_fill": lambda x, k: (x * 1).masked_fill(x > 0, k) + 1,
}
INPUTS = {
    "int32": torch.tensor([1, -2, 3, 0], dtype=torch.int32),
    "float32": torch.tensor([1.5, -2.0, 0.0, 3.25]),
    "bool": torch.tensor([True, False, True, True]),
    "int64": torch.tensor([1, -2, 3, 0]),
}


def _outcome(function, x, k):
    try:
        return function(x.clone(), k=k)
    except tracejit.TraceMismatchError:
        raise
    except (RuntimeError, ZeroDivisionError, OverflowError) as error:
        return type(error)


def _same(got, want) -> bool:
    if isinstance(want, type) or isinstance(got, type):
        return got is want
    return got.dtype == want.dtype and got.shape == want.shape and (
        torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if got.dtype.is_floating_point
        else torch.equal(got, want))


@pytest.mark.parametrize("backend", ["aten", "c"])
@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
@FUZZ
@given(expression=st.sampled_from(list(EXPRESSIONS)), dtype=st.sampled_from(list(INPUTS)),
       numbers=st.lists(st.sampled_from(NUMBERS), min_size=6, max_size=10))
def test_a_keyword_number_sets_the_results_dtype_and_bits_as_in_eager(backend, without_host, expression, dtype,
                                                                       numbers):
    def f(x, *, k):
        return EXPRESSIONS[expression](x, k)

    traced = tracejit.trace(f, backend=backend, without_host=without_host)
    x = INPUTS[dtype]
    for call, k in enumerate([numbers[0], *numbers]):  # the first number twice: a replay at least
        want = _outcome(f, x, k)
        try:
            got = _outcome(traced, x, k)
        except tracejit.TraceMismatchError:
            continue  # another type of number than recorded, as checked replay answers it
        assert _same(got, want), (call, k, got, want)
    assert traced.stats.records < traced.stats.calls, traced.stats  # the trace served calls
