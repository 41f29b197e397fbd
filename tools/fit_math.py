"""Fit the polynomial coefficients of src/tracejit/backends/c/mathlib.py.

    python tools/fit_math.py        (needs numpy and scipy; not a dependency of tracejit)

Each function is approximated on its reduced interval by weighted least squares on Chebyshev
nodes, reweighted (Lawson's iteration) towards equal relative error, and the coefficients are
printed rounded to float32, in the order mathlib.py evaluates them (Horner, highest degree first).
The C code is then checked against float64 references by tests/test_c_mathlib.py.
"""

import numpy as np
from scipy import special


def fit(f, lo, hi, degree, weight, nodes=6000, iterations=80):
    t = np.cos(np.pi * (np.arange(nodes) + 0.5) / nodes)
    x = (lo + hi) / 2 + (hi - lo) / 2 * t
    basis = np.stack([x ** k for k in range(degree + 1)], 1)
    y, w, lawson = f(x), weight(x), np.ones(nodes)
    for _ in range(iterations):
        scale = w * np.sqrt(lawson)
        coefficients, *_ = np.linalg.lstsq(basis * scale[:, None], y * scale, rcond=None)
        error = np.abs((basis @ coefficients - y) * w)
        lawson = lawson * error / (lawson * error).sum()
    return coefficients, error.max()


def main():
    half_ln2 = np.log(2) / 2
    s_max = (np.sqrt(2) - 1) / (np.sqrt(2) + 1)
    fits = {
        # exp(r) = 1 + r + r^2 q(r) on [-ln2/2, ln2/2]
        "exp q(r)": fit(lambda r: (np.expm1(r) - r) / r**2, -half_ln2, half_ln2, 4, lambda r: r**2 / np.exp(r)),
        # log(1+f) = 2 atanh(s) = 2s + s z p(z), z = s^2, |s| <= (sqrt2-1)/(sqrt2+1)
        "log p(z)": fit(lambda z: (2 * np.arctanh(np.sqrt(z)) - 2 * np.sqrt(z)) / (np.sqrt(z) * z), 1e-12, s_max**2,
                        3, lambda z: np.sqrt(z) * z / (2 * np.arctanh(np.sqrt(z)))),
        # tanh(x) = x + x z p(z), z = x^2, |x| < 0.625
        "tanh p(z)": fit(lambda z: (np.tanh(np.sqrt(z)) - np.sqrt(z)) / (np.sqrt(z) * z), 1e-12, 0.625**2, 5,
                         lambda z: np.sqrt(z) * z / np.tanh(np.sqrt(z))),
        # expm1(x) = x + x^2 q(x), |x| < 0.5
        "expm1 q(x)": fit(lambda x: (np.expm1(x) - x) / x**2, -0.5, 0.5, 6, lambda x: x**2 / np.abs(np.expm1(x))),
        # erf(x) = x p(x^2), |x| < 1
        "erf p(z)": fit(lambda z: special.erf(np.sqrt(z)) / np.sqrt(z), 1e-12, 1.0, 6,
                        lambda z: np.sqrt(z) / special.erf(np.sqrt(z))),
        # erfc(x) exp(x^2) = q(1/x), 1 <= x < 3.93
        "erfcx q(u)": fit(lambda u: special.erfcx(1 / u), 1 / 3.93, 1.0, 10, lambda u: 1 / special.erfcx(1 / u)),
    }
    for name, (coefficients, error) in fits.items():
        rounded = [repr(float(np.float32(c))) for c in reversed(coefficients)]
        print(f"{name}: max weighted error {error:.2e}\n  {', '.join(rounded)}")


if __name__ == "__main__":
    main()
