"""Vectorizable float32 transcendentals for the generated C kernels.

Calls into scalar libm keep the C compiler from vectorizing a loop (a kernel calling `expf` was
measured 6x slower than eager), and `-ffast-math` would give up NaN, infinity and signed-zero
semantics. These functions are branch-free C (selects, not jumps) that GCC and Clang vectorize
with `-O3 -fno-trapping-math`; special values are handled explicitly.

Method: argument reduction plus polynomials fitted by `tools/fit_math.py` (weighted least squares
on Chebyshev nodes, then rounded to float32). Measured maximum error against the correctly
rounded result over a sweep of float32 values (`tests/test_c_mathlib.py` checks the bounds):
exp 1 ulp, log 2 ulp, tanh 2 ulp, sigmoid 2 ulp, log1p 3 ulp, expm1 2 ulp, erf 2 ulp; results below
the normal range within 2^-126 absolute (sigmoid(-100) is 0, as in eager). log2 and log10 are libm's
double functions rounded once (exact at powers of the base; not vectorized). float64 kernels call
libm (not vectorized).
"""

from __future__ import annotations

_PRELUDE = r"""
/* Horner steps use the fused multiply-add where the CPU has one: fewer instructions, one rounding
   less (the error bounds hold either way). User arithmetic is never contracted. */
#ifdef __FMA__
#define TJ_FMA(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define TJ_FMA(a, b, c) ((a) * (b) + (c))
#endif
static inline float tj_bits_to_float(int32_t i) { float f; memcpy(&f, &i, 4); return f; }
static inline int32_t tj_float_to_bits(float f) { int32_t i; memcpy(&i, &f, 4); return i; }
"""

_FUNCTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    # name: (dependencies, definition)
    "tj_expf": ((), r"""
/* exp(x) = 2^n * exp(r), r = x - n*ln2 in [-ln2/2, ln2/2]; the scale is applied in two halves so
   results down to the smallest subnormal are exact multiplications. No special cases: the clamp
   keeps n in range, overflow and underflow then happen in the final products as they should,
   and NaN flows through every step (the clamp's comparisons are false for it). */
static inline float tj_expf(float x) {
  float xc = x < -104.0f ? -104.0f : x;
  xc = xc > 89.0f ? 89.0f : xc;
  float n = TJ_FMA(xc, 1.44269504088896341f, 12582912.0f) - 12582912.0f;  /* round to nearest */
  float r = TJ_FMA(n, -0.693145751953125f, xc);  /* exact: ln2's high part has 8 trailing zero bits */
  r = TJ_FMA(n, -1.428606765330187045e-06f, r);
  float q = 0.0013814611593261361f;
  q = TJ_FMA(q, r, 0.008368710055947304f);
  q = TJ_FMA(q, r, 0.04166838899254799f);
  q = TJ_FMA(q, r, 0.1666652113199234f);
  q = TJ_FMA(q, r, 0.4999999403953552f);
  float p = 1.0f + TJ_FMA(r * r, q, r);
  int32_t ni = (int32_t)n;
  int32_t half = ni >> 1;  /* both halves stay within a float's exponent range */
  return p * tj_bits_to_float((half + 127) << 23) * tj_bits_to_float((ni - half + 127) << 23);
}
"""),
    "tj_logf": ((), r"""
/* log(x) = e*ln2 + log(m), m in [sqrt(1/2), sqrt(2)); log(m) = 2 atanh(s), s = (m-1)/(m+1). */
static inline float tj_logf(float x) {
  int32_t tiny = x < 1.17549435e-38f;
  float xs = tiny ? x * 8388608.0f : x;
  int32_t bits = tj_float_to_bits(xs);
  int32_t e = ((bits >> 23) & 0xff) - 127 - (tiny ? 23 : 0);
  float m = tj_bits_to_float((bits & 0x007fffff) | 0x3f800000);
  int32_t big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e = big ? e + 1 : e;
  float f = m - 1.0f;
  float s = f / (2.0f + f);
  float z = s * s;
  float p = 0.23581473529338837f;
  p = TJ_FMA(p, z, 0.2853734791278839f);
  p = TJ_FMA(p, z, 0.4000033438205719f);
  p = TJ_FMA(p, z, 0.6666666269302368f);
  float log_m = 2.0f * s + s * z * p;
  float ef = (float)e;
  float y = ef * 0.693145751953125f + (log_m + ef * 1.428606765330187045e-06f);
  y = x == __builtin_inff() ? x : y;
  y = x == 0.0f ? -__builtin_inff() : y;
  y = x < 0.0f ? __builtin_nanf("") : y;
  return x != x ? x : y;
}
"""),
    "tj_log1pf": (("tj_logf",), r"""
/* near 0, the log series on s = x / (2 + x) straight from x (no rounding of 1 + x); log(1 + x) beyond. */
static inline float tj_log1pf(float x) {
  float s = x / (2.0f + x);
  float z = s * s;
  float p = 0.23581473529338837f;
  p = TJ_FMA(p, z, 0.2853734791278839f);
  p = TJ_FMA(p, z, 0.4000033438205719f);
  p = TJ_FMA(p, z, 0.6666666269302368f);
  float near = 2.0f * s + s * z * p;
  float y = (x > -0.29289f && x < 0.41421f) ? near : tj_logf(1.0f + x);
  y = x == 0.0f ? x : y;
  return x != x ? x : y;
}
"""),
    "tj_expm1f": (("tj_expf",), r"""
static inline float tj_expm1f(float x) {
  float q = 2.479082831996493e-05f;
  q = TJ_FMA(q, x, 0.0001997358340304345f);
  q = TJ_FMA(q, x, 0.001388930482789874f);
  q = TJ_FMA(q, x, 0.008333141915500164f);
  q = TJ_FMA(q, x, 0.0416666604578495f);
  q = TJ_FMA(q, x, 0.1666666716337204f);
  q = TJ_FMA(q, x, 0.5f);
  float small = x + x * x * q;
  float a = x < 0.0f ? -x : x;
  float y = a < 0.5f ? small : tj_expf(x) - 1.0f;
  y = x == 0.0f ? x : y;
  return x != x ? x : y;
}
"""),
    "tj_tanhf": (("tj_expf",), r"""
/* odd polynomial near 0 (written x * (1 + z p) so tanh(-0) = -0), 1 - 2/(exp(2|x|) + 1) beyond
   (no cancellation there: tanh >= 0.55), sign copied back; NaN flows through both branches. */
static inline float tj_tanhf(float x) {
  float a = fabsf(x);
  float z = x * x;
  float p = 0.0021429602056741714f;
  p = TJ_FMA(p, z, -0.008177395910024643f);
  p = TJ_FMA(p, z, 0.021700702607631683f);
  p = TJ_FMA(p, z, -0.05394676327705383f);
  p = TJ_FMA(p, z, 0.1333320587873459f);
  p = TJ_FMA(p, z, -0.3333333134651184f);
  float small = x * (1.0f + z * p);
  float e = tj_expf(2.0f * (a > 20.0f ? 20.0f : a));
  float big = copysignf(1.0f - 2.0f / (e + 1.0f), x);
  return a < 0.625f ? small : big;
}
"""),
    "tj_log2f": ((), r"""
/* libm in double, rounded once: exact at powers of two and as close to eager as float32 allows (a
   polynomial within 2 ulp is not exact there). A scalar call: a loop using it does not vectorize. */
static inline float tj_log2f(float x) { return (float)log2((double)x); }
"""),
    "tj_log10f": ((), r"""
/* as tj_log2f: exact at the powers of ten a float holds, rounded once from libm's double */
static inline float tj_log10f(float x) { return (float)log10((double)x); }
"""),
    "tj_sigmoidf": (("tj_expf",), r"""
static inline float tj_sigmoidf(float x) { return 1.0f / (1.0f + tj_expf(-x)); }
"""),
    "tj_erff": (("tj_expf",), r"""
/* odd polynomial for |x| < 1; 1 - exp(-x^2) * erfcx(|x|) beyond, erfcx as a polynomial in 1/|x|;
   erf rounds to +-1 from |x| = 3.92. */
static inline float tj_erff(float x) {
  float a = x < 0.0f ? -x : x;
  float z = x * x;
  float p = 7.853859278839082e-05f;
  p = TJ_FMA(p, z, -0.0008010193123482168f);
  p = TJ_FMA(p, z, 0.005188327748328447f);
  p = TJ_FMA(p, z, -0.026853810995817184f);
  p = TJ_FMA(p, z, 0.1128358542919159f);
  p = TJ_FMA(p, z, -0.3761262595653534f);
  p = TJ_FMA(p, z, 1.1283791065216064f);
  float small = x * p;
  float u = 1.0f / (a < 1.0f ? 1.0f : a);
  float q = -0.035935427993535995f;
  q = TJ_FMA(q, u, 0.2504587769508362f);
  q = TJ_FMA(q, u, -0.7716096043586731f);
  q = TJ_FMA(q, u, 1.3618910312652588f);
  q = TJ_FMA(q, u, -1.4605530500411987f);
  q = TJ_FMA(q, u, 0.8559967875480652f);
  q = TJ_FMA(q, u, -0.04908236116170883f);
  q = TJ_FMA(q, u, -0.29145145416259766f);
  q = TJ_FMA(q, u, 0.0042589809745550156f);
  q = TJ_FMA(q, u, 0.5635767579078674f);
  q = TJ_FMA(q, u, 3.3114993129856884e-05f);
  float big = 1.0f - tj_expf(-z) * q;
  big = a >= 3.92f ? 1.0f : big;
  big = x < 0.0f ? -big : big;
  float y = a < 1.0f ? small : big;
  return x != x ? x : y;
}
"""),
}

FLOAT_FUNCTIONS = {
    # primitive -> (float32 function, float64 libm expression)
    "exp": ("tj_expf", "exp({})"),
    "log": ("tj_logf", "log({})"),
    "log2": ("tj_log2f", "log2({})"),
    "log10": ("tj_log10f", "log10({})"),
    "log1p": ("tj_log1pf", "log1p({})"),
    "expm1": ("tj_expm1f", "expm1({})"),
    "tanh": ("tj_tanhf", "tanh({})"),
    "sigmoid": ("tj_sigmoidf", "(1.0 / (1.0 + exp(-({}))))"),
    "erf": ("tj_erff", "erf({})"),
}


def math_source(names: set[str]) -> str:
    """The definitions of `names` and what they depend on, in dependency order."""
    ordered: list[str] = []

    def add(name: str) -> None:
        for dependency in _FUNCTIONS[name][0]:
            add(dependency)
        if name not in ordered:
            ordered.append(name)

    for name in sorted(names):
        add(name)
    if not ordered:
        return ""
    return _PRELUDE + "".join(_FUNCTIONS[name][1] for name in ordered)
