"""Type rules of fused kernels where they once differed from eager silently (issue 11): integer
true division, conversions of out-of-range and special floats to integers, `round(decimals=)`,
and which signed zero `maximum`/`minimum` pick. Each runs through the generated C kernel and the
Triton kernel (in Triton's interpreter), over several calls, against eager on this machine; the
Triton kernels are also built for sm_80 and sm_90."""

from __future__ import annotations

import pytest
import torch
import triton_support as ts
from fused_support import fused_nodes

import tracejit

SPECIAL = [-2.7, 300.0, float("nan"), float("inf"), -float("inf"), 3e9, -3e9, 70000.5, -129.5, 0.4, -0.0, 2.5e19]


def division_of_an_image(img):
    return (img.to(torch.int16) - 128) / 128


def integer_division_by_zero(x, y):
    return (x + 1) / (y * 2)


def round_trip(dtype):
    def f(x):
        return (x * 1.0).to(dtype).to(torch.float32) + 0.5
    return f


def round_trip_in_where(x):
    return torch.where(x > 0, (x * 2.0).to(torch.uint8), (x - 1.0).to(torch.uint8)).to(torch.float32) * 1.0


def round_trip_as_a_branch_of_where(x):
    # the cast to an integer type and back is one branch: it wraps (300 -> 44) as eager's does
    return torch.where(x > -1.0, (x * 1.0).to(torch.uint8).to(torch.float32), x * 2.0)


def rounded(x):
    return torch.round(x * 1.0, decimals=1) + torch.round(x * 1.0, decimals=-1)


def extremes(a, b):
    return torch.maximum(a * 1.0, b * 1.0), torch.minimum(a * 1.0, b * 1.0)


def clamped_by_numbers(x):
    return (x * 1.0).clamp(min=0.0), (x * 1.0).clamp(-0.0, 0.0), torch.clamp_max(x * 1.0, -0.0), (x * 1.0).clamp(max=float("nan"))


def bool_numbers(x):
    return (x * 1.0).clamp(min=False, max=True) + True, (x * 2).clamp(max=True)


def half_with_other_types(x, y, s):
    # eager rounds an int32 or float32 operand to the half type first, except mul's and div's
    # one-element second operand (a number, a 0-d tensor), which it takes at full precision
    return ((x + y) < y, x * s, x / s, x / y, s / x, x + 0.1000061, (x * 1) < 0.1000061, x * 0.1000061,
            torch.where(x > 0, x, y))


def half_inputs(dtype):
    def make():
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(96, generator=g) * 4).to(dtype)
        x[:4] = torch.tensor([0.1, 0.0999755859375, 0.10009765625, 3.0])
        y = (torch.randn(96, generator=g) * 40000).to(torch.int32)
        return x, y, torch.tensor(0.1000061)
    return make


def logic_with_a_broadcast_number(x, y):
    return torch.logical_and(x * 1, y), torch.logical_xor(x * 1, y)  # y: one element, a scalar load


def truncated_through_integers(x, y):
    # (float)(int)x is 0.0 for x in (-1, 0); GCC, allowed to assume no FP traps, turns it into
    # truncf(x), which gives -0.0
    return (x * 1.0).to(torch.int32).to(torch.float32) * 2.0, (y * 1.0).to(torch.int64).to(torch.float64) * 2.0


CASES = {
    "int_true_division": (division_of_an_image, lambda: (torch.tensor([0, 64, 128, 200, 255] * 13, dtype=torch.uint8),)),
    "int_division_by_zero": (integer_division_by_zero,
                             lambda: (torch.tensor([1, 2, -3, 0] * 16, dtype=torch.int32),
                                      torch.tensor([0, 1, 0, 0] * 16, dtype=torch.int32))),
    **{f"to_{str(d).split('.')[1]}": (round_trip(d), lambda: (torch.tensor(SPECIAL * 6),))
       for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)},
    "to_uint8_in_where": (round_trip_in_where, lambda: (torch.tensor(SPECIAL * 6),)),
    "to_uint8_as_where_branch": (round_trip_as_a_branch_of_where, lambda: (torch.tensor(SPECIAL * 6),)),
    "round_decimals": (rounded, lambda: (torch.tensor([1.26, 2.34, -0.05, 15.0, 25.0, -35.5, 1234.5678] * 9),)),
    # 64 elements: eager's vectorized loops (its scalar tail picks the other zero)
    # number bounds keep x when equal, in every loop of eager (tensor bounds act as maximum/minimum)
    "clamp_number_bounds": (clamped_by_numbers, lambda: (torch.tensor([0.0, -0.0, 1.0, -1.0, float("nan")] * 13),)),
    "bool_numbers": (bool_numbers, lambda: (torch.tensor([0.0, -0.5, 0.25, 3.0, float("nan")] * 13),)),
    "float16_operands": (half_with_other_types, half_inputs(torch.float16)),
    "bfloat16_operands": (half_with_other_types, half_inputs(torch.bfloat16)),
    "logic_with_one_element": (logic_with_a_broadcast_number,
                               lambda: (torch.tensor([0.0, 1.0, -0.0, float("nan")] * 16), torch.tensor([2.0]))),
    "integer_round_trip_zero_sign": (truncated_through_integers,
                                     lambda: (torch.tensor([-0.5, -0.0, 0.5, -1.5, -0.999] * 13),
                                              torch.tensor([-0.5, -0.0, 0.5, -1.5, -0.999] * 13, dtype=torch.float64))),
    "signed_zeros": (extremes, lambda: (torch.tensor([0.0, -0.0, -0.0, 0.0, 1.0, float("nan")] * 16)[:64],
                                        torch.tensor([-0.0, 0.0, -0.0, 0.0, float("nan"), 1.0] * 16)[:64])),
}


def _same(got, want) -> bool:
    """Equal values, NaN in the same places, zeros of the same sign."""
    if isinstance(got, tuple):
        return all(_same(g, w) for g, w in zip(got, want))
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if not got.dtype.is_floating_point:
        return torch.equal(got, want)
    nan = got.isnan()
    return (torch.equal(nan, want.isnan()) and torch.equal(got[~nan], want[~nan])
            and torch.equal(got[~nan].signbit(), want[~nan].signbit()))


@pytest.mark.parametrize("backend", ["c", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_kernel_matches_eager_exactly(case, backend):
    function, make_inputs = CASES[case]
    if backend == "c" and "float16" in case:
        pytest.skip("half types run unfused on the CPU: nothing fused to compare")
    with ts.interpreter() if backend == "triton" else _nothing():
        traced = tracejit.trace(function, backend=backend)
        for _ in range(3):
            inputs = make_inputs()
            assert _same(traced(*inputs), function(*inputs)), case
        assert fused_nodes(traced), "the chain did not run as a fused kernel"
        if backend == "triton":
            kernels = [k for _, k in ts.fused_kernels(traced) if hasattr(k, "kernel")]
            assert kernels, "no Triton kernel ran"
            for kernel in kernels:
                for arch in ts.ARCHITECTURES:
                    ts.aot_compile(kernel.kernel, arch)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
