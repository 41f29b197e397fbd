"""Findings of an adversarial hunt on the caller's context: autocast around a call, threads,
traced functions nested through exclude_from_trace(), profiling of calls that raise or record.

Each test failed before its fix (see the stop note of 2026-11-26).
"""

import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit


def _fp32_region(x, *, model):
    """The first layer under the caller's autocast, the second in float32 on purpose."""
    with torch.no_grad():
        h = model[0](x)
        with torch.autocast("cpu", enabled=False):
            return model[1](h.float())


@pytest.mark.parametrize("options", [{}, {"without_host": True}, {"symbolic": True}],
                         ids=["checked", "without_host", "symbolic"])
def test_a_callers_autocast_does_not_cast_a_float32_region_again(options):
    """The programs run recorded ops, which autocast cast already: run with the caller's autocast
    still on, an fp32 matmul came back bfloat16 (silently, from the second checked replay on)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    traced = tracejit.trace(_fp32_region, **options)
    for _ in range(5):
        x = torch.randn(8, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = _fp32_region(x, model=model)
            got = traced(x, model=model)
        assert want.dtype == torch.float32
        assert got.dtype == torch.float32 and torch.equal(got, want)
    assert traced.stats.records == 1
    assert traced.stats.host_free_calls + traced.stats.checked_replays == 4
    if options.get("without_host"):
        assert traced.stats.host_free_calls == 4
    elif not options:
        assert traced.stats.api_replays >= 3  # the program ran, not the function


def test_a_host_read_inside_the_functions_own_autocast_reads_the_float32_value():
    """A host read realizes the program's ops so far while the function's autocast block is on."""
    def f(x, *, model):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            h = model[0](x)
            with torch.autocast("cpu", enabled=False):
                z = model[1](h.float())
            total = z.sum().item()  # realized inside the autocast block
        return z * total

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    traced = tracejit.trace(f)
    for _ in range(5):
        x = torch.randn(8, 16)
        want, got = f(x, model=model), traced(x, model=model)
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
    assert traced.stats.api_replays >= 3


def test_a_loaded_graph_runs_its_recorded_ops_under_a_callers_autocast(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)).eval()

    @tracejit.trace(capture_as_const=True)
    def infer(x):
        with torch.no_grad():
            return model(x)

    x = torch.randn(8, 16)
    infer(x)
    infer.dump(tmp_path / "infer.tjit")
    loaded = tracejit.load(tmp_path / "infer.tjit")
    (plain,) = loaded(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (under,) = loaded(x)
    assert under.dtype == plain.dtype == torch.float32 and torch.equal(under, plain)


@pytest.mark.parametrize("without_host", [False, True])
def test_the_default_autocast_dtype_the_function_takes_is_part_of_the_signature(without_host):
    """`torch.autocast("cpu")` without a dtype takes torch.get_autocast_dtype("cpu"): a caller
    that changes it between calls must not get the old dtype's program."""
    def f(x, *, model):
        with torch.autocast("cpu"):
            y = model(x)
        return y.float()

    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    traced = tracejit.trace(f, without_host=without_host)
    for _ in range(3):
        assert torch.equal(traced(x, model=model), f(x, model=model))
    before = torch.get_autocast_dtype("cpu")
    torch.set_autocast_dtype("cpu", torch.float16)
    try:
        for _ in range(3):
            assert torch.equal(traced(x, model=model), f(x, model=model))
    finally:
        torch.set_autocast_dtype("cpu", before)
    assert torch.equal(traced(x, model=model), f(x, model=model))
    assert traced.stats.records == 2  # one trace per autocast dtype


def test_traced_functions_nesting_the_other_way_round_on_two_threads_raise_instead_of_hanging():
    meet = threading.Barrier(2)
    outer = {"sync": False}

    def body(x, *, inner, other, offset):
        y = x + offset
        with tracejit.exclude_from_trace():
            if inner and outer["sync"]:
                meet.wait(timeout=10)  # both threads are inside their outer call
            if inner:
                y = other()(y, inner=False)
        return y * 2

    f = tracejit.trace(lambda x, *, inner: body(x, inner=inner, other=lambda: g, offset=1.0))
    g = tracejit.trace(lambda x, *, inner: body(x, inner=inner, other=lambda: f, offset=-1.0))
    eager = {"f": lambda x, *, inner: body(x, inner=inner, other=lambda: eager["g"], offset=1.0),
             "g": lambda x, *, inner: body(x, inner=inner, other=lambda: eager["f"], offset=-1.0)}
    x = torch.randn(4)
    for _ in range(3):
        assert torch.equal(f(x, inner=True), eager["f"](x, inner=True))
        assert torch.equal(g(x, inner=True), eager["g"](x, inner=True))
    outer["sync"] = True
    results = {}

    def run(name, fn):
        try:
            results[name] = fn(x, inner=True)
        except BaseException as error:  # noqa: BLE001 - the test looks at what each thread got
            results[name] = error

    threads = [threading.Thread(target=run, args=(name, fn), daemon=True) for name, fn in (("f", f), ("g", g))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads), "the two calls deadlocked"
    outer["sync"] = False
    errors = [r for r in results.values() if isinstance(r, BaseException)]
    assert errors and all(isinstance(e, RuntimeError) and "wait for each other" in str(e) for e in errors)
    for name, result in results.items():  # the other thread went on once the raising call gave its turn back
        if isinstance(result, torch.Tensor):
            assert torch.equal(result, eager[name](x, inner=True))
    assert torch.equal(f(x, inner=True), eager["f"](x, inner=True))  # both still work
    assert torch.equal(g(x, inner=True), eager["g"](x, inner=True))


def test_profile_counts_calls_that_raise():
    flag = {"other": False}

    def f(x):
        y = (x * 2).sin()
        if flag["other"]:
            y = y.cos()
        return y + 1

    traced = tracejit.trace(f, profiling=True)
    x = torch.randn(64)
    raised = 0
    for i in range(8):
        flag["other"] = i in (3, 5)
        try:
            traced(x)
        except tracejit.TraceMismatchError:
            raised += 1
    assert raised == 2
    report = traced.get_profile()
    summary = report["summary"]
    assert summary["calls"] + summary["recording_calls"] == 8
    assert max(row["calls"] for row in report["rows"]) <= summary["calls"]


def _mse_step(x, y, *, model, opt):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_profile_keeps_a_rerecording_call_apart_from_replays():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # its state is made by the first step: a re-record
    traced = tracejit.trace(_mse_step, profiling=True)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(6):
        traced(x, y, model=model, opt=opt)
    stats, summary = traced.stats, traced.get_profile()["summary"]
    assert stats.rerecords == 1
    assert summary["recording_calls"] == stats.records + stats.rerecords == 2
    assert summary["calls"] == 4


def test_a_host_free_step_called_inside_another_traced_functions_excluded_block_runs_host_free():
    """The outer call's own global module hook looked like the user's to the inner guards."""
    torch.manual_seed(0)
    body, head = nn.Linear(4, 8), nn.Linear(8, 4)
    eager_head = copy.deepcopy(head)
    opt = torch.optim.Adam(head.parameters(), lr=0.01, fused=True)
    eager_opt = torch.optim.Adam(eager_head.parameters(), lr=0.01, fused=True)
    inner = tracejit.trace(_mse_step, without_host=True)

    @tracejit.trace
    def outer(x, y):
        h = body(x)
        with tracejit.exclude_from_trace():
            loss = inner(h.detach(), y, model=head, opt=opt)
        return h * 1, loss

    for i in range(8):
        generator = torch.Generator().manual_seed(i)
        x, y = torch.randn(5, 4, generator=generator), torch.randn(5, 4, generator=generator)
        _, loss = outer(x, y)
        want = _mse_step(body(x).detach(), y, model=eager_head, opt=eager_opt)
        assert torch.equal(loss, want)
        for p, q in zip(head.parameters(), eager_head.parameters()):
            assert torch.equal(p, q)
    assert inner.stats.host_free_misses == 0
    assert inner.stats.host_free_calls >= 5


def test_host_free_calls_beside_another_threads_own_hooks_do_not_raise():
    """The guards on torch.nn's global hooks iterated the hook dict while another thread's traced
    call added and removed tracejit's own hooks: 'OrderedDict mutated during iteration'."""
    import sys
    import time

    from tracejit.record.own_hooks import own, remove_own

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    traced = tracejit.trace(lambda x, *, model: model(x), without_host=True)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            traced(x, model=model)
    stop, errors = time.time() + 2.0, []

    def other_traced_calls():  # as record/module_calls.py does around each recording call
        noop = lambda *args: None  # noqa: E731
        kept = [own(nn.modules.module.register_module_forward_pre_hook(noop)) for _ in range(64)]
        while time.time() < stop and not errors:
            remove_own(own(nn.modules.module.register_module_forward_pre_hook(noop)))
        for handle in kept:
            remove_own(handle)

    def user_calls():
        with torch.no_grad():
            while time.time() < stop and not errors:
                try:
                    assert torch.equal(traced(x, model=model), model(x))
                except RuntimeError as error:
                    errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=other_traced_calls), threading.Thread(target=user_calls)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[0]
    assert traced.stats.host_free_calls > 100  # tracejit's own hooks did not turn the fast path off


@pytest.mark.parametrize("options", [{}, {"without_host": True}])
def test_the_attention_backends_the_caller_enables_select_a_trace_of_their_own(options):
    # a call under sdpa_kernel(MATH) ran the recorded CPU flash kernel (other rounding)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)

    def attend(q, k):
        return torch.nn.functional.scaled_dot_product_attention(q, k, k)

    traced = tracejit.trace(attend, backend="aten", **options)
    for _ in range(3):
        assert torch.equal(traced(q, k), attend(q, k))
    for _ in range(3):
        with sdpa_kernel(SDPBackend.MATH):
            assert torch.equal(traced(q, k), attend(q, k))
    assert torch.equal(traced(q, k), attend(q, k))
    assert traced.stats.records == 2


def _saved_hooks_step(x, *, w):
    loss = torch.tanh(x * w).sum()
    loss.backward()
    g = w.grad.clone()
    w.grad = None
    return g


def _compressing_hooks():  # activations kept as bfloat16
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.to(torch.bfloat16), lambda t: t.float())


@pytest.mark.parametrize("options", [{}, {"without_host": True}])
def test_saved_tensors_hooks_around_a_call_are_run_as_eager_runs_them(options):
    # a hooked call replayed the program recorded without the hooks (gradients 0.01 off)
    torch.manual_seed(0)
    w = torch.randn(16, requires_grad=True)
    x = torch.randn(16) * 3 + 0.1
    traced = tracejit.trace(_saved_hooks_step, backend="aten", **options)
    hooked = (3,) if options else (3, 4)  # without the host a second hooked call is refused (below)
    for call in range(6):
        if call in hooked:
            with _compressing_hooks():
                want, got = _saved_hooks_step(x, w=w), traced(x, w=w)
        else:
            want, got = _saved_hooks_step(x, w=w), traced(x, w=w)
        assert torch.equal(want, got), call
    assert traced.stats.records == 2


def test_a_call_without_the_host_under_saved_tensors_hooks_is_refused():
    torch.manual_seed(0)
    w = torch.randn(16, requires_grad=True)
    x = torch.randn(16)
    traced = tracejit.trace(_saved_hooks_step, without_host=True)
    with _compressing_hooks():
        traced(x, w=w)
        with pytest.raises(tracejit.HostDependencyError, match="saved_tensors_hooks"):
            traced(x, w=w)


def test_forward_mode_ad_and_torch_func_transforms_run_the_call_eagerly():
    # a dual input came back without its tangent; jvp raised an unclear RuntimeError
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    w = torch.randn(4)

    def f(x):
        return torch.tanh(x * w)

    x, v = torch.randn(2, 4), torch.randn(2, 4)
    for options in ({}, {"without_host": True}, {"backend": "aten"}):
        traced = tracejit.trace(f, **options)
        for _ in range(3):
            assert torch.equal(traced(x), f(x))
        with pytest.warns(tracejit.ReplayLevelWarning, match="forward-mode AD"):
            with fwAD.dual_level():
                want = fwAD.unpack_dual(f(fwAD.make_dual(x, v))).tangent
                got = fwAD.unpack_dual(traced(fwAD.make_dual(x, v))).tangent
        assert got is not None and torch.equal(want, got)
        out, tangent = torch.func.jvp(traced, (x,), (v,))
        want_out, want_tangent = torch.func.jvp(f, (x,), (v,))
        assert torch.equal(out, want_out) and torch.equal(tangent, want_tangent)
        assert torch.equal(torch.func.vmap(traced)(x), torch.func.vmap(f)(x))
        assert traced.stats.eager_calls == 3
        assert torch.equal(traced(x), f(x)) and traced.stats.records == 1


class _Doubled(nn.Module):
    def forward(self, weight):
        return weight * 2


def test_calls_inside_the_callers_parametrize_cached_run_eagerly():
    # inside cached() a parametrized weight is computed by the block's first access and read from
    # the cache after: which ops a call dispatches depends on the calls before it in the block
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    parametrize.register_parametrization(model, "weight", _Doubled())

    def infer(x):
        with torch.no_grad():
            return model(x) + model(x)

    def infer_cached(x):  # cached() entered inside the function: recorded with it
        with parametrize.cached():
            return infer(x)

    x = torch.randn(2, 4)
    traced, traced_inside = tracejit.trace(infer), tracejit.trace(infer_cached, without_host=True)
    for call in range(6):
        if call % 2:
            with parametrize.cached():
                model.weight  # noqa: B018 - the block's first access, before the call
                assert torch.equal(traced(x), infer(x))
        else:
            assert torch.equal(traced(x), infer(x))
        assert torch.equal(traced_inside(x), infer_cached(x))
    assert traced.stats.eager_calls == 3 and traced.stats.records == 1 and traced.stats.replays >= 2
    assert traced_inside.stats.host_free_calls >= 4
