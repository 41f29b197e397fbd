"""Values torch reads on the host in C++ (record/modes.py HIDDEN_READS): `tensor_split` with a tensor of
split points, `pad_packed_sequence` and the RNNs over a PackedSequence read a CPU tensor through its data
pointer, with no op for the read, and choose their slices from its values; `_pack_padded_sequence` makes
sum(lengths) rows. The API level matched such calls as a whole and returned the recorded slices for other
values, and without_host ran the recorded slices from its first call on: wrong values, no error."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import tracejit

pytestmark = pytest.mark.filterwarnings("ignore::tracejit.ReplayLevelWarning")

def _split_sums(x, idx):
    a, b, c = torch.tensor_split(x * 2, idx)
    return a.sum(0), b.sum(0), c.sum(0)


def _method_split_sums(x, idx):
    a, b, c = (x * 2).tensor_split(idx)
    return a.sum(0), b.sum(0), c.sum(0)


def _equal(a, b) -> bool:
    return all(p.shape == q.shape and torch.equal(p, q) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("function", [_split_sums, _method_split_sums], ids=["torch", "method"])
def test_tensor_split_points_that_change_raise_instead_of_returning_the_recorded_slices(function):
    traced = tracejit.trace(function)
    x = torch.randn(8, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            assert _equal(traced(x, torch.tensor([2, 5])), function(x, torch.tensor([2, 5])))
    # the checked calls stayed at the aten level, which compares the slices each call dispatches
    assert traced.stats.checked_replays == 3 and traced.stats.api_replays == 0
    refusals = [str(w.message) for w in caught if issubclass(w.category, tracejit.ReplayLevelWarning)]
    assert any("tensor_split() reads its tensor of split points" in m and "test_hidden_reads.py" in m
               for m in refusals), refusals
    with pytest.raises(tracejit.TraceMismatchError, match="aten.slice.Tensor got different non-tensor arguments"):
        traced(x, torch.tensor([1, 5]))
    assert _equal(traced(x, torch.tensor([2, 5])), function(x, torch.tensor([2, 5])))


def test_without_host_refuses_tensor_split_with_a_tensor_of_split_points():
    traced = tracejit.trace(_split_sums, without_host=True)
    x = torch.randn(8, 3)
    assert _equal(traced(x, torch.tensor([2, 5])), _split_sums(x, torch.tensor([2, 5])))
    with pytest.raises(tracejit.HostDependencyError,
                       match=r"(?s)torch.tensor_split\(\) reads its tensor of split points \(t1\) at "
                             r"test_hidden_reads.py:\d+ in _split_sums"):
        traced(x, torch.tensor([1, 5]))
    assert traced.stats.host_free_calls == 0


def test_split_points_as_python_ints_are_no_hidden_read():
    def split(x):
        a, b = torch.tensor_split(x * 2, [3])
        return a.sum(0), b.sum(0)

    traced = tracejit.trace(split, without_host=True)
    x = torch.randn(8, 3)
    for _ in range(3):
        assert _equal(traced(x), split(x))
    assert traced.stats.host_free_calls >= 1


def _halves_swapped_step(x, *, model, opt):
    h = model(x)
    a, b = h.tensor_split(2, dim=1)  # the method, with int sections: no hidden read
    loss = torch.cat([b, a], 1).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_the_tensor_split_method_with_int_sections_keeps_the_api_level():
    """The hook on Tensor.tensor_split was what the API record noted as the call (torch looks the
    method up on torch.Tensor while the hook is installed), and checked calls, which run without
    hooks, met TensorBase.tensor_split there: every call fell back to the aten level."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Linear(4, 6)
        models.append((model, torch.optim.Adam(model.parameters(), lr=0.1)))
    traced = tracejit.trace(_halves_swapped_step)
    for _ in range(6):
        x = torch.randn(3, 4)
        want = _halves_swapped_step(x, model=models[0][0], opt=models[0][1])
        assert torch.equal(traced(x, model=models[1][0], opt=models[1][1]), want)
        assert all(torch.equal(p, q) for p, q in zip(models[0][0].parameters(), models[1][0].parameters()))
    assert traced.stats.api_replays >= 2 and traced.stats.api_fallbacks == 0, traced.stats


def test_the_hooks_are_torch_functions_again_after_a_call():
    tracejit.trace(_split_sums)(torch.randn(8, 3), torch.tensor([2, 5]))
    assert torch.tensor_split is torch._C._VariableFunctions.tensor_split
    assert "tensor_split" not in torch.Tensor.__dict__
    assert "_pad_packed_sequence" not in torch._VF.__dict__ and "lstm" not in torch._VF.__dict__


def _roundtrip(x, lengths):
    packed = pack_padded_sequence(x * 2, lengths, batch_first=True)
    return pad_packed_sequence(packed, batch_first=True, total_length=x.shape[1])[0]


def test_pack_and_pad_follow_the_lengths_or_raise():
    traced = tracejit.trace(_roundtrip)
    x = torch.randn(3, 5, 4)
    for lengths in ([5, 3, 2], [5, 3, 2], [5, 3, 2], [4, 4, 2], [2, 1, 1], [5, 3, 2], [2, 1, 1]):
        assert torch.equal(traced(x, torch.tensor(lengths)), _roundtrip(x, torch.tensor(lengths))), lengths
    # a new total is a new size of the packed data (a variant); the same total with other lengths
    # changes the slices pad_packed_sequence dispatches
    assert traced.stats.api_replays == 0 and traced.stats.shape_variants == 2
    with pytest.raises(tracejit.TraceMismatchError, match="aten.slice.Tensor got different non-tensor arguments"):
        traced(x, torch.tensor([5, 4, 1]))


def _masked_loss_step(x, lengths, y, *, w):
    logits = pack_padded_sequence(x @ w, lengths, batch_first=True).data
    target = pack_padded_sequence(y, lengths, batch_first=True).data
    loss = F.cross_entropy(logits, target)
    loss.backward()
    return loss


@pytest.mark.parametrize("without_host", [False, True])
def test_packed_data_as_a_masked_loss_trains_as_eager_or_refuses(without_host):
    torch.manual_seed(0)
    x, y, w0 = torch.randn(3, 5, 4), torch.randint(0, 3, (3, 5)), torch.randn(4, 3)
    traced = tracejit.trace(_masked_loss_step, without_host=without_host)
    for i, lengths in enumerate([[5, 3, 2]] * 3 + [[4, 4, 1], [2, 1, 1], [4, 4, 1]]):
        w_eager, w_traced = w0.clone().requires_grad_(), w0.clone().requires_grad_()
        want = _masked_loss_step(x, torch.tensor(lengths), y, w=w_eager)
        if without_host and i >= 2:
            with pytest.raises(tracejit.HostDependencyError, match="aten._pack_padded_sequence.default"):
                traced(x, torch.tensor(lengths), y, w=w_traced)
            continue
        assert torch.equal(traced(x, torch.tensor(lengths), y, w=w_traced), want)
        assert torch.equal(w_traced.grad, w_eager.grad), lengths
    if not without_host:
        assert traced.stats.checked_replays >= 3 and traced.stats.api_replays == 0


def test_lstm_over_a_packed_input_stays_at_the_aten_level():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 3)
    reference = copy.deepcopy(lstm)

    def forward(data, batch_sizes, *, model):
        out, _ = model(PackedSequence(data * 2, batch_sizes))
        return out.data.sum(0)

    traced = tracejit.trace(forward)
    x = torch.randn(3, 5, 4)
    packed = pack_padded_sequence(x, torch.tensor([5, 3, 2]), batch_first=True)
    for _ in range(4):
        assert torch.equal(traced(packed.data, packed.batch_sizes, model=lstm),
                           forward(packed.data, packed.batch_sizes, model=reference))
    assert traced.stats.checked_replays == 3 and traced.stats.api_replays == 0
    other = pack_padded_sequence(x, torch.tensor([5, 4, 1]), batch_first=True)  # the same total
    with pytest.raises(tracejit.TraceMismatchError):
        traced(other.data, other.batch_sizes, model=lstm)


def test_an_rnn_over_packed_data_called_directly_stays_at_the_aten_level():
    # nn.RNN's forward reads batch_sizes[0] with int() (a host read tracejit sees); torch._VF.rnn_tanh
    # itself reads every batch size in C++
    torch.manual_seed(0)
    params = [torch.randn(3, 4), torch.randn(3, 3), torch.randn(3), torch.randn(3)]

    def rnn(data, batch_sizes, h0):
        out, _ = torch._VF.rnn_tanh(data * 2, batch_sizes, h0, params, True, 1, 0.0, False, False)
        return out

    traced = tracejit.trace(rnn)
    x, h0 = torch.randn(3, 5, 4), torch.zeros(1, 3, 3)
    packed = pack_padded_sequence(x, torch.tensor([5, 3, 2]), batch_first=True)
    for _ in range(3):
        assert torch.equal(traced(packed.data, packed.batch_sizes, h0), rnn(packed.data, packed.batch_sizes, h0))
    assert traced.stats.checked_replays == 2 and traced.stats.api_replays == 0
    other = pack_padded_sequence(x, torch.tensor([5, 4, 1]), batch_first=True)
    with pytest.raises(tracejit.TraceMismatchError):
        traced(other.data, other.batch_sizes, h0)


def test_symbolic_recordings_refuse_a_hidden_read_of_a_value_they_do_not_have():
    x = torch.randn(8, 3)
    with pytest.raises(tracejit.SymbolicTraceError, match=r"tensor_split\(\) reads its tensor of split points"):
        tracejit.trace(_split_sums, symbolic_shape=True)(x, torch.tensor([2, 5]))

    def computed_points(x, idx):
        return _method_split_sums(x, idx * 1)  # a placeholder while symbolic=True records

    with pytest.raises(tracejit.SymbolicTraceError, match="is not computed yet"):
        tracejit.trace(computed_points, symbolic=True)(x, torch.tensor([2, 5]))
    # an input's values are real there: the record notes the read, and checked calls compare the slices
    traced = tracejit.trace(_split_sums, symbolic=True)
    for _ in range(3):
        assert _equal(traced(x, torch.tensor([2, 5])), _split_sums(x, torch.tensor([2, 5])))
    assert traced.stats.api_replays == 0
    with pytest.raises(tracejit.TraceMismatchError):
        traced(x, torch.tensor([1, 5]))
