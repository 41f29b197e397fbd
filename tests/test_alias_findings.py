"""Fused kernels and aliasing: inputs that overlap in memory, `_foreach_` lists whose lanes alias,
and a group's placeholder that the host turns into a leaf requiring grad. Each case is compared
with eager exactly over several calls with fresh inputs; where nothing aliases, fusion still runs."""

import pytest
import torch
from fused_support import fused_nodes

import tracejit

pytestmark = pytest.mark.skipif(tracejit.backends.resolve_backend("c") is None, reason="no C compiler")

CALLS = 4


def add_doubled(a, b):
    t = b * 2
    a.add_(t)  # eager computes all of t before writing a
    return a


def copy_doubled_plus_one(a, b):
    a.copy_(b * 2 + 1)
    return a


def shifted_views(base):
    return base[1:], base[:-1]


def matrix_and_transpose(base):
    return base, base.t()


def disjoint_halves(base):
    return base[:4], base[4:]


def separate_tensors(base):
    return base[:4].clone(), base[4:].clone()


def _assert_matches_eager(function, make_inputs, make_base, without_host, calls=CALLS):
    """Run `function` eagerly and traced on equal fresh buffers; every buffer must match exactly."""
    traced = tracejit.trace(function, backend="c", without_host=without_host)
    for call in range(calls):
        base = make_base(call)
        eager_base, traced_base = base.clone(), base.clone()
        eager_inputs, traced_inputs = make_inputs(eager_base), make_inputs(traced_base)
        function(*eager_inputs)
        traced(*traced_inputs)
        assert torch.equal(traced_base, eager_base), f"call {call}: {traced_base} vs eager {eager_base}"
        for got, want in zip(traced_inputs, eager_inputs, strict=True):
            assert torch.equal(got, want), f"call {call}"
    return traced


def _vector(call):
    return torch.arange(8.0) + call


def _matrix(call):
    return torch.arange(25.0).view(5, 5) + call


@pytest.mark.parametrize("without_host", [False, True])
def test_inputs_overlapping_by_a_shift_are_not_read_after_the_kernel_wrote_them(without_host):
    _assert_matches_eager(add_doubled, shifted_views, _vector, without_host)


@pytest.mark.parametrize("without_host", [False, True])
def test_a_matrix_written_from_its_own_transpose_matches_eager(without_host):
    _assert_matches_eager(copy_doubled_plus_one, matrix_and_transpose, _matrix, without_host)


@pytest.mark.parametrize("make_inputs", [disjoint_halves, separate_tensors])
@pytest.mark.parametrize("without_host", [False, True])
def test_inputs_that_do_not_overlap_still_fuse_the_write(make_inputs, without_host):
    traced = _assert_matches_eager(add_doubled, make_inputs, _vector, without_host)
    assert [len(n.members) for n in fused_nodes(traced)] == [2]  # b * 2 and a.add_ in one kernel


def test_a_trace_recorded_without_overlap_is_not_reused_for_overlapping_inputs():
    traced = tracejit.trace(add_doubled, backend="c")
    for call in range(CALLS):  # the fused trace: separate tensors
        traced(*separate_tensors(_vector(call)))
    assert len(traced._entries()) == 1 and fused_nodes(traced)
    for call in range(CALLS):
        eager_base, traced_base = _vector(call), _vector(call)
        add_doubled(*shifted_views(eager_base))
        traced(*shifted_views(traced_base))
        assert torch.equal(traced_base, eager_base), f"call {call}"
    assert len(traced._entries()) == 2  # the overlapping call selected a trace of its own


def scale_then_shift_same_list_twice(a):
    torch._foreach_mul_([a, a], 2.0)  # eager: a * 4, then + 2
    torch._foreach_add_([a, a], 1.0)
    return a


def cross_lane_update(a, b):
    torch._foreach_add_([a, b], [b, a])  # a += b, then b += the new a
    torch._foreach_mul_([a, b], 3.0)
    return a, b


def independent_lanes(a, b):
    torch._foreach_mul_([a, b], 2.0)
    torch._foreach_add_([a, b], [b * 0 + 1, a * 0 + 1])
    return a, b


def _assert_foreach_matches_eager(function, arity, without_host):
    traced = tracejit.trace(function, backend="c", without_host=without_host)
    for call in range(CALLS):
        inputs = [torch.arange(1.0, 5.0) * (k + 1) + call for k in range(arity)]
        eager_inputs, traced_inputs = [t.clone() for t in inputs], [t.clone() for t in inputs]
        function(*eager_inputs)
        traced(*traced_inputs)
        for got, want in zip(traced_inputs, eager_inputs, strict=True):
            assert torch.equal(got, want), f"call {call}: {got} vs eager {want}"
    return traced


@pytest.mark.parametrize("without_host", [False, True])
def test_foreach_chain_over_the_same_tensor_twice_matches_eager(without_host):
    _assert_foreach_matches_eager(scale_then_shift_same_list_twice, 1, without_host)


@pytest.mark.parametrize("without_host", [False, True])
def test_foreach_chain_where_one_lane_reads_what_another_writes_matches_eager(without_host):
    _assert_foreach_matches_eager(cross_lane_update, 2, without_host)


def test_foreach_chain_over_independent_tensors_is_still_one_kernel():
    def chain(a, b):
        torch._foreach_mul_([a, b], 2.0)
        torch._foreach_add_([a, b], 1.0)
        return a, b

    traced = _assert_foreach_matches_eager(chain, 2, without_host=False)
    assert [(n.target.lanes, len(n.members)) for n in fused_nodes(traced)] == [(2, 2)]


def leaf_made_from_a_group_member(x):
    x = (x * 1.0).requires_grad_()  # the product is a member of the relu's group
    y = torch.relu(x)
    y.sum().backward()
    return y.detach(), x.grad  # not x: the kernel then does not store the product, the host holds it


@pytest.mark.filterwarnings("ignore::tracejit.ReplayLevelWarning")  # requires_grad_ keeps it at the aten level
@pytest.mark.parametrize("backend", ["c", "reference"])
def test_a_group_value_the_host_makes_a_leaf_requiring_grad_is_filled_like_eager(backend):
    traced = tracejit.trace(leaf_made_from_a_group_member, backend=backend)
    for call in range(CALLS):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(call))
        want = leaf_made_from_a_group_member(x.clone())
        got = traced(x.clone())
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"call {call}"
            assert (g.requires_grad, g.is_leaf) == (w.requires_grad, w.is_leaf)
    assert fused_nodes(traced)
    assert sum(entry.program.groups_fired for entry in traced._entries()) > 0  # fused kernels ran


def _flat_grads_step(*, w1, w2, flat):
    w1.grad.mul_(2)
    a = flat.sum()
    w2.grad.mul_(2)
    return torch.stack([a, flat.sum()])  # eager: the second sum sees w2's doubling


def _flat_grads():
    w1, w2 = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    flat = torch.ones(4)
    w1.grad, w2.grad = flat[:2], flat[2:]  # gradients in one flat buffer, which the call also takes
    return {"w1": w1, "w2": w2, "flat": flat}


@pytest.mark.parametrize("backend", ["aten", "c"])
@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_an_external_in_the_memory_of_an_input_is_a_view_of_it(without_host, backend):
    # a parameter's .grad is a view of a flat buffer the call takes as a keyword tensor: the passes
    # took them for two storages, and CSE merged the two sums around the write (was [24, 24])
    if backend == "c" and tracejit.backends.resolve_backend("c") is None:
        pytest.skip("no C compiler")
    traced_state, eager_state = _flat_grads(), _flat_grads()
    traced = tracejit.trace(_flat_grads_step, backend=backend, without_host=without_host)
    for i in range(5):
        assert torch.equal(traced(**traced_state), _flat_grads_step(**eager_state)), i
        assert torch.equal(traced_state["flat"], eager_state["flat"]), i
    served = traced.stats.host_free_calls if without_host else traced.stats.api_replays
    assert served >= 2, traced.stats
