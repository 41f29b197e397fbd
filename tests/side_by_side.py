"""Eager against traced, call by call: outputs and every piece of state compared bitwise, and
proof that the JIT ran (a helper that passes with `tracejit.trace` replaced by the identity proves
nothing: tests/test_helpers_can_fail.py checks that these fail then)."""

import copy

import torch
import torch.nn as nn

from tracejit.ir import Op
from tracejit.trace import trace as TracedFunction  # bound at import: a test may replace tracejit.trace


def assert_replayed(traced, calls: int, records: int = 1, fused: bool | None = None) -> None:
    """The JIT ran: `records` calls recorded, each trace re-recorded at most once (lazy optimizer
    state), and every other call was served from a trace, checked or host-free (without_host: some
    without the function). Where the checked program has fused nodes, the checked calls at the aten
    level ran fused kernels. With `fused=True` a fused program must exist, and a host-free program
    that served calls must hold fused nodes."""
    stats = getattr(traced, "stats", None)
    assert isinstance(traced, TracedFunction) and stats is not None, f"{traced!r} is not a traced function"
    assert stats.calls == calls, f"{stats.calls} calls counted, {calls} made: {stats}"
    assert stats.records == records, f"{stats.records} calls recorded, expected {records}: {stats}"
    assert stats.rerecords <= records, f"a trace re-recorded more than once: {stats}"
    assert stats.replays == calls - records - stats.rerecords, f"calls neither recorded nor replayed: {stats}"
    assert stats.replays >= 1 or calls <= records + stats.rerecords, f"nothing was replayed: {stats}"
    if traced.options.without_host and stats.replays:
        assert stats.host_free_calls, f"without_host, yet every replay ran the function: {stats}"
    entries = traced._entries()
    checked_fused = any(n.op is Op.FUSED for entry in entries for n in entry.program.graph.nodes)
    host_free_fused = any(n.op is Op.FUSED for entry in entries if entry.host_free is not None
                          for n in entry.host_free.program.graph.nodes)
    if fused:
        assert checked_fused or host_free_fused, f"no fused node in any program (backend {traced.options.backend!r})"
    fired = sum(entry.program.groups_fired for entry in entries)
    if checked_fused and stats.checked_replays > stats.api_replays:
        assert fired, f"the checked calls at the aten level ran no fused kernel: {stats}"
    if fused and stats.host_free_calls + stats.api_replays:
        assert host_free_fused, f"the host-free program that served calls has no fused node: {stats}"


def same_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    return a == b


def state_of(obj) -> list:
    if isinstance(obj, nn.Module):
        return ([t.detach() for t in obj.state_dict().values()]
                + [p.grad for p in obj.parameters()] + [p.requires_grad for p in obj.parameters()])
    if isinstance(obj, torch.optim.Optimizer):
        return [v for s in obj.state_dict()["state"].values() for v in s.values()]
    return [obj]


def side_by_side(traced_fn, fn, objects: dict, inputs, steps: int, between=None, records: int = 1,
                 fused: bool | None = None):
    """Run fn eagerly on `objects` and traced on a deep copy; compare outputs and state after every
    call; then assert the JIT ran (see assert_replayed for `records` and `fused`)."""
    twins = copy.deepcopy(objects)  # one deepcopy: optimizers keep pointing at the copied parameters
    for i in range(steps):
        if between is not None:
            between(i, objects)
            between(i, twins)
        args = inputs(i)
        torch.manual_seed(100 + i)
        want = fn(*[a.clone() for a in args], **objects)
        torch.manual_seed(100 + i)
        got = traced_fn(*[a.clone() for a in args], **twins)
        assert same_tree(got, want), f"call {i}: {got} vs {want}"
        for name, obj in objects.items():
            assert same_tree(state_of(twins[name]), state_of(obj)), f"call {i}: {name} differs"
    assert_replayed(traced_fn, steps, records, fused)
    return twins


def step_of(loss_fn):
    def step(*args, model, opt, **kwargs):
        loss = loss_fn(model, *args, **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def mse(model, x):
    return model(x).square().mean()


def seeded(*shape, kind=torch.randn):
    return lambda i: (kind(*shape, generator=torch.Generator().manual_seed(i)),)
