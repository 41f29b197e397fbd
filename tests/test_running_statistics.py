"""Batch norm in training updates its running statistics in place, although aten's schema for
`native_batch_norm` does not declare the write. A traced call that recalibrates the statistics
and ignores the output (a common step before evaluation) once lost the update: the op looked
pure and dead, so every later call left running_mean and running_var as they were."""

import copy

import pytest
import torch
import torch.nn as nn

import tracejit


def recalibrate(x, *, model):
    with torch.no_grad():
        model(x)


def conv_bn(momentum=0.1):
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU())


def same_statistics(a: nn.Module, b: nn.Module) -> None:
    buffers_a, buffers_b = dict(a.named_buffers()), dict(b.named_buffers())
    assert buffers_a.keys() == buffers_b.keys()
    for name, buffer in buffers_a.items():
        assert torch.equal(buffer, buffers_b[name]), name


def served_by_the_program(traced, without_host: bool) -> None:
    stats = traced.stats
    assert stats.records == 1, stats
    if without_host:
        assert stats.host_free_calls == stats.calls - 1, stats
    else:
        assert stats.api_replays >= 2 and stats.api_fallbacks == 0, stats


MODES = {
    "checked-aten": {"backend": "aten"},
    "checked-c": {"backend": "c"},
    "without_host": {"without_host": True, "backend": "aten"},
    "without_host-c": {"without_host": True, "backend": "c"},
    "symbolic": {"symbolic": True, "backend": "aten"},
    "symbolic-without_host": {"symbolic": True, "without_host": True, "backend": "aten"},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_recalibration_whose_output_is_unused_updates_the_statistics(mode):
    eager = conv_bn()
    model = copy.deepcopy(eager)
    traced = tracejit.trace(recalibrate, **MODES[mode])
    for _ in range(5):
        x = torch.randn(2, 3, 8, 8)
        recalibrate(x, model=eager)
        traced(x, model=model)
        same_statistics(eager, model)
    served_by_the_program(traced, MODES[mode].get("without_host", False))
    assert eager[1].num_batches_tracked.item() == 5


@pytest.mark.filterwarnings("ignore::tracejit.ReplayLevelWarning")
def test_cumulative_average_statistics_in_checked_replay():
    # momentum=None: the factor is 1 / num_batches_tracked, a host read every call, and a number
    # that changes every call (the API level matches it, so the calls run at the aten level)
    eager = conv_bn(momentum=None)
    model = copy.deepcopy(eager)
    traced = tracejit.trace(recalibrate, backend="aten")
    for _ in range(5):
        x = torch.randn(2, 3, 8, 8)
        recalibrate(x, model=eager)
        traced(x, model=model)
        same_statistics(eager, model)
    assert traced.stats.records == 1 and traced.stats.checked_replays == 4


def test_training_step_keeps_the_statistics_and_the_output():
    # the usual case, where the output is used, stays as it was: statistics and values as eager's
    def step(x, *, model, opt):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    eager = conv_bn()
    model = copy.deepcopy(eager)
    opt_a = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model.parameters(), lr=0.1)
    traced = tracejit.trace(step, without_host=True, backend="aten")
    for _ in range(5):
        x = torch.randn(2, 3, 8, 8)
        assert torch.equal(traced(x, model=model, opt=opt_b), step(x, model=eager, opt=opt_a))
        same_statistics(eager, model)
        for p, q in zip(eager.parameters(), model.parameters()):
            assert torch.equal(p, q)
    served_by_the_program(traced, True)


def test_eval_mode_batch_norm_writes_nothing():
    eager = conv_bn().eval()
    model = copy.deepcopy(eager)
    traced = tracejit.trace(recalibrate, without_host=True, backend="aten")
    for _ in range(3):
        x = torch.randn(2, 3, 8, 8)
        recalibrate(x, model=eager)
        traced(x, model=model)
    same_statistics(eager, model)
    assert traced.records[0].ops, "the call was recorded"
    assert not any(op.mutated for op in traced.records[0].ops if "batch_norm" in str(op.op))
