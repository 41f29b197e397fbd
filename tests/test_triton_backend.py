"""The Triton backend proven without a GPU: kernels run in Triton's interpreter on CPU tensors and
match eager (op table, random chains, layouts, in-place, multi-tensor optimizer steps, special
values). test_triton_aot.py builds every kernel these tests generate for CUDA sm_80 and sm_90.

Tolerances are in triton_support.py: exact (bit for bit, signed zeros included) unless an op
computes a transcendental or eager rounds differently (ROUNDS_DIFFERENTLY says why), then a few ulp.
"""

from __future__ import annotations

import pytest
import torch
import triton_support as ts
from models import batch, make_model
from triton_cases import (
    CASES,
    bias_add,
    chain_case,
    elementwise_chain,
    foreach_lists,
    huge_kernel,
    in_place,
    list_inputs,
    noncontiguous,
    optimizer,
    scaled,
    small_int_inputs,
    sweep_case,
    trace,
    train_step,
)


@pytest.fixture(autouse=True)
def _interpret():
    with ts.interpreter():
        yield


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
        reference = sweep(*(i.double() if i.dtype.is_floating_point else i for i in inputs))
        for entry, g, w, r in zip(entries, got, want, reference):
            keep = _kept(entry.name, dtype, inputs)
            problem = ts.mismatch(g, w, ts.exact(entry), keep, ts.AMPLIFIED.get(entry.name, (1,))[0], reference=r)
            if problem:
                failures.append(f"{entry.name}: {problem}")
    assert not failures, "\n".join(failures)


def _kept(name, dtype, inputs):
    if name in ts.COMPARE_WHERE:
        return ts.COMPARE_WHERE[name][0](*inputs)
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
    assert traced.kernel_sources() == {launcher.kernel.name: launcher.source}
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


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_negative_zero_is_false(dtype):
    # the interpreter holds bfloat16 as its bits: -0.0 compared unwidened was True
    function, first, _, _ = CASES[f"half_truths-{dtype}"]()
    traced = trace(function)
    for _ in range(3):
        for g, w in zip(traced(*first), function(*first)):
            assert ts.mismatch(g, w, exact_match=True) is None
    assert ts.triton_launchers(traced)


def test_a_huge_iteration_space_uses_64_bit_offsets():
    kernel = huge_kernel()
    assert "offs = tl.program_id(0).to(tl.int64) * 1024 + tl.arange(0, 1024)" in kernel.source
    assert kernel.grid == 3 * 2**20 and "mask" not in kernel.source  # whole blocks: no tail


# -- training steps: forward, backward and a multi-tensor optimizer step over several calls ----------------

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
    for step in range(5):
        for opt in (opt_a, opt_b):
            opt.param_groups[0]["lr"] = 0.05 / (step + 1)
        x, y = batch("mlp", step)
        assert close_state(train_step(x, y, model=model_a, opt=opt_a), traced(x, y, model=model_b, opt=opt_b))
        if step == 2:  # from the third call on, the host-free program computes checked calls
            launchers = ts.triton_launchers(traced)
    assert ts.triton_launchers(traced) == launchers and len(traced._entries()) == 1
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert close_state(a, b)


