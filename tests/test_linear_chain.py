"""Small matrix products as C kernels (passes/chain_linear.py, backends/c/linear.py).

A batch-1 forward's `addmm`s become one generated kernel per chain. Every test compares with
eager on this machine (to rounding: the kernel sums in another order than the BLAS library) and
proves the kernel ran: the graph holds the linear group and the C function was called.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from fused_support import fused_nodes
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tracejit
from tracejit.ir import Op
from tracejit.passes.chain_linear import LINEAR_OPS


def linear_groups(traced) -> list:
    return [n for n in fused_nodes(traced) if n.target.kind == "linear"]


def count_kernel_calls(traced) -> list[int]:
    """Wrap the C function of every compiled linear kernel; the list counts the calls."""
    calls = [0]
    for entry in traced._entries():
        programs = [entry.program] + ([entry.host_free.program] if entry.host_free is not None else [])
        for program in programs:
            for kernel in program.kernels.values():
                namespace = getattr(kernel, "__globals__", {})
                if type(getattr(kernel, "spec", None)).__name__ != "LinearChain" or "COUNTED" in namespace:
                    continue
                function = namespace["FN"]

                def counted(*pointers, function=function):
                    calls[0] += 1
                    return function(*pointers)

                namespace["FN"], namespace["COUNTED"] = counted, True
    return calls


def assert_close(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor | None = None) -> None:
    """Equal to rounding: NaN and infinities in the same places, the rest within a few units of
    `magnitude` (the chain on absolute values, which bounds what cancels in a sum) or of `want`."""
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = (want.abs() if magnitude is None else magnitude).double().clamp_min(1.0)
    bound = 64 * torch.finfo(want.dtype).eps * scale
    finite = torch.isfinite(got) & torch.isfinite(want) & ((got.double() - want.double()).abs() <= bound)
    ok = (got.isnan() & want.isnan()) | (got.isinf() & (got == want)) | finite
    assert ok.all(), f"{int((~ok).sum())} elements differ: {got[~ok][:3].tolist()} vs eager {want[~ok][:3].tolist()}"


def mlp(*widths: int, dtype=torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).to(dtype).eval()


@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_an_mlps_forward_is_one_linear_kernel(without_host, rows):
    model = mlp(64, 128, 128, 10)

    def infer(x):
        with torch.no_grad():
            return model(x)

    traced = tracejit.trace(infer, backend="c", without_host=without_host)
    inputs = [torch.randn(rows, 64) for _ in range(5)]
    assert_close(traced(inputs[0]), infer(inputs[0]))
    calls = None
    for x in inputs[1:]:
        assert_close(traced(x), infer(x))
        if calls is None:
            calls = count_kernel_calls(traced)
    [group] = linear_groups(traced)
    assert [str(m.target) for m in group.members] == ["aten._addmm_activation.default"] * 2 + ["aten.addmm.default"]
    assert calls[0] == 3
    assert (traced.stats.host_free_calls if without_host else traced.stats.api_replays) >= 3


def test_the_reference_backend_forms_the_same_chain_and_keeps_eagers_bits():
    model = mlp(16, 32, 8)

    def infer(x):
        with torch.no_grad():
            return model(x)

    traced = tracejit.trace(infer, backend="reference")
    for _ in range(3):
        x = torch.randn(2, 16)
        assert torch.equal(traced(x), infer(x))
    [group] = linear_groups(traced)
    assert len(group.members) == 2


def test_a_weight_read_along_its_columns_and_mm_without_bias():
    """`x @ W` with W stored [in, out] (no transpose), chained into `F.linear` and `torch.mm`."""
    torch.manual_seed(1)
    w1, b1, w2, w3 = torch.randn(20, 37), torch.randn(37), torch.randn(5, 37), torch.randn(5, 3)

    def f(x):
        h = torch.relu(torch.addmm(b1, x, w1))
        h = F.linear(h, w2)
        return torch.mm(h, w3)

    traced = tracejit.trace(f, backend="c", without_host=True)
    traced(torch.randn(2, 20))
    calls = count_kernel_calls(traced)
    for _ in range(3):
        x = torch.randn(2, 20)
        assert_close(traced(x), f(x))
    [group] = linear_groups(traced)
    assert len(group.members) == 3 and calls[0] == 3
    [source] = [s for s in traced.kernel_sources().values() if "acc[j]" in s]
    assert "xv *" in source  # the column-wise form for w1 and w3


@pytest.mark.parametrize("special", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinities_propagate_as_in_eager(special):
    model = mlp(8, 16, 4)
    with torch.no_grad():
        model[0].weight[3, 2] = special

    def infer(x):
        with torch.no_grad():
            return model(x)

    traced = tracejit.trace(infer, backend="c")
    x = torch.randn(1, 8)
    traced(x)
    for value in [1.0, -1.0, 0.0]:
        x = torch.randn(1, 8)
        x[0, 2] = value
        assert_close(traced(x), infer(x))
    assert linear_groups(traced)


def test_values_the_host_sees_or_keeps_end_a_chain():
    """An intermediate that is returned, read twice or read by the host is stored: the chain stops there."""
    model = mlp(8, 16, 16, 4)
    seen = []

    def f(x):
        with torch.no_grad():
            h1 = model[1](model[0](x))
            h2 = model[3](model[2](h1))
            seen.append(float(h2.sum()))  # a host read of h2
            return model[4](h2), h1, h2 * 2

    traced = tracejit.trace(f, backend="c")
    for _ in range(4):
        x = torch.randn(1, 8)
        got, want = traced(x), f(x)
        for g, w in zip(got, want):
            assert_close(g, w)
        assert seen[-1] == pytest.approx(seen[-2], rel=1e-5)
    assert all(len(g.members) == 1 for g in linear_groups(traced))


def test_products_too_large_or_with_beta_alpha_stay_with_aten():
    torch.manual_seed(2)
    big, b, w = torch.randn(512, 512), torch.randn(512), torch.randn(5, 5)

    def f(x, y):
        return torch.addmm(b, x, big), torch.addmm(torch.zeros(5), y, w, beta=0.5, alpha=2.0), torch.mm(torch.randn(8, 5), w)

    traced = tracejit.trace(f, backend="c", without_host=True)
    for _ in range(3):
        x, y = torch.randn(1, 512), torch.randn(1, 5)
        torch.manual_seed(3)
        got = traced(x, y)
        torch.manual_seed(3)
        for g, want in zip(got, f(x, y)):
            assert_close(g, want)
    assert not linear_groups(traced)


def test_a_training_step_at_batch_one_matches_eager():
    """Forward products are kept for backward (no chain), backward's `grad @ W` is a product alone."""
    eager_model, traced_model = mlp(12, 24, 6), mlp(12, 24, 6)
    eager_model.train(), traced_model.train()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager_model, traced_model)]

    def step(x, y, *, model, opt):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    traced = tracejit.trace(step, backend="c")
    for _ in range(5):
        x, y = torch.randn(1, 12), torch.randn(1, 6)
        assert_close(traced(x, y, model=traced_model, opt=opts[1]), step(x, y, model=eager_model, opt=opts[0]))
        for p, q in zip(traced_model.parameters(), eager_model.parameters()):
            assert_close(p.detach(), q.detach())
    assert linear_groups(traced)


def test_another_layout_runs_the_chain_through_aten():
    model = mlp(8, 16, 4)

    def infer(x):
        with torch.no_grad():
            return model(x)

    traced = tracejit.trace(infer, backend="c", without_host=True)
    for _ in range(3):
        traced(torch.randn(1, 8))
    [kernel] = [k for e in traced._entries() for p in [e.host_free.program] for k in p.kernels.values()
                if type(getattr(k, "spec", None)).__name__ == "LinearChain"]
    inputs = [model[0].bias, torch.randn(8, 1).t(), model[0].weight.t(), model[2].bias, model[2].weight.t()]
    assert inputs[1].stride() != (8, 1)
    [got] = kernel(inputs, [])
    with torch.no_grad():
        assert_close(got, model(inputs[1].contiguous()))


def test_a_dumped_mlp_loads_with_its_linear_kernel(tmp_path):
    model = mlp(10, 20, 3)

    def infer(x):
        with torch.no_grad():
            return model(x)

    traced = tracejit.trace(infer, backend="c", capture_as_const=True)
    traced(torch.randn(1, 10))
    path = tmp_path / "mlp.tj"
    traced.dump(path)
    loaded = tracejit.load(path, backend="c")
    for _ in range(3):
        x = torch.randn(1, 10)
        [got] = loaded(x)
        assert_close(got, infer(x))
    assert [len(n.members) for n in loaded.program.graph.nodes if n.op is Op.FUSED and n.target.kind == "linear"] == [2]


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 4), widths=st.lists(st.integers(1, 40), min_size=2, max_size=4),
       relu=st.lists(st.booleans(), min_size=3, max_size=3), bias=st.lists(st.booleans(), min_size=3, max_size=3),
       columns_layout=st.lists(st.booleans(), min_size=3, max_size=3),
       dtype=st.sampled_from([torch.float32, torch.float64]), without_host=st.booleans())
def test_fuzz_chains_of_products_match_eager(rows, widths, relu, bias, columns_layout, dtype, without_host):
    g = torch.Generator().manual_seed(sum(widths) * 7 + rows)
    layers = []
    for k, (a, b) in enumerate(zip(widths, widths[1:])):
        # a weight stored [out, in] and read transposed (nn.Linear), or stored [in, out]
        weight = torch.randn(a, b, generator=g, dtype=dtype) if columns_layout[k] else \
            torch.randn(b, a, generator=g, dtype=dtype).t()
        layers.append((weight, torch.randn(b, generator=g, dtype=dtype) if bias[k] else None, relu[k]))

    def f(x):
        for weight, b, activation in layers:
            x = torch.addmm(b, x, weight) if b is not None else torch.mm(x, weight)
            x = torch.relu(x) if activation else x
        return x

    def magnitude(x):
        for weight, b, _ in layers:
            x = x.abs() @ weight.abs() + (b.abs() if b is not None else 0)
        return x

    traced = tracejit.trace(f, backend="c", without_host=without_host)
    inputs = [torch.randn(rows, widths[0], generator=g, dtype=dtype) for _ in range(3)]
    for x in inputs:
        assert_close(traced(x), f(x), magnitude(x))
    groups = linear_groups(traced)
    assert sum(len(group.members) for group in groups) == len(layers)


def test_fusion_fuel_counts_linear_chains_first(monkeypatch):
    """TRACEJIT_FUSION_FUEL bisects every kind of group: 0 forms none, 1 only the first chain."""
    torch.manual_seed(4)
    w1, w2 = torch.randn(6, 8), torch.randn(8, 3)

    def f(x, y):
        return torch.relu(torch.mm(x, w1)).exp(), torch.mm(y, w2) * 2 + 1

    for fuel, chains in [("0", 0), ("1", 1), ("", 2)]:
        monkeypatch.setenv("TRACEJIT_FUSION_FUEL", fuel)
        traced = tracejit.trace(f, backend="c", without_host=True)
        for _ in range(3):
            x, y = torch.randn(1, 6), torch.randn(2, 8)
            for got, want in zip(traced(x, y), f(x, y)):
                assert_close(got, want)
        assert len(linear_groups(traced)) == chains
        if fuel == "0":
            assert not fused_nodes(traced)


def test_a_chain_keeps_at_most_16_kib_on_the_stack():
    """Intermediates live on the C stack, and threads may have small stacks (128 KiB): a chain of
    wide float64 products is split so that no kernel keeps more than 16 KiB."""
    torch.manual_seed(5)
    widths = [16, 1024, 16, 1024, 16, 1024, 16]
    weights = [torch.randn(b, a, dtype=torch.float64) / a ** 0.5 for a, b in zip(widths, widths[1:])]

    def f(x):
        for w in weights:
            x = F.linear(x, w)
        return x

    traced = tracejit.trace(f, backend="c", without_host=True)
    for _ in range(3):
        x = torch.randn(2, 16, dtype=torch.float64)
        assert_close(traced(x), f(x))
    groups = linear_groups(traced)
    assert sum(len(g.members) for g in groups) == len(weights) and len(groups) > 1
    for group in groups:
        kept = sum(math.prod(m.input_metas[LINEAR_OPS[m.target].index("left")].shape) * 8 for m in group.members[1:])
        assert kept <= 16 << 10


@pytest.mark.parametrize("backend", ["aten", "c"])
@pytest.mark.parametrize("without_host", [False, True])
def test_a_write_between_a_linear_and_its_relu_is_not_seen_by_the_product(backend, without_host):
    """Linear + ReLU become one `_addmm_activation` at the ReLU's place: `x.mul_(2)` between them
    made the product read the doubled x (fuse_linear_activation, before the linear chains)."""
    torch.manual_seed(6)
    w, b = torch.randn(16, 8), torch.randn(16)

    def f(x):
        h = F.linear(x, w, b)
        x.mul_(2)
        return torch.relu(h)

    traced = tracejit.trace(f, backend=backend, without_host=without_host)
    for _ in range(4):
        x = torch.randn(2, 8)
        xt, xe = x.clone(), x.clone()
        assert_close(traced(xt), f(xe))
        assert torch.equal(xt, xe)
    assert traced.stats.host_free_calls if without_host else traced.stats.checked_replays


_MISCOMPILED_CHAIN = """
import torch, tracejit
g = torch.Generator().manual_seed(0)
w1, b1 = torch.randn(5, 24, generator=g), torch.randn(24, generator=g)    # [in, out]
w2, b2 = torch.randn(24, 26, generator=g), torch.randn(26, generator=g)
w3 = torch.randn(6, 26, generator=g).t()                                   # [out, in], read transposed
def f(x):
    x = torch.relu(torch.addmm(b1, x, w1))
    x = torch.relu(torch.addmm(b2, x, w2))
    return torch.mm(x, w3)
traced = tracejit.trace(f, backend="c")
for _ in range(3):
    x = torch.randn(2, 5, generator=g)
    torch.testing.assert_close(traced(x), f(x), rtol=1e-4, atol=1e-4)
assert any(n.target.kind == "linear" for e in traced._entries() for n in e.serving_program.graph.nodes
           if n.op.name == "FUSED"), "no linear kernel ran"
print("ok")
"""


def test_a_chain_gcc_miscompiled_with_avx512_runs(tmp_path):
    """The fuzz's one crash (found with a core dump): GCC 12.2 -O3 -march=native with AVX-512 put
    this chain's stack intermediate `float t0[48]` 16 bytes off the 32-byte alignment of the
    `vmovaps` that accesses it, and the kernel's first call died of SIGSEGV. The assembler now
    writes unaligned moves (backends/c/toolchain.py UNALIGNED_MOVES). In a child process with a
    cache of its own, so a crash fails this test instead of the run; on a CPU without AVX-512 it
    passes either way."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRACEJIT_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", _MISCOMPILED_CHAIN], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_the_kernel_cache_key_holds_the_cpus_feature_flags():
    """A VM may name its CPU generically ("AMD EPYC": Zen 2 to 4, with and without AVX-512): with
    the model name alone in the key, a cache shared with another such host loaded libraries built
    for instructions that host lacks."""
    from tracejit.backends.c import toolchain

    identity = toolchain._cpu_identity()
    with open("/proc/cpuinfo") as info:
        flags = next((line.strip() for line in info if line.startswith(("flags", "Features"))), None)
    if flags is None:
        pytest.skip("no feature flags in /proc/cpuinfo here")
    assert flags in identity
