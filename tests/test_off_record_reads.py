"""Host reads that only some calls make (`loss.item()` logged every N steps) stay at the torch API
level: a read the record does not have is answered with the value at that point, computed from
the record as a recorded read is, and recorded reads a call skips are passed over
(runtime/api_replay.py ApiChecker._off_record). Every test compares with eager after each step and
reads `stats.api_fallbacks` to prove the call was not sent to the aten level."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import assert_same_state, batch, make_model

import tracejit


def logging_step(log, every, where="end"):
    """A training step that logs its loss and gradient norm on every `every`-th call (`it`)."""
    def step(x, y, *, model, opt, it):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if where == "middle" and it % every == 0:
            log.append((it, loss.item(), norm.item()))
        opt.step()
        opt.zero_grad()
        if where == "end" and it % every == 0:
            log.append((it, loss.item(), float(norm)))
        return loss.detach()
    return step


def twins(optimizer=lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False)):
    models = [make_model("mlp"), make_model("mlp")]
    models[1].load_state_dict(models[0].state_dict())
    return [(m, optimizer(m.parameters())) for m in models]


def run(traced, eager, pairs, calls, exact=True, first=0):
    (model_a, opt_a), (model_b, opt_b) = pairs
    for it in range(first, first + calls):
        x, y = batch("mlp", it)
        got, want = traced(x, y, model=model_b, opt=opt_b, it=it), eager(x, y, model=model_a, opt=opt_a, it=it)
        assert torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-5, atol=1e-6), it
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=exact)


@pytest.mark.parametrize("first", [0, 1], ids=["logged_when_recorded", "quiet_when_recorded"])
@pytest.mark.parametrize("where", ["end", "middle"])
def test_periodic_logging_stays_at_the_api_level_with_eager_values(first, where):
    traced_log, eager_log = [], []
    traced = tracejit.trace(logging_step(traced_log, 3, where), backend="aten")
    run(traced, logging_step(eager_log, 3, where), twins(), 12, first=first)
    assert traced_log == eager_log and len(eager_log) == 4  # the logged numbers, bit for bit
    stats = traced.stats
    assert stats.api_fallbacks == 0 and stats.api_replays >= 8, stats
    # the optimizer's step and zero_grad are answered whole on logged and quiet calls alike
    assert stats.optimizer_stand_ins == 2 * stats.api_replays and stats.function_stand_ins == stats.api_replays


def test_periodic_logging_on_the_compiled_backend_logs_eager_values():
    # the read is computed from the record with torch's ops, whatever the kernels compute later
    traced_log, eager_log = [], []
    traced = tracejit.trace(logging_step(traced_log, 4), backend="c")
    run(traced, logging_step(eager_log, 4), twins(lambda p: torch.optim.Adam(p, lr=1e-2, fused=True)), 12,
        exact=False, first=1)
    assert [entry[0] for entry in traced_log] == [4, 8, 12]
    for (_, loss_t, norm_t), (_, loss_e, norm_e) in zip(traced_log, eager_log, strict=True):
        assert loss_t == pytest.approx(loss_e, rel=1e-5) and norm_t == pytest.approx(norm_e, rel=1e-5)
    assert traced.stats.api_fallbacks == 0 and traced.stats.api_replays >= 8


@pytest.mark.parametrize("logged", [0, 3], ids=["logged_when_recorded", "quiet_when_recorded"])
def test_an_off_record_read_behind_dropout_draws_the_masks_the_program_draws(logged):
    # the value depends on a dropout mask the program draws after the function ran: the read
    # draws every random op before it in record order from where the generator stands, and puts
    # the generator back, so the program draws the same masks
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 32), nn.Dropout(0.5), nn.Linear(32, 10))

    def step(x, y, *, model, opt, it, log):
        loss = F.cross_entropy(model(x), y)
        if it % 4 == logged:
            log.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    models = [make(), make()]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    logs = [], []
    traced = tracejit.trace(step, backend="aten")
    for it in range(8):
        x, y = batch("mlp", it)
        torch.manual_seed(100 + it)
        want = step(x, y, model=models[0], opt=opts[0], it=it, log=logs[0])
        torch.manual_seed(100 + it)
        got = traced(x, y, model=models[1], opt=opts[1], it=it, log=logs[1])
        assert torch.equal(got, want), it
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b), it
    assert logs[0] == logs[1] and len(logs[0]) == 2
    assert traced.stats.api_fallbacks == 0 and traced.stats.api_replays >= 5


def test_an_off_record_read_that_takes_another_branch_is_still_checked():
    # the read value decides the path: the calls after it are matched against the record as before
    def step(x, y, *, model, opt, it, threshold):
        loss = F.cross_entropy(model(x), y)
        if it % 2 and loss.item() > threshold:
            loss = loss * 0.5
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    pairs = twins(lambda p: torch.optim.SGD(p, lr=0.1))
    traced = tracejit.trace(step, backend="aten")
    (model_a, opt_a), (model_b, opt_b) = pairs
    for it, threshold in enumerate([1e9] * 6 + [0.0] * 2 + [1e9] * 4):
        x, y = batch("mlp", it)
        want = step(x, y, model=model_a, opt=opt_a, it=it, threshold=threshold)
        try:
            got = traced(x, y, model=model_b, opt=opt_b, it=it, threshold=threshold)
        except tracejit.TraceMismatchError:
            assert threshold == 0.0 and it % 2  # the branch taken: another op sequence, loud
            return
        assert torch.equal(got, want), it
        assert_same_state(model_a, opt_a, model_b, opt_b)
    raise AssertionError("the branch never changed the op sequence")


def _logging_twins(step, calls, first=0):
    """Twin SGD-trained MLPs, eager and traced (aten), `calls` calls logging into a list each; the
    logs must be equal after every call. Returns the traced function."""
    pairs = twins(lambda p: torch.optim.SGD(p, lr=0.1))
    traced = tracejit.trace(step, backend="aten")
    (model_a, opt_a), (model_b, opt_b) = pairs
    for it in range(first, first + calls):
        x, y = batch("mlp", it)
        logs = [], []
        want = step(x, y, model=model_a, opt=opt_a, it=it, log=logs[0])
        got = traced(x, y, model=model_b, opt=opt_b, it=it, log=logs[1])
        assert torch.equal(got, want), it
        assert len(logs[0]) == len(logs[1]) and all(
            (a == b).all() if hasattr(a, "shape") else a == b for a, b in zip(*logs)), (it, logs)
        assert_same_state(model_a, opt_a, model_b, opt_b)
    return traced


def test_reads_of_parameters_and_inputs_on_some_calls_stay_at_the_api_level():
    # review 43 F4: only values the call computed were answered; a parameter or input read
    # every few calls sent those calls to the aten level, and two such periods left it for good
    def step(x, y, *, model, opt, it, log):
        if it % 3 == 1:
            log.append(x.tolist())  # an input
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if it % 3 == 2:
            log.append(model.net[0].bias.tolist())  # after the step: the updated values
        if it % 5 == 4:
            log.append(y.tolist())
        opt.zero_grad()
        return loss.detach()

    traced = _logging_twins(step, 16)
    assert traced.stats.api_replays >= 10, traced.stats


def test_a_recorded_read_after_the_last_call_is_passed_over():
    # review 43 F5: a program noted on a call that logged after zero_grad() ended, on quiet calls,
    # "before call #N item": one fallback
    def step(x, y, *, model, opt, it, log):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if it % 4 == 1:
            log.append(loss.item())
        return loss.detach()

    traced = _logging_twins(step, 12)
    assert traced.stats.api_fallbacks == 0 and traced.stats.api_replays >= 8, traced.stats


def test_a_numpy_array_whose_tensor_is_written_later_is_read_where_it_is():
    # review 43 F1: an array over the reader's copy missed the in-place write after it
    def step(x, y, *, model, opt, it, log):
        out = model(x)
        kept = out.detach().clone()
        if it % 3 == 1:
            log.append(kept.numpy())
        kept.mul_(2)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return kept

    _logging_twins(step, 8)


def test_printing_a_loss_that_requires_grad_prints_its_grad_fn():
    # review 43 F2: computed without autograd, the read lost `grad_fn=<NllLossBackward0>`
    def step(x, y, *, model, opt, it, log):
        loss = F.cross_entropy(model(x), y)
        if it % 3 == 1:
            log.append(repr(loss))
            log.append(f"{loss:.5f}")
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    _logging_twins(step, 9)
