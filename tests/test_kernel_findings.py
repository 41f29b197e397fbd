"""Silent wrong results an adversarial tester found in the fused kernels, each traced with the C
backend over several calls and compared with eager exactly:
- a `_foreach_` chain over lanes of different dtypes (one kernel typed by lane 0) or layouts;
- `fill_` of an integer tensor with a float, which went through float32;
- `log2`/`log10`, computed as log(x) / ln b, one ulp short of the integer at powers of the base;
- `gelu(+inf)` in float32 and bfloat16, which eager's CPU kernel makes NaN;
- a dynamic scalar out of range for the tensor's type, which eager refuses and the kernel wrapped;
- a write the caller sees, held back in a group past a gather that raised;
- a tensor made from Python data (`torch.tensor(v)`) with another dtype or shape than recorded,
  read by kernels built for the recorded one (also with Triton and without the host);
- a tensor with PyTorch's negation bit (`z.conj().imag`), an input, an external or made inside,
  whose memory a kernel read without negating it;
- an in-place write by a kernel (or by a `_foreach_` op under the dispatch mode) that left the
  tensor's version counter where it was: autograd and capture_as_const missed the write;
- `hardtanh`/`relu6` at a bound equal to the input, where the kernel took the bound's sign of zero;
- `round(decimals=309)`, whose scale overflowed a Python float while the trace compiled;
- a Python int from 2**63 on, bound as an int64 that wrapped to a negative number.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import triton_support as ts
from fused_support import fused_nodes
from triton_cases import CASES as TRITON_CASES

import tracejit
from tracejit.backends import resolve_backend
from tracejit.errors import TraceMismatchError

pytestmark = pytest.mark.skipif(resolve_backend("c") is None, reason="no C compiler for the C backend")

F = torch.nn.functional


def trace_c(function):
    return tracejit.trace(function, backend="c")


def kernels_fired(traced) -> int:
    """How many fused kernels the checked calls ran (a group left to the reference kernel counts
    too, so callers also look at `kernel_sources`)."""
    return sum(entry.program.groups_fired for entry in traced._entries())


def same(got, want) -> bool:
    """Equal values and dtypes, NaN in the same places."""
    if isinstance(want, (tuple, list)):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if not got.dtype.is_floating_point:
        return torch.equal(got, want)
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got[~nan], want[~nan])


def assert_matches_eager(function, make_inputs, calls: int = 3):
    """Trace `function`, call it `calls` times with fresh inputs (cloned for eager: the functions
    write in place), each result equal to eager's; returns the traced function."""
    traced = trace_c(function)
    for call in range(calls):
        inputs = make_inputs(call)
        want = function(*[t.clone() for t in inputs])
        got = traced(*[t.clone() for t in inputs])
        assert same(got, want), f"call {call}: traced {got} vs eager {want}"
    return traced


# -- 1. _foreach_ lanes of different dtypes ----------------------------------------------------------

def scale_and_shift_in_place(a, b):
    torch._foreach_mul_([a, b], 2)
    torch._foreach_add_([a, b], 1)
    return a, b


def two_lanes(first: torch.dtype, second: torch.dtype):
    return lambda call: (torch.arange(40, dtype=first) + call, (torch.arange(40) + 10 * call).to(second))


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64), (torch.float32, torch.int32),
                                    (torch.float64, torch.float32)], ids=str)
def test_foreach_lanes_of_different_dtypes_are_not_one_kernel(dtypes):
    # lane 0's type used to type every lane's pointer: garbage, or a heap overrun (float64 first)
    traced = assert_matches_eager(scale_and_shift_in_place, two_lanes(*dtypes))
    assert not traced.kernel_sources(), "a kernel addresses lanes of different dtypes"


def test_foreach_lanes_of_one_dtype_still_run_one_kernel():
    traced = assert_matches_eager(scale_and_shift_in_place, two_lanes(torch.float32, torch.float32))
    assert len(traced.kernel_sources()) == 1 and kernels_fired(traced)


# -- 2. _foreach_ lanes of different layouts -----------------------------------------------------------

def multiply_then_shift(a, b, c):
    torch._foreach_mul_([a, b], [c, c])
    torch._foreach_add_([a, b], 1.0)
    return a, b


def test_foreach_lanes_of_different_layouts_fall_back_to_aten():
    # a transposed lane is not a flat walk: building the kernel raised ValueError on every call
    def inputs(call):
        g = torch.Generator().manual_seed(call)
        return torch.randn(4, 3, generator=g).t(), torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)

    traced = assert_matches_eager(multiply_then_shift, inputs)
    assert not traced.kernel_sources()


# -- 3. fill_ of integer tensors with a float ----------------------------------------------------------

def filled_int32(x):
    y = x * 1  # something to fuse with
    y.fill_(16777217.0)  # exact in int32, rounds to 16777216 in float32
    return y


def filled_int64(x):
    y = x + 0
    y.fill_(1e18)  # exact in int64 and in double, not in float32
    return y


@pytest.mark.parametrize("function,dtype", [(filled_int32, torch.int32), (filled_int64, torch.int64)],
                         ids=["int32", "int64"])
def test_fill_of_an_integer_tensor_keeps_the_value_exact(function, dtype):
    traced = assert_matches_eager(function, lambda call: (torch.randint(-5, 5, (64,), dtype=dtype),))
    assert kernels_fired(traced) and fused_nodes(traced)


# -- 4. log2 and log10 at powers of their base -----------------------------------------------------------

def bit_length(x):
    return torch.floor(torch.log2(x * 1.0))


def digit_count(x):
    return torch.floor(torch.log10(x * 1.0)).to(torch.int64) + 1


def powers(base: float, exponents: range, dtype: torch.dtype):
    values = [base ** k for k in exponents]
    return lambda call: (torch.tensor(values[call:] + values[:call], dtype=dtype),)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_log2_is_exact_at_powers_of_two(dtype):
    exponents = range(-126, 128) if dtype == torch.float32 else range(-1022, 1024)
    traced = assert_matches_eager(bit_length, powers(2.0, exponents, dtype))
    assert torch.equal(traced(torch.tensor([8.0, 4096.0], dtype=dtype)), torch.tensor([3.0, 12.0], dtype=dtype))
    assert kernels_fired(traced)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_log10_is_exact_at_powers_of_ten(dtype):
    exponents = range(0, 11) if dtype == torch.float32 else range(-300, 300)  # float32 holds 10^0..10^10
    traced = assert_matches_eager(digit_count, powers(10.0, exponents, dtype))
    assert torch.equal(traced(torch.tensor([10.0, 1000.0], dtype=dtype)), torch.tensor([2, 4]))
    assert kernels_fired(traced)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_triton_log2_and_log10_are_exact_at_powers(dtype):
    function, inputs, _, _ = TRITON_CASES[f"log_powers-{dtype}"]()
    with ts.interpreter():
        traced = tracejit.trace(function, backend="triton")
        for _ in range(3):
            assert same(traced(*inputs), function(*inputs))
        assert ts.triton_launchers(traced), "no Triton kernel ran"


# -- 5. gelu at the top of float32 ------------------------------------------------------------------------

def gelu_of(x):
    return F.gelu(x * 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_gelu_at_infinity_and_overflow_matches_eager(dtype):
    # eager's float32 CPU kernel: gelu(+inf) is NaN and x above FLT_MAX / 2 overflows; float64 neither
    edges = [math.inf, -math.inf, 1.7e38, 1.71e38, 3e38, 10.0, -10.0, 0.0]  # erf is exactly +-1 or 0 here
    traced = assert_matches_eager(gelu_of, lambda call: (torch.tensor(edges[call:] + edges[:call], dtype=dtype),))
    assert kernels_fired(traced)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_gelu_of_half_types_at_infinity_matches_eager(dtype):
    """eager's bfloat16 CPU gelu runs its float32 code (NaN at +inf, inf at 3e38), float16 does not;
    the Triton kernel took bfloat16 for float16 (inf at +inf, 3.004e38 at 3e38)."""
    edges = [math.inf, -math.inf, 3e38, 1.7e38, 10.0, -10.0, 1.0, 0.0]
    with ts.interpreter():
        traced = tracejit.trace(lambda x: F.gelu(x * 1) * 1, backend="triton", opt_level=3)
        for call in range(3):
            x = torch.tensor((edges[call:] + edges[:call]) * 4, dtype=dtype)
            assert same(traced(x.clone()), F.gelu(x * 1) * 1), call
        assert ts.triton_launchers(traced), "no Triton kernel ran"


# -- 6. dynamic scalars out of range for the tensor's type -----------------------------------------------------

def clamped(x, *, k):
    return (x * 1).clamp(max=k)


def masked(x, *, k):
    return (x * 1).masked_fill(x > 0, k)


def selected(x, *, k):
    return torch.where(x > 5, x * 1, k)


RANGE_CASES = {
    "clamp-int8": (clamped, torch.tensor([1, 100, -100, 120], dtype=torch.int8), 100, 200),
    "masked_fill-int8": (masked, torch.tensor([1, 100, -100, 120], dtype=torch.int8), 100, 200),
    "clamp-float32": (clamped, torch.tensor([1.0, 3e38, -5.0, 0.5]), 1e30, 1e40),
    "masked_fill-float32": (masked, torch.tensor([1.0, 3e38, -5.0, 0.5]), 1e30, 1e40),
}


def eager_outcome(function, x, k):
    try:
        return function(x.clone(), k=k)
    except RuntimeError as error:
        return str(error)


@pytest.mark.parametrize("case", list(RANGE_CASES))
def test_an_out_of_range_scalar_raises_as_eager_does(case):
    function, x, fits, overflows = RANGE_CASES[case]
    traced = trace_c(function)
    for _ in range(3):
        assert same(traced(x.clone(), k=fits), function(x.clone(), k=fits))
    assert kernels_fired(traced)
    expected = eager_outcome(function, x, overflows)
    assert isinstance(expected, str) and "without overflow" in expected
    with pytest.raises(RuntimeError, match="without overflow"):
        traced(x.clone(), k=overflows)
    assert same(traced(x.clone(), k=fits), function(x.clone(), k=fits))
    assert fused_nodes(traced), "an in-range value no longer runs the kernel"


def test_an_out_of_range_scalar_eager_wraps_still_wraps():
    # eager's where() wraps -1 to 255 in uint8 (and refuses 300): the out-of-range value runs
    # through aten, which does exactly what eager does
    x = torch.tensor([1, 10, 200, 3], dtype=torch.uint8)
    traced = trace_c(selected)
    for k in (7, 7, 7, -1):
        assert same(traced(x.clone(), k=k), selected(x.clone(), k=k)), k
    assert traced(x.clone(), k=-1).tolist() == [255, 10, 200, 255]
    with pytest.raises(RuntimeError, match="without overflow"):
        traced(x.clone(), k=300)
    assert kernels_fired(traced) and fused_nodes(traced)


@pytest.mark.parametrize("function", [clamped, masked], ids=["clamp", "masked_fill"])
def test_triton_half_precision_scalar_beyond_float16_raises_as_eager_does(function):
    # the kernel computes float16 in float32, where 1e5 fits; eager converts it to float16 and raises
    x = torch.randn(256).to(torch.float16)
    with ts.interpreter():
        traced = tracejit.trace(function, backend="triton")
        for _ in range(3):
            assert same(traced(x.clone(), k=4.0), function(x.clone(), k=4.0))
        assert ts.triton_launchers(traced), "no Triton kernel ran"
        assert "without overflow" in eager_outcome(function, x, 1e5)
        with pytest.raises(RuntimeError, match="without overflow"):
            traced(x.clone(), k=1e5)
        assert same(traced(x.clone(), k=4.0), function(x.clone(), k=4.0))


# -- 7. a write the caller sees, before an op that raises ------------------------------------------------

_counter = torch.zeros(())


def _count_around_a_gather(x, idx):
    _counter.add_(1)  # a write the caller sees, before an op that checks its indices
    y = torch.gather(x, 0, idx)
    _counter.add_(1)
    return y * _counter


def _count_around_an_integer_division(x, idx):
    _counter.add_(1)
    y = torch.div(x.long()[:2], idx, rounding_mode="floor")  # a zero divisor raises
    _counter.add_(1)
    return y * _counter


@pytest.mark.parametrize("function", [_count_around_a_gather, _count_around_an_integer_division])
@pytest.mark.parametrize("without_host", [False, True])
def test_a_write_before_an_op_that_raises_happens_as_in_eager(without_host, function):
    """The two `add_`s of a global counter were one fused kernel run after the gather between
    them: when the gather raised (an index out of range), the first write was lost and the
    counter stayed one behind eager's on every later call. A group does not hold a write the
    caller sees back past an op that checks values now."""
    gathers = function is _count_around_a_gather

    def run(function):
        _counter.zero_()
        log = []
        for i in range(5):
            idx = torch.tensor([0, 7 if i == 2 else 1]) if gathers else torch.tensor([1, 0 if i == 2 else 2])
            try:
                function(torch.arange(4.0), idx)
                log.append(_counter.item())
            except RuntimeError:
                log.append(("raised", _counter.item()))
        return log

    traced = tracejit.trace(function, backend="c", without_host=without_host)
    assert run(traced) == run(function) == [2.0, 4.0, ("raised", 5.0), 7.0, 9.0]
    assert traced.stats.host_free_calls if without_host else traced.stats.checked_replays


# -- 8. a tensor made from Python data with another dtype or shape ------------------------------------------

_data = {"v": 2}  # a global the function reads: without the host, a change runs the function


def times_a_number_tensor(x):
    return x * torch.tensor(_data["v"]) + 1


def plus_a_list_tensor(x):
    return x * 2 + torch.tensor(_data["v"])


# function -> (its input, data of the recorded dtype and shape (values change), data of another dtype or shape)
LITERAL_CASES = {
    "number": (times_a_number_tensor, torch.tensor([1, 2, 3], dtype=torch.int32), [2, 2, 2, 3, 2, 2], [2.5, True]),
    "list": (plus_a_list_tensor, torch.tensor([1.0, 2.0, 3.0]), [[5.0], [5.0], [5.0], [6.0], [5.0], [5.0]],
             [[1.0, 2.0, 3.0]]),
}


def backend_context(backend: str):
    return ts.interpreter() if backend == "triton" else contextlib.nullcontext()


def compiled_kernels(traced, backend: str) -> list:
    """The fused kernels the backend compiled for the trace (none for aten)."""
    return ts.triton_launchers(traced) if backend == "triton" else list(traced.kernel_sources().values())


@pytest.mark.filterwarnings("ignore::tracejit.ReplayLevelWarning")  # new values leave the API level
@pytest.mark.parametrize("backend", ["aten", "c", "triton"])
@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("case", list(LITERAL_CASES))
def test_a_tensor_of_python_data_with_another_dtype_or_shape_is_a_mismatch(case, without_host, backend):
    """`torch.tensor(v)` is bound anew on every call with the values it holds, but the kernels were
    built for the recorded dtype and shape: `v` going from 2 to 2.5 returned int32 garbage (the
    float's bytes read as int64), to True read a bool's byte as an int64, and a list grown from one
    element to three was read as the broadcast one. Such a change is a mismatch in every mode;
    new values of the recorded dtype and shape still follow the data."""
    function, x, same_kind, other_kind = LITERAL_CASES[case]
    with backend_context(backend):
        traced = tracejit.trace(function, backend=backend, without_host=without_host)
        for v in same_kind:
            _data["v"] = v
            assert same(traced(x.clone()), function(x.clone())), v
        assert traced.stats.host_free_calls if without_host else traced.stats.api_replays
        assert bool(compiled_kernels(traced, backend)) == (backend != "aten")
        for v in other_kind:
            _data["v"] = v
            with pytest.raises(TraceMismatchError, match=r"lift_fresh.* created from Python data of another dtype "
                                                         r"or shape than recorded \(cpu"):
                traced(x.clone())
        _data["v"] = same_kind[0]
        assert same(traced(x.clone()), function(x.clone()))


# -- 9. tensors with PyTorch's negation or conjugation bit -------------------------------------------------

_complex = torch.tensor([1 + 1j, 2 - 3j, -1 + 0.5j, 4 + 2j, -2 - 1j], dtype=torch.complex64)


def plain_imag():
    return _complex.clone().imag


def negated_imag():
    return _complex.clone().conj().imag  # is_neg(): the memory holds the imaginary parts unnegated


def affine(x):
    return x * 2 + 1


def scaled_in_place(x):
    x.mul_(2).add_(1)
    return x.sum()


def shifted_difference(x):
    return x[1:] * 3 - x[:-1]


# the inputs of each call, recorded first: without the bit then with it, with it throughout, with it then without
BIT_ORDERS = {
    "plain_then_negated": [plain_imag] * 3 + [negated_imag] * 3 + [plain_imag, negated_imag],
    "negated": [negated_imag] * 5,
    "negated_then_plain": [negated_imag] * 3 + [plain_imag] * 3 + [negated_imag],
}


@pytest.mark.parametrize("backend", ["aten", "c", "triton"])
@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("order", list(BIT_ORDERS))
@pytest.mark.parametrize("function", [affine, scaled_in_place, shifted_difference], ids=lambda f: f.__name__)
def test_an_input_with_a_negation_bit_is_read_as_eager_reads_it(function, order, without_host, backend):
    """`z.conj().imag` has the shape, strides and dtype of `z.imag`, so it shared its trace, and the
    fused kernel read its memory through data_ptr(): every value came out with the wrong sign (and
    a trace recorded with such an input was wrong from its first replay on). The bit is part of the
    input signature now, and no kernel reads or writes a tensor that has one."""
    with backend_context(backend):
        traced = tracejit.trace(function, backend=backend, without_host=without_host)
        for call, make in enumerate(BIT_ORDERS[order]):
            mine, eager = make(), make()
            assert same(traced(mine), function(eager)), (call, make.__name__)
            assert torch.equal(mine, eager), f"call {call}: the input was written otherwise than eager writes it"
        assert traced.stats.records == (1 if order == "negated" else 2)
        assert traced.stats.host_free_calls >= 4 if without_host else traced.stats.api_replays >= 3
        if backend != "aten" and function is not scaled_in_place:  # whose neg-view record has single ops
            assert len(compiled_kernels(traced, backend)) == traced.stats.records


def negated_inside(z):
    return z.conj().imag * 2 + 1


def neg_view_inside(x):
    return torch._neg_view(x * 3)[1:] * 2 + 1


@pytest.mark.parametrize("backend", ["c", "triton"])
@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("function, make", [(negated_inside, lambda: _complex.clone()),
                                            (neg_view_inside, plain_imag)], ids=["conj_imag", "neg_view"])
def test_a_negative_view_made_inside_the_function_is_read_as_eager_reads_it(function, make, without_host, backend):
    """The clone eager makes of a negative view before `* 2` was a kernel member reading the view's
    memory: `z.conj().imag * 2 + 1` came out as `z.imag * 2 + 1` from the first replay on."""
    with backend_context(backend):
        traced = tracejit.trace(function, backend=backend, without_host=without_host)
        for call in range(4):
            assert same(traced(make()), function(make())), call
        assert traced.stats.host_free_calls >= 2 if without_host else traced.stats.api_replays >= 1
        assert compiled_kernels(traced, backend), "the ops after the resolving clone no longer fuse"


_weights = {"w": plain_imag()}


def plus_a_cloned_global(x):
    return _weights["w"].clone() * 2 + x


@pytest.mark.parametrize("without_host", [False, True])
def test_an_external_that_becomes_a_negative_view_is_a_mismatch(without_host):
    """The clone of a global whose tensor became `z.conj().imag` dispatches the same ops, and the
    kernel read the new tensor's memory unnegated (checked and host-free calls alike)."""
    _weights["w"] = plain_imag()
    traced = trace_c(plus_a_cloned_global) if not without_host else tracejit.trace(
        plus_a_cloned_global, backend="c", without_host=True)
    x = torch.arange(5.0)
    for _ in range(4):
        assert same(traced(x), plus_a_cloned_global(x))
    assert traced.kernel_sources() and (traced.stats.host_free_calls if without_host else traced.stats.api_replays)
    _weights["w"] = negated_imag()
    with pytest.raises(TraceMismatchError, match=r"aten.clone.default is a negative or conjugate view where the "
                                                 r"recorded one was not, or the reverse \(recorded cpu float32\[5\]\)"
                                                 r"\n  expected: t1 \(external _weights\['w'\], cpu float32\[5\]\)"
                                                 r"\n  got:      cpu float32\[5\], a negative view\n"):
        traced(x)
    _weights["w"] = plain_imag()
    assert same(traced(x), plus_a_cloned_global(x))


# -- 10. version counters of the tensors a kernel writes in place ------------------------------------------

def scale_and_shift(a):
    a.mul_(2).add_(1)  # one kernel, two in-place writes: eager bumps the version twice
    return a.sum()


def scale_and_shift_a_slice(a):
    a[1:].mul_(2).add_(1)  # through a view: the version counter is the base's
    return a.sum()


def scale_and_shift_lanes(a, b):
    torch._foreach_mul_([a, b], 2)
    torch._foreach_add_([a, b], 1)
    return a.sum()


@pytest.mark.parametrize("backend", ["aten", "c", "triton"])
@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("function", [scale_and_shift, scale_and_shift_a_slice, scale_and_shift_lanes],
                         ids=lambda f: f.__name__)
def test_in_place_writes_move_the_version_counter_as_in_eager(function, without_host, backend):
    """A kernel writes through data pointers, which no version counter sees: from the first call
    without the function (and the first checked call at the torch API level) on, an input the
    kernel wrote kept its version. And eager's `_foreach_` ops bump nothing when they reach the
    kernels through a dispatch mode, so the recorded call and checked calls at the aten level left
    the lanes' versions as they were too."""
    lanes = 2 if function is scale_and_shift_lanes else 1
    with backend_context(backend):
        traced = tracejit.trace(function, backend=backend, without_host=without_host)
        for call in range(5):
            mine, eager = [torch.arange(6.0) for _ in range(lanes)], [torch.arange(6.0) for _ in range(lanes)]
            assert same(traced(*mine), function(*eager))
            assert [t._version for t in mine] == [t._version for t in eager] == [2] * lanes, call
            assert all(torch.equal(m, e) for m, e in zip(mine, eager))
        assert traced.stats.host_free_calls >= 3 if without_host else traced.stats.api_replays >= 2
        assert bool(compiled_kernels(traced, backend)) == (backend != "aten")


def saved_then_traced(traced):
    """Eager's outcome of a backward through a graph that saved the input a (traced) call then
    modified in place: the call's result, the input's version change, and the backward's error."""
    weight = torch.ones(3, requires_grad=True)
    a = torch.tensor([1.0, 2.0, 3.0])
    out = (weight * a).sum()  # saves `a` for weight's gradient
    before = a._version
    traced(a)
    try:
        out.backward()
        raised = None
    except RuntimeError as error:
        raised = "modified by an inplace operation" in str(error)
    return a._version - before, raised, weight.grad


@pytest.mark.parametrize("without_host", [False, True])
def test_a_backward_through_an_input_a_kernel_wrote_raises_as_in_eager(without_host):
    """The caller's graph saved `a`; the traced call wrote it in place; eager's backward raises
    "modified by an inplace operation". Through the kernel the version stayed: backward ran and
    returned the modified values as the gradient, silently."""
    traced = tracejit.trace(scale_and_shift, backend="c", without_host=without_host)
    for call in range(5):
        assert saved_then_traced(traced) == saved_then_traced(scale_and_shift) == (2, True, None), call
    assert traced.kernel_sources() and (traced.stats.host_free_calls if without_host else traced.stats.api_replays)


_captured = torch.arange(4.0)


def read_captured(x):
    return x * (_captured * 2)


def write_captured(x):
    _captured.mul_(2).add_(1)
    return x.sum()


def test_capture_as_const_sees_a_write_by_another_traces_kernel():
    """capture_as_const raises when a captured tensor was modified in place since (its version
    moved). A host-free kernel of another traced function wrote it without moving the version."""
    writer = tracejit.trace(write_captured, backend="c", without_host=True)
    x = torch.ones(4)
    for _ in range(3):
        writer(x)
    reader = tracejit.trace(read_captured, capture_as_const=True, backend="c")
    for _ in range(3):
        assert same(reader(x), read_captured(x))
    served = writer.stats.host_free_calls
    writer(x)
    assert writer.stats.host_free_calls == served + 1 and writer.kernel_sources()  # the kernel wrote it
    with pytest.raises(TraceMismatchError, match=r"captured constant t1 \(_captured\) was modified in place"):
        reader(x)


# -- hardtanh, round and int scalars at the edges --------------------------------------------------------

def clipped(x):
    y = x * 1
    return F.relu6(y), F.hardtanh(y, -0.0, 1.0), F.hardtanh(y, 0.0, 0.5)


def _signed_zero_edges(call):
    return (torch.tensor([-0.0, 0.0, -0.5, 2.0, 0.5, 6.0, float("nan"), -3.0]) * (1 + call),)


def _same_bits(got, want):
    for g, w in zip(got, want):
        assert same(g, w) and torch.equal(torch.signbit(g), torch.signbit(w)), (g, w)


@pytest.mark.parametrize("backend", ["c", "triton"])
def test_hardtanh_keeps_the_input_at_a_bound_as_eager_does(backend):
    """Eager's hardtanh is clamp with number bounds: `relu6(-0.0)` is -0.0, `hardtanh(0.0, -0.0, 1)`
    is 0.0. The kernels took the bound's sign where the two are equal."""
    with ts.interpreter() if backend == "triton" else contextlib.nullcontext():
        traced = tracejit.trace(clipped, backend=backend)
        for call in range(3):
            (x,) = _signed_zero_edges(call)
            _same_bits(traced(x.clone()), clipped(x.clone()))
        assert fused_nodes(traced) if backend == "c" else ts.triton_launchers(traced)


def rounded_far(x):
    return torch.round(x * 2, decimals=309) + 1, torch.round(x * 2, decimals=-309) + 1


def test_round_with_more_decimals_than_a_float_holds_is_eagers():
    """`10.0 ** 309` raised OverflowError while the trace compiled; eager's scale is inf (NaN results)."""
    assert_matches_eager(rounded_far, lambda call: (torch.tensor([1.5, -2.25, 0.0]) + call,))


def shifted(x, *, s):
    return (x * 1 + s) * 2


def test_an_int_beyond_int64_reaches_a_float_kernel_as_eager_takes_it():
    """A float tensor takes 2**63 (eager computes 1.8447e+19); the kernel bound it as an int64 that
    wrapped to -2**63."""
    x = torch.zeros(3)
    traced = trace_c(shifted)
    for s in (5, 5, 5, 2 ** 63, 2 ** 64 - 1, 7):
        assert same(traced(x.clone(), s=s), shifted(x.clone(), s=s)), s
    assert fused_nodes(traced)


@pytest.mark.parametrize("function", [clamped, masked], ids=["clamp", "masked_fill"])
def test_an_int_beyond_int64_for_an_int64_tensor_raises_as_eager_does(function):
    x = torch.arange(4)
    traced = trace_c(function)
    for _ in range(3):
        assert same(traced(x.clone(), k=3), function(x.clone(), k=3))
    assert "without overflow" in eager_outcome(function, x, 2 ** 63)
    with pytest.raises(RuntimeError, match="without overflow"):
        traced(x.clone(), k=2 ** 63)
    assert same(traced(x.clone(), k=3), function(x.clone(), k=3))
    assert fused_nodes(traced)


def _filled_with_tensor(x, v):
    return ((x + 1).masked_fill(x > 10, v) * 1,)


def _filled_in_place_with_tensor(x, v):
    return (x.masked_fill_(x > 10, v),)


FILL_VALUES = {  # (dtype of x, a 0-dim value that fits, one that does not)
    "uint8 <- int64": (torch.uint8, torch.tensor(5), torch.tensor(300)),
    "int8 <- int64": (torch.int8, torch.tensor(5), torch.tensor(1000)),
    "float32 <- float64": (torch.float32, torch.tensor(5.0, dtype=torch.float64), torch.tensor(1e39, dtype=torch.float64)),
    "int32 <- float32 nan": (torch.int32, torch.tensor(5.0), torch.tensor(float("nan"))),
}


@pytest.mark.parametrize("backend", ["c", "triton"])
@pytest.mark.parametrize("function", [_filled_with_tensor, _filled_in_place_with_tensor], ids=["masked_fill", "masked_fill_"])
@pytest.mark.parametrize("case", list(FILL_VALUES))
def test_a_tensor_fill_value_that_does_not_fit_raises_as_eager_does(case, function, backend):
    """Hunt W F1: eager converts masked_fill's 0-dim tensor value with an overflow check (300 into
    uint8 raises); the fused kernel cast it (300 -> 44), also into the caller's tensor in place.
    A tensor value whose dtype may not fit the filled tensor's is no longer fused."""
    dtype, fits, overflows = FILL_VALUES[case]
    x = torch.arange(16).to(dtype)
    context = ts.interpreter() if backend == "triton" else contextlib.nullcontext()
    with context:
        traced = tracejit.trace(function, backend=backend)
        for _ in range(3):
            assert same(traced(x.clone(), fits)[0], function(x.clone(), fits)[0])
        with pytest.raises(RuntimeError, match="without overflow|cannot be converted"):
            function(x.clone(), overflows)
        given = x.clone()
        with pytest.raises(RuntimeError, match="without overflow|cannot be converted"):
            traced(given, overflows)
        assert torch.equal(given, x)  # the in-place fill did not happen, as in eager
        assert same(traced(x.clone(), fits)[0], function(x.clone(), fits)[0])
