"""The Triton backend proven without a GPU: kernels run in Triton's interpreter on CPU tensors and
match eager (op table, random chains, layouts, in-place, multi-tensor optimizer steps, special
values), and every kernel these tests generate compiles offline for CUDA sm_80 and sm_90.

Tolerances are in triton_support.py: exact (bit for bit, signed zeros included) unless an op
computes a transcendental or eager rounds differently (ROUNDS_DIFFERENTLY says why), then a few ulp.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import triton_support as ts
from models import batch, make_model

import tracejit
from tracejit.backends import resolve_backend
from tracejit.backends.optable import OP_TABLE
from tracejit.backends.triton.render import render_kernel

pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def _interpret():
    with ts.interpreter():
        yield


def trace(function, **options):
    return tracejit.trace(function, backend="triton", **options)


# -- cases: each builds a function and its first call; the offline build test re-traces them all -------------

def sweep_case(dtype):
    return ts.sweep_function(dtype), ts.random_inputs(dtype, 0), {}, {}


CHAIN_ENTRIES = [e for e in OP_TABLE.values() if e.dtypes in ("float", "number")]
CHAIN_TYPES = [(torch.float32,) * 3, (torch.float64,) * 3, (torch.float32, torch.float16, torch.float32),
               (torch.bfloat16, torch.float32, torch.float16)]


def chain_case(seed):
    rng = random.Random(seed)
    entries = [rng.choice(CHAIN_ENTRIES) for _ in range(rng.randint(3, 6))]
    dtypes = CHAIN_TYPES[seed % len(CHAIN_TYPES)]

    def chain(x, y, z):
        a, b = x, y
        for entry in entries:
            result = entry.example(a, b, z)
            a, b = (result.to(x.dtype) if result.dtype == torch.bool else result), a
        return a * 1, b * 1

    inputs = tuple(t.to(d) for t, d in zip(ts.random_inputs(torch.float64, seed), dtypes))
    return chain, inputs, {}, {"entries": entries, "dtypes": dtypes}


def elementwise_chain(x, y):
    return ((x * y + 1).sigmoid() * x - y).tanh() * 0.5 + x


def bias_add(x, b, column, s):
    return ((x + b).relu() * s + column).sigmoid()


def noncontiguous(x, y):
    a = x.t() * 2 + y[:, ::2]  # a transposed and a strided view: N-d index math
    return a.relu(), (a * y[:, 1::2]).t()


def in_place(x, y, acc):
    x.mul_(0.5).add_(y).clamp_(-1.0, 1.0)
    acc.add_(x * y)
    return (x + acc).tanh()


def foreach_lists(*tensors):
    xs, ys = list(tensors[:4]), list(tensors[4:])
    torch._foreach_mul_(xs, 0.9)
    torch._foreach_add_(xs, ys, alpha=0.1)
    return torch._foreach_sigmoid(xs)


def list_inputs(seed):
    """Two lists of four tensors: larger than a block, 2-d, 0-d and small."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(3000,), (40, 33), (), (7,)] * 2
    return tuple(torch.randn(s, generator=g) for s in shapes)


def masked(x, keep):
    return torch.where(keep, x, 0.0).relu() * 2, keep.logical_not()  # bool loads and stores


def small_ints(a, b, c):
    return (a + b) * c, (a * 3).abs(), b.to(torch.float16) * 0.5  # int8, uint8, int16: promotion, wrap-around


def small_int_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-128, 128, (500,), generator=g, dtype=torch.int8),
            torch.randint(0, 256, (500,), generator=g, dtype=torch.uint8),
            torch.randint(-300, 300, (500,), generator=g, dtype=torch.int16))


def foreach_ints(*tensors):
    return torch._foreach_mul(torch._foreach_add(list(tensors), 3), -2)  # int scalars in the lane table


def scaled(x, y, *, lr, k):
    return (x * lr + y).relu() + k


CASES = {
    **{f"sweep-{str(d).split('.')[-1]}": (lambda d=d: sweep_case(d)) for d in ts.FLOAT_TYPES + ts.INT_TYPES},
    **{f"chain-{seed}": (lambda seed=seed: chain_case(seed)) for seed in range(12)},
    "elementwise_chain": lambda: (elementwise_chain, (torch.randn(1000), torch.randn(1000)), {}, {}),
    "bias_add": lambda: (bias_add, (torch.randn(24, 40), torch.randn(40), torch.randn(24, 1), torch.tensor(0.7)),
                         {}, {}),
    "noncontiguous": lambda: (noncontiguous, (torch.randn(40, 24), torch.randn(24, 80)), {}, {}),
    "in_place": lambda: (in_place, (torch.randn(300), torch.randn(300), torch.zeros(300)), {}, {}),
    "foreach_lists": lambda: (foreach_lists, list_inputs(0), {}, {}),
    "masked": lambda: (masked, (torch.randn(64, 8), torch.randn(64, 8) > 0), {}, {}),
    "small_ints": lambda: (small_ints, small_int_inputs(0), {}, {}),
    "foreach_ints": lambda: (foreach_ints, (torch.arange(2000), torch.arange(5), torch.tensor(7)), {}, {}),
    "scaled": lambda: (scaled, (torch.randn(100), torch.randn(100)), {"lr": 0.1, "k": 3}, {}),
}


# -- (a) kernels match eager ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ts.FLOAT_TYPES + ts.INT_TYPES, ids=str)
def test_every_op_table_entry_matches_eager(dtype):
    sweep, first, _, _ = sweep_case(dtype)
    entries = ts.sweep_entries(dtype)
    traced = trace(sweep)
    traced(*first)
    missing = {e.name for e in entries} - ts.ops_in_triton_kernels(traced)
    assert not missing, f"ops not compiled into Triton kernels: {sorted(missing)}"
    failures = []
    for inputs in (ts.random_inputs(dtype, 1), ts.special_inputs(dtype), ts.random_inputs(dtype, 2)):
        got, want = traced(*inputs), sweep(*inputs)
        for entry, g, w in zip(entries, got, want):
            keep = _kept(entry.name, dtype, inputs)
            problem = ts.mismatch(g, w, ts.exact(entry), keep, ts.AMPLIFIED.get(entry.name, (1,))[0])
            if problem:
                failures.append(f"{entry.name}: {problem}")
    assert not failures, "\n".join(failures)


def _kept(name, dtype, inputs):
    if name in ts.COMPARE_WHERE:
        return ts.COMPARE_WHERE[name][0](*inputs)
    if not dtype.is_floating_point and name in ts.INT_COMPARE_WHERE:
        return ts.INT_COMPARE_WHERE[name](*inputs)
    return None


@pytest.mark.parametrize("seed", range(12))
def test_random_fused_chains_match_eager(seed):
    chain, first, _, info = chain_case(seed)
    traced = trace(chain)
    traced(*first)
    kernels = [kernel for _, kernel in ts.fused_kernels(traced)]
    assert kernels and all(k in ts.triton_launchers(traced) for k in kernels), "a group did not become a kernel"
    for call in (1, 2):
        inputs = tuple(t.to(d) for t, d in zip(ts.random_inputs(torch.float64, 100 * seed + call), info["dtypes"]))
        for g, w in zip(traced(*inputs), chain(*inputs)):
            problem = ts.mismatch(g, w, exact_match=False)
            assert problem is None, f"chain {[e.name for e in info['entries']]} {info['dtypes']}: {problem}"


def test_elementwise_chain_loads_each_input_once_and_stores_once():
    traced = trace(elementwise_chain)
    for _ in range(3):
        x, y = torch.randn(1000), torch.randn(1000)
        assert ts.mismatch(traced(x, y), elementwise_chain(x, y), exact_match=False) is None
    (launcher,) = ts.triton_launchers(traced)
    source = launcher.source
    assert source.count("tl.load(") == 2 and source.count("tl.store(") == 1, source
    assert "mask = offs < 1000" in source  # the tail of the last block


def test_bias_add_broadcasts_without_reloading():
    traced = trace(bias_add)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        args = (torch.randn(24, 40, generator=g), torch.randn(40, generator=g), torch.randn(24, 1, generator=g),
                torch.tensor(0.25 * seed + 0.1))
        assert ts.mismatch(traced(*args), bias_add(*args), exact_match=False) is None
    (launcher,) = ts.triton_launchers(traced)
    assert launcher.source.count("tl.load(") == 4  # x, the bias row, the column, the 0-d scale


def test_noncontiguous_inputs_and_outputs():
    traced = trace(noncontiguous)
    for _ in range(3):
        x, y = torch.randn(40, 24), torch.randn(24, 80)
        for g, w in zip(traced(x, y), noncontiguous(x, y)):
            assert g.stride() == w.stride()
            assert ts.mismatch(g, w, exact_match=True) is None
    assert any(" // " in launcher.source for launcher in ts.triton_launchers(traced))  # N-d indexing


def test_a_layout_the_kernel_was_not_built_for_falls_back_to_aten():
    traced = trace(noncontiguous)
    traced(torch.randn(40, 24), torch.randn(24, 80))
    (launcher,) = ts.triton_launchers(traced)
    scalars = traced._entries()[0].program.initial_scalars
    contiguous = [torch.randn(meta.shape) for meta in launcher.spec.input_metas]
    assert any(t.stride() != tuple(m.stride) for t, m in zip(contiguous, launcher.spec.input_metas))
    reference = launcher.__globals__["FALLBACK"]
    for g, w in zip(launcher(contiguous, scalars), reference(contiguous, scalars)):
        assert torch.equal(g, w)


def test_in_place_members_update_their_targets():
    traced = trace(in_place)
    state = [torch.randn(300), torch.randn(300), torch.zeros(300)]
    twin = [t.clone() for t in state]
    for _ in range(4):
        out = traced(*state)
        want = in_place(*twin)
        assert ts.mismatch(out, want, exact_match=False) is None
        for a, b in zip(state, twin):
            assert ts.mismatch(a, b, exact_match=True) is None
        state[1].normal_(), twin[1].copy_(state[1])
    assert ts.triton_launchers(traced)


def test_foreach_ops_run_as_one_multi_tensor_launch():
    traced = trace(foreach_lists)
    for seed in range(3):
        inputs = list_inputs(seed)
        twins = [t.clone() for t in inputs]
        got, want = traced(*inputs), foreach_lists(*twins)
        for g, w in zip([*got, *inputs], [*want, *twins]):
            assert ts.mismatch(g, w, exact_match=False) is None
    multi = [launcher for launcher in ts.triton_launchers(traced) if launcher.kernel.work]
    assert multi, "no multi-tensor kernel"
    lanes = {lane for launcher in multi for lane, _, _ in launcher.kernel.work}
    assert lanes == {0, 1, 2, 3}  # every list element, the 0-d one included, in one grid
    assert len(multi[0].kernel.work) == multi[0].kernel.grid


@pytest.mark.parametrize("name", ["masked", "small_ints", "foreach_ints"])
def test_bool_and_small_int_kernels_match_eager(name):
    function, first, _, _ = CASES[name]()
    traced = trace(function)
    traced(*first)
    for seed in range(1, 3):
        if name == "small_ints":
            inputs = small_int_inputs(seed)
        else:
            inputs = tuple((t + seed) if t.dtype != torch.bool else t.logical_not() for t in first)
        for g, w in zip(traced(*inputs), function(*inputs)):
            assert ts.mismatch(g, w, exact_match=True) is None
    assert ts.triton_launchers(traced) and all(hasattr(k, "kernel") for _, k in ts.fused_kernels(traced))


def huge_kernel():
    """The elementwise_chain kernel rendered for 3 * 2^30 elements (rendered only: too big to run here)."""
    traced = trace(elementwise_chain)
    traced(torch.randn(1000), torch.randn(1000))
    (launcher,) = ts.triton_launchers(traced)
    lane = dataclasses.replace(launcher.spec.lanes[0], shape=(3 * 2**30,))
    return render_kernel(dataclasses.replace(launcher.spec, lanes=(lane,)))


def test_a_huge_iteration_space_uses_64_bit_offsets():
    kernel = huge_kernel()
    assert "offs = tl.program_id(0).to(tl.int64) * 1024 + tl.arange(0, 1024)" in kernel.source
    assert kernel.grid == 3 * 2**20 and "mask" not in kernel.source  # whole blocks: no tail


# -- training steps: forward, backward and a multi-tensor optimizer step over several calls ----------------

def optimizer(name, params, lr=1e-2):
    if name == "adam_foreach":
        return torch.optim.Adam(params, lr=lr, foreach=True)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=True)


def train_step(x, y, *, model, opt):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def training_case(opt_name, without_host=False):
    model = make_model("mlp")
    return train_step, batch("mlp", 0), {"model": model, "opt": optimizer(opt_name, model.parameters())}, {
        "options": {"without_host": without_host}}


CASES.update({f"train-{o}-{h}": (lambda o=o, h=h: training_case(o, h)) for o, h in
              [("adam_foreach", False), ("sgd_momentum", False), ("sgd_momentum", True)]})


def close_state(a, b, rtol=1e-5, atol=1e-6):
    return torch.allclose(a, b, rtol=rtol, atol=atol)


# foreach Adam reads step.item() on the host every step, which without_host refuses
TRAINING = [("adam_foreach", False), ("sgd_momentum", False), ("sgd_momentum", True)]


@pytest.mark.parametrize("opt_name, without_host", TRAINING, ids=["adam_foreach", "sgd_momentum",
                                                                   "sgd_momentum-without_host"])
def test_training_steps_match_eager(opt_name, without_host):
    model_a = make_model("mlp")
    model_b = make_model("mlp")
    opt_a, opt_b = optimizer(opt_name, model_a.parameters()), optimizer(opt_name, model_b.parameters())
    traced = trace(train_step, without_host=without_host)
    for step in range(4):
        x, y = batch("mlp", step)
        loss_a = train_step(x, y, model=model_a, opt=opt_a)
        loss_b = traced(x, y, model=model_b, opt=opt_b)
        assert close_state(loss_a, loss_b), f"step {step}: {loss_a.item()} vs {loss_b.item()}"
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert close_state(a, b), f"{name}: max |diff| {(a - b).abs().max().item()}"
    for state_a, state_b in zip(opt_a.state.values(), opt_b.state.values()):
        for key, value in state_a.items():
            assert close_state(value.float(), state_b[key].float()), key
    multi = [launcher for launcher in ts.triton_launchers(traced) if launcher.kernel.work]
    lanes = {len({lane for lane, _, _ in launcher.kernel.work}) for launcher in multi}
    assert len(list(model_b.parameters())) in lanes, "the optimizer step is not one multi-tensor kernel"


def test_changing_scalars_never_recompile():
    """A learning rate and an int that change every call are kernel arguments that Triton never
    specializes on: the launcher stays, and so does the key that picks the compiled GPU binary."""
    traced = trace(scaled)
    x, y = torch.randn(100), torch.randn(100)
    traced(x, y, lr=0.1, k=3)
    (launcher,) = ts.triton_launchers(traced)
    launches = []
    kernel = launcher.__globals__["KERNEL"]
    launcher.__globals__["KERNEL"] = lambda *args, **options: launches.append((args, options)) or kernel(
        *args, **options)
    for lr, k in ((0.5, 1), (1e-3, 16), (2.0**-30, 2**40), (0.1, -7)):
        assert ts.mismatch(traced(x, y, lr=lr, k=k), scaled(x, y, lr=lr, k=k), exact_match=True) is None
    assert ts.triton_launchers(traced) == [launcher] and len(traced._entries()) == 1
    keys = {ts.specialization_key(launcher.kernel, args, options) for args, options in launches}
    assert len(launches) == 4 and len(keys) == 1


def test_learning_rate_schedule_runs_one_compiled_program():
    model_a, model_b = make_model("mlp"), make_model("mlp")
    opt_a, opt_b = optimizer("sgd_momentum", model_a.parameters()), optimizer("sgd_momentum", model_b.parameters())
    traced = trace(train_step)
    for step in range(4):
        for opt in (opt_a, opt_b):
            opt.param_groups[0]["lr"] = 0.05 / (step + 1)
        x, y = batch("mlp", step)
        assert close_state(train_step(x, y, model=model_a, opt=opt_a), traced(x, y, model=model_b, opt=opt_b))
        if step == 1:
            launchers = ts.triton_launchers(traced)
    assert ts.triton_launchers(traced) == launchers and len(traced._entries()) == 1
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert close_state(a, b)


# -- devices -----------------------------------------------------------------------------------------------

def test_cpu_tensors_are_fused_only_in_the_interpreter(monkeypatch):
    from tracejit.backends.triton import TritonBackend

    assert TritonBackend.device_type == "cuda" and TritonBackend().device_types == {"cuda", "cpu"}
    monkeypatch.delenv("TRACEJIT_BACKEND", raising=False)
    auto = resolve_backend("auto")  # the C backend keeps the CPU tensors even when Triton interprets
    assert getattr(auto, "by_device", {}).get("cpu", auto).name != "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert TritonBackend().device_types == {"cuda"}
    traced = trace(elementwise_chain)
    x, y = torch.randn(100), torch.randn(100)
    for _ in range(2):
        assert torch.equal(traced(x, y), elementwise_chain(x, y))
    assert ts.fused_op_count(traced) == 0


class _Recorder:
    """Stands in for a CUDA device guard and a compiled kernel: notes what happens in which order."""

    def __init__(self):
        self.events = []

    def __enter__(self):
        self.events.append("enter device")

    def __exit__(self, *exc):
        self.events.append("exit device")

    def __getitem__(self, grid):
        return lambda *args, **options: self.events.append(("launch", grid, len(args), options))


def test_a_cuda_kernel_launches_under_its_device():
    from tracejit.backends.triton.launch import make_launcher

    traced = trace(elementwise_chain)
    x, y = torch.randn(1000), torch.randn(1000)
    traced(x, y)
    (launcher,) = ts.triton_launchers(traced)
    cuda = torch.device("cuda", 1)
    spec = dataclasses.replace(launcher.spec, device=cuda, allocations=tuple(
        dataclasses.replace(meta, device=cuda) for meta in launcher.spec.allocations))
    recorder = _Recorder()
    fake = make_launcher(spec, launcher.kernel, recorder, launcher.__globals__["FALLBACK"], interpret=False)
    assert fake.__globals__["DEVICE"].idx == 1
    fake.__globals__.update(DEVICE=recorder, V0=torch.device("cpu"))  # allocate on the CPU instead
    (out,) = fake([x, y], traced._entries()[0].program.initial_scalars)
    launch = ("launch", (1,), 5, {"num_warps": 4, "enable_fp_fusion": False, "enable_reflect_ftz": False})
    assert recorder.events == ["enter device", launch, "exit device"] and out.shape == (1000,)


# -- (b) every kernel these tests generate compiles for CUDA targets ------------------------------------------

def all_generated_kernels() -> list:
    """The kernels of every case (a first call records and builds them without running one), plus
    any other kernel the tests of this session generated."""
    for make in CASES.values():
        function, args, kwargs, info = make()
        traced = trace(function, **info.get("options", {}))
        traced(*args, **kwargs)
        ts.triton_launchers(traced)  # records its kernels in ts.GENERATED
    kernel = huge_kernel()
    ts.GENERATED.setdefault(kernel.source, kernel)
    return list(ts.GENERATED.values())


def test_every_generated_kernel_compiles_for_cuda_targets():
    kernels = all_generated_kernels()
    assert len(kernels) >= len(CASES)
    problems = ts.compile_all(kernels)
    assert not problems, "\n\n".join(problems)
