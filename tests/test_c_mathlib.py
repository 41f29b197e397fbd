"""The C backend's vectorizable float32 math against correctly rounded float64 references.

The bounds asserted here are the ones docs/kernels.md and backends/c/mathlib.py document.
"""

import ctypes

import numpy as np
import pytest
import torch

from tracejit.backends.c.mathlib import FLOAT_FUNCTIONS, math_source
from tracejit.backends.c.toolchain import CompilerUnavailable, build

BOUNDS_ULP = {"exp": 1, "log": 2, "log1p": 3, "expm1": 2, "tanh": 2, "sigmoid": 2, "erf": 2}
REFERENCES = {
    "exp": np.exp, "log": np.log, "log1p": np.log1p, "expm1": np.expm1, "tanh": np.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "erf": lambda x: torch.special.erf(torch.from_numpy(x)).numpy(),
}


@pytest.fixture(scope="module")
def library():
    names = sorted(BOUNDS_ULP)
    functions = "".join(
        f"void sweep_{n}(const float* x, float* y, long n) {{ for (long i = 0; i < n; i++) y[i] = "
        f"{FLOAT_FUNCTIONS[n][0]}(x[i]); }}\n" for n in names)
    source = ("#include <stdint.h>\n#include <string.h>\n#include <math.h>\n"
              + math_source({FLOAT_FUNCTIONS[n][0] for n in names}) + functions)
    try:
        return build(source)
    except CompilerUnavailable:
        pytest.skip("no C compiler")


def _sweep() -> np.ndarray:
    """Every 211th float32 bit pattern (positive and negative, normal and subnormal) plus edge values."""
    bits = np.arange(0, 2**32, 211, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 88.72, 88.73, -103.9, -104.0, 0.625,
                      -0.625, 3.92, -3.92, 0.5, -0.5, 1.0, -1.0], dtype=np.float32)
    return np.concatenate([values, edges])


def _ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    ai = a.view(np.int32).astype(np.int64)
    bi = b.view(np.int32).astype(np.int64)
    ai = np.where(ai < 0, -(2**31) - ai, ai)
    bi = np.where(bi < 0, -(2**31) - bi, bi)
    return np.abs(ai - bi)


@pytest.mark.parametrize("name", sorted(BOUNDS_ULP))
def test_error_bound_and_special_values(library, name):
    x = _sweep()
    y = np.empty_like(x)
    getattr(library, f"sweep_{name}")(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data),
                                      ctypes.c_long(x.size))
    with np.errstate(all="ignore"):
        want = REFERENCES[name](x.astype(np.float64)).astype(np.float32)
    assert np.array_equal(np.isnan(y), np.isnan(want)), "NaN where the reference has none, or the reverse"
    ok = ~np.isnan(want)
    got, ref = y[ok], want[ok]
    assert np.array_equal(np.signbit(got[ref == 0]), np.signbit(ref[ref == 0])), "signed zeros differ"
    distance = _ulp_distance(got, ref)
    # below the normal range (sigmoid(-100), erf near 0) an absolute error of 2^-126 counts as one ulp
    with np.errstate(invalid="ignore"):
        absolute = np.where(got == ref, 0.0, np.abs(got.astype(np.float64) - ref) / np.finfo(np.float32).tiny)
    distance = np.minimum(distance, absolute)
    worst = int(distance.max())
    assert worst <= BOUNDS_ULP[name], f"{name}: {worst} ulp at x={x[ok][distance.argmax()]!r}"
