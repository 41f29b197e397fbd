"""A tensor subclass's __torch_function__ decides which ops its calls dispatch: an input of
another Python type than recorded is another trace, never the recorded program."""

import pytest
import torch

import tracejit

MODES = [{}, {"backend": "aten"}, {"without_host": True}, {"symbolic": True}]


class PlusHundredSum(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        if func is torch.Tensor.sum:
            with torch._C.DisableTorchFunctionSubclass():
                return (result + 100).as_subclass(cls)
        return result


class Marked(torch.Tensor):
    pass


def scaled_sum(x):
    return (x * 3).sum()


def plain(data):
    return data.clone()


def marked(data):
    return data.clone().as_subclass(Marked)


def plus_hundred(data):
    return data.clone().as_subclass(PlusHundredSum)


def _replays(traced):
    stats = traced.stats
    return stats.checked_replays + stats.host_free_calls


@pytest.mark.parametrize("options", MODES, ids=str)
@pytest.mark.parametrize("first, then", [(plain, plus_hundred), (plus_hundred, plain), (plain, marked),
                                          (marked, plus_hundred)], ids=lambda f: f.__name__)
def test_an_input_of_another_tensor_type_than_recorded_computes_as_eager(options, first, then):
    traced = tracejit.trace(scaled_sum, **options)
    data = torch.arange(4.0)
    for _ in range(3):
        got = traced(first(data))
        assert type(got) is type(scaled_sum(first(data)))
        assert torch.equal(got.as_subclass(torch.Tensor), scaled_sum(first(data)).as_subclass(torch.Tensor))
    assert _replays(traced) == 2, traced.stats  # the recorded program ran
    for _ in range(3):
        want, got = scaled_sum(then(data)), traced(then(data))
        assert type(got) is type(want)
        assert torch.equal(got.as_subclass(torch.Tensor), want.as_subclass(torch.Tensor)), (got, want)
    assert traced.stats.records == 2, traced.stats  # a trace of its own
