"""A checked call whose program runs at its last host read (runtime/early_finish.py).

`running_loss += loss.item()` at the end of a step: the program runs at the read, the read takes
its value from the program, and the rest of the function is matched as before. Each test runs an
eager twin beside the traced function and compares every value, and proves the program ran at
the read (`stats.early_runs`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import assert_same_state, batch, make_model, twin

import tracejit
from tracejit.errors import TraceMismatchError

STEPS = 6


def _sgd_twins(make_module):
    """Two identical modules with an SGD(lr=0.1) each: one for eager, one for the traced run."""
    torch.manual_seed(0)
    module_a, module_b = make_module(), make_module()
    module_b.load_state_dict(module_a.state_dict())
    return (module_a, torch.optim.SGD(module_a.parameters(), lr=0.1)), (module_b, torch.optim.SGD(module_b.parameters(), lr=0.1))


def _numbers(log: list) -> list[float]:
    """A log of numbers and tuples of numbers, flat (pytest.approx compares flat sequences)."""
    return [n for entry in log for n in (entry if isinstance(entry, tuple) else (entry,))]


def _update(loss, opt):
    loss.backward()
    opt.step()
    opt.zero_grad()


def logging_step(model, opt, totals, history=None, state=None):
    """A tutorial training step: the loss and the accuracy read on every call after the update."""
    def step(x, y):
        out = model(x)
        loss = F.cross_entropy(out, y)
        _update(loss, opt)
        correct = (out.argmax(1) == y).sum()
        detached, logits = loss.detach(), out.detach()
        if history is not None:
            history.append(loss.detach())
        totals["loss"] += loss.item()
        totals["correct"] += correct.item()
        if state is not None:
            state["last"] = logits  # assigned after the read: the placeholder must hold the value
        return detached
    return step


def _early(traced) -> None:
    stats = traced.stats
    assert stats.api_fallbacks == 0 and stats.api_replays >= 3, stats
    assert stats.early_runs == stats.api_replays, stats


@pytest.mark.parametrize("backend", ["aten", "c"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_reads_at_the_end_of_a_step_take_the_programs_values(kind, backend):
    # Adam turns the C kernels' rounding in the conv bias's near-zero gradient (BatchNorm follows)
    # into whole steps: momentum SGD there
    (model_a, opt_a), (model_b, opt_b) = twin(make_model(kind), "adam" if backend == "aten" else "sgd_momentum")
    model_a.train(), model_b.train()
    totals_a, totals_b = {"loss": 0.0, "correct": 0}, {"loss": 0.0, "correct": 0}
    history_a, history_b, state_a, state_b = [], [], {}, {}
    eager = logging_step(model_a, opt_a, totals_a, history_a, state_a)
    traced = tracejit.trace(logging_step(model_b, opt_b, totals_b, history_b, state_b), backend=backend)
    exact = backend == "aten"
    for i in range(STEPS):
        torch.manual_seed(i)  # the CNN's dropout
        want = eager(*batch(kind, i))
        torch.manual_seed(i)
        got = traced(*batch(kind, i))
        assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-5), i
        assert totals_b["correct"] == totals_a["correct"], i
        assert totals_b["loss"] == totals_a["loss"] if exact else abs(totals_b["loss"] - totals_a["loss"]) < 1e-4
        assert torch.equal(state_b["last"], state_a["last"]) if exact else torch.allclose(state_b["last"], state_a["last"], atol=1e-5)
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=exact, atol=1e-5)
    assert [h.item() for h in history_b] == pytest.approx([h.item() for h in history_a], abs=0 if exact else 1e-5)
    assert len({h.data_ptr() for h in history_b}) == STEPS  # each call's own tensor
    _early(traced)


def test_a_read_whose_number_the_rest_uses_runs_the_program_after_the_function():
    # `x * (1 / n)` after `n = t.item()`: the program needs the number, known only once read
    @tracejit.trace(backend="aten")
    def f(x, state):
        state.add_(1)
        n = state.item()
        return x * (1.0 / n)

    state, x = torch.zeros(()), torch.randn(4)
    for i in range(1, 6):
        assert torch.equal(f(x, state), x * (1.0 / i))
    assert f.stats.early_runs == 0 and f.stats.api_replays >= 3 and f.stats.api_fallbacks == 0


def test_reads_and_shape_queries_after_the_read_that_the_traced_call_did_not_make():
    # the traced call read the loss once; later calls read it again and ask for shapes, which the
    # program's values and the placeholders answer
    model = make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    calls = [0]

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        _update(loss, opt)
        seen.append(loss.item())
        calls[0] += 1
        if calls[0] > 2 and calls[0] % 2 == 0:  # not in the calls that record and note the trace
            seen.append((loss.item(), tuple(x.shape), loss.dim()))
        return loss.detach()

    eager_model = make_model("mlp")
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    expected = []
    for i in range(STEPS):
        loss = F.cross_entropy(eager_model(batch("mlp", i)[0]), batch("mlp", i)[1])
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        expected.append(loss.item())
        if i + 1 > 2 and (i + 1) % 2 == 0:
            expected.append((loss.item(), (8, 64), 0))
    traced = tracejit.trace(step, backend="aten")
    for i in range(STEPS):
        traced(*batch("mlp", i))
    assert seen == expected
    _early(traced)


def test_values_kept_or_read_after_the_read_that_the_traced_call_did_not_are_the_programs():
    # the program leaves every value the function sees when it runs at a read: a later call that
    # keeps the logits, or reads the accuracy, where the traced calls did neither, gets eager's values
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "adam")

    def make(model, opt, kept):
        def step(x, y, *, i):
            out = model(x)
            loss = F.cross_entropy(out, y)
            _update(loss, opt)
            correct, logits = (out.argmax(1) == y).sum(), out.detach()
            kept.append(loss.item())
            if i >= 3 and i % 3 == 1:  # none of the calls that record and note the trace
                kept.append((logits, correct.item()))
            return loss.detach()
        return step

    kept_a, kept_b = [], []
    eager, traced = make(model_a, opt_a, kept_a), tracejit.trace(make(model_b, opt_b, kept_b), backend="aten")
    for i in range(9):
        assert torch.equal(traced(*batch("mlp", i), i=i), eager(*batch("mlp", i), i=i)), i
        assert_same_state(model_a, opt_a, model_b, opt_b)
    assert len(kept_a) == len(kept_b) == 11
    for a, b in zip(kept_a, kept_b):
        if isinstance(a, tuple):
            assert torch.equal(a[0], b[0]) and a[1] == b[1]
        else:
            assert a == b
    stats = traced.stats
    assert stats.early_runs == stats.api_replays >= 6 and stats.api_fallbacks == 0, stats


def test_a_call_that_goes_on_otherwise_after_the_program_ran_runs_the_rest_eagerly():
    # the program ran at the read, so the call cannot run again at the aten level; the state is
    # eager's there and every value the function holds is real: torch calls the record does not
    # have run for real (a check, a logged slice, another return value), and the function's own
    # result is the call's
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "adam")

    def make(model, opt, log):
        def step(x, y, *, i):
            out = model(x)
            loss = F.cross_entropy(out, y)
            _update(loss, opt)
            log.append(loss.item())
            if i % 3 == 1 and i > 3:  # none of the calls that record and note the trace
                log.append((bool(torch.isfinite(out).all()), out[0, :3].tolist(), f"{loss:.5f}"))
                return loss.detach(), out.detach().argmax(1)
            return loss.detach()
        return step

    log_a, log_b = [], []
    eager, traced = make(model_a, opt_a, log_a), tracejit.trace(make(model_b, opt_b, log_b), backend="aten")
    for i in range(9):
        got, want = traced(*batch("mlp", i), i=i), eager(*batch("mlp", i), i=i)
        if isinstance(want, tuple):
            assert isinstance(got, tuple) and all(torch.equal(g, w) for g, w in zip(got, want)), i
        else:
            assert torch.equal(got, want), i
        assert_same_state(model_a, opt_a, model_b, opt_b)
    assert log_a == log_b and len(log_a) == 11
    stats = traced.stats
    assert stats.early_runs == stats.api_replays >= 6 and stats.api_fallbacks == 0, stats


@pytest.mark.parametrize("query", ["loss.grad_fn", "loss.requires_grad", "print(loss)"])
def test_autograd_questions_after_the_program_ran_raise(query, capsys):
    # a value the program computed has no autograd history: after the program ran at the read,
    # asking for it (or for eager's `grad_fn=<...>` text) on a call the record does not have
    # raises; the step is done, as eager's, and the next call runs as before
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "sgd")

    def make(model, opt, totals, asks):
        def step(x, y, *, i):
            loss = F.cross_entropy(model(x), y)
            _update(loss, opt)
            totals.append(loss.item())
            if asks and i == 4:
                eval(query, {"loss": loss})
            return loss.detach()
        return step

    totals_a, totals_b = [], []
    eager = make(model_a, opt_a, totals_a, False)
    traced = tracejit.trace(make(model_b, opt_b, totals_b, True), backend="aten")
    for i in range(STEPS):
        want = eager(*batch("mlp", i), i=i)
        if i == 4:
            with pytest.raises(TraceMismatchError, match=r"after its compiled program ran at the host read at "
                                                         r"test_early_finish.py:\d+ in step: .* of a value the program "
                                                         r"computed without autograd"):
                traced(*batch("mlp", i), i=i)
        else:
            assert torch.equal(traced(*batch("mlp", i), i=i), want), i
        assert_same_state(model_a, opt_a, model_b, opt_b)
    assert totals_a == totals_b
    assert traced.stats.early_runs == traced.stats.api_replays >= 3


def test_an_exception_after_the_read_is_the_functions_own():
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "adam")

    def make(model, opt):
        def step(x, y, *, i):
            loss = F.cross_entropy(model(x), y)
            _update(loss, opt)
            if loss.item() > 0 and i == 3:
                raise KeyError("stop here")
            return loss.detach()
        return step

    eager, traced = make(model_a, opt_a), tracejit.trace(make(model_b, opt_b), backend="aten")
    for i in range(STEPS):
        for function in (eager, traced):
            if i == 3:
                with pytest.raises(KeyError, match="stop here"):
                    function(*batch("mlp", i), i=i)
            else:
                function(*batch("mlp", i), i=i)
        assert_same_state(model_a, opt_a, model_b, opt_b)
    stats = traced.stats
    assert stats.early_runs == stats.api_replays >= 2 and stats.api_fallbacks == 0, stats


def test_a_read_on_some_calls_only_runs_the_program_at_the_read_when_made():
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "adam")

    def make(model, opt, seen):
        def step(x, y, *, i):
            loss = F.cross_entropy(model(x), y)
            _update(loss, opt)
            if i <= 3 or i % 3:  # the calls that record (1, 2 again: Adam's state) and note the trace (3) read it
                seen.append(loss.item())
            return loss.detach()
        return step

    seen_a, seen_b = [], []
    eager, traced = make(model_a, opt_a, seen_a), tracejit.trace(make(model_b, opt_b, seen_b), backend="aten")
    for i in range(1, 10):
        assert torch.equal(traced(*batch("mlp", i), i=i), eager(*batch("mlp", i), i=i)), i
        assert_same_state(model_a, opt_a, model_b, opt_b)
    assert seen_a == seen_b and len(seen_a) == 7
    stats = traced.stats
    assert stats.api_fallbacks == 0 and 0 < stats.early_runs < stats.api_replays, stats


def test_an_error_the_program_raises_at_the_read_is_raised_as_eager_raises_it():
    # an index out of range reaches the embedding on one call: eager raises in the forward, the
    # program when it runs at the read; nothing runs again, and the next call goes on
    (emb_a, opt_a), (emb_b, opt_b) = _sgd_twins(lambda: torch.nn.Embedding(10, 4))

    def make(emb, opt, totals):
        def step(index):
            loss = emb(index).square().mean()
            _update(loss, opt)
            totals.append(loss.item())
            return loss.detach()
        return step

    totals_a, totals_b = [], []
    eager, traced = make(emb_a, opt_a, totals_a), tracejit.trace(make(emb_b, opt_b, totals_b), backend="aten")
    for i in range(STEPS):
        index = torch.tensor([1, 2, 3]) if i != 4 else torch.tensor([1, 2, 30])
        if i == 4:
            for function in (eager, traced):
                with pytest.raises(IndexError):
                    function(index)
        else:
            assert torch.equal(traced(index), eager(index)), i
        assert torch.equal(emb_a.weight, emb_b.weight), i
    assert totals_a == totals_b
    stats = traced.stats
    assert stats.early_runs >= 3 and stats.api_fallbacks == 0, stats


def _linear_step(kind: str):
    """A step whose read after the update is made in one of the ways hunt X found silently wrong
    or broken with the program run at the read."""
    def make(model, opt, log):
        def step(x, y):
            opt.zero_grad(set_to_none=True)  # backward makes new gradients, which outlive the call
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            if kind == "literal":  # a literal written in place, read after the program ran
                correct = torch.tensor(0.0)
                correct += (out.argmax(1) == y).sum()
                log.append(loss.item())
                log.append(correct.item())
            elif kind == "autocast":  # the read inside an autocast region: the program runs outside it
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    log.append(loss.item())
            elif kind == "inference_mode":  # ...and outside inference_mode: its tensors are not inference tensors
                with torch.inference_mode():
                    log.append(loss.item())
            else:  # views of a parameter and of an input
                log.append(loss.item())
                log.append((model.weight[0, 1].item(), x[1, 2].item()))
            return loss.detach()
        return step
    return make


@pytest.mark.parametrize("kind", ["literal", "autocast", "inference_mode", "views"])
@pytest.mark.parametrize("backend", ["aten", "c"])
def test_reads_after_the_update_that_the_program_must_not_answer_otherwise(kind, backend):
    (model_a, opt_a), (model_b, opt_b) = _sgd_twins(lambda: torch.nn.Linear(8, 4))
    log_a, log_b = [], []
    make = _linear_step(kind)
    eager, traced = make(model_a, opt_a, log_a), tracejit.trace(make(model_b, opt_b, log_b), backend=backend)
    exact = backend == "aten"
    for i in range(8):  # the first call finds no gradients, the second records again with them
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        got, want = traced(x, y), eager(x, y)
        assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-6), i
        assert not got.is_inference() and not model_b.weight.grad.is_inference(), i
        for a, b in zip(model_a.parameters(), model_b.parameters()):
            assert torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-6), i
            assert torch.equal(a.grad, b.grad) if exact else torch.allclose(a.grad, b.grad, atol=1e-6), i
    flat_a, flat_b = _numbers(log_a), _numbers(log_b)
    assert flat_a == flat_b if exact else flat_a == pytest.approx(flat_b, abs=1e-5)
    stats = traced.stats
    assert stats.api_replays >= 3 and stats.api_fallbacks == 0, stats
    # inside autocast or inference_mode the program waits for the function's end
    assert (stats.early_runs == 0) if kind in ("autocast", "inference_mode") else (stats.early_runs == stats.api_replays)


def test_a_gradient_reached_after_the_read_and_used_on_some_calls_is_the_programs():
    # `.grad` read after the read on every call hands out a value made before it; a later call
    # that goes on with it (a logged norm) must find the program's gradient there
    (model_a, opt_a), (model_b, opt_b) = _sgd_twins(lambda: torch.nn.Linear(8, 4))

    def make(model, opt, log):
        def step(x, y, *, i):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            log.append(loss.item())
            grad = model.weight.grad
            if i > 4 and i % 2:
                log.append(grad.square().sum().item())
            return loss.detach()
        return step

    log_a, log_b = [], []
    eager, traced = make(model_a, opt_a, log_a), tracejit.trace(make(model_b, opt_b, log_b), backend="aten")
    for i in range(9):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        assert torch.equal(traced(x, y, i=i), eager(x, y, i=i)), i
        assert torch.equal(model_a.weight.grad, model_b.weight.grad), i
    assert log_a == log_b and len(log_a) == 11
    stats = traced.stats
    assert stats.early_runs == stats.api_replays >= 4 and stats.api_fallbacks == 0, stats


@pytest.mark.parametrize("after", ["write the input", "a second step", "log in an excluded block"])
def test_what_a_call_does_eagerly_after_the_program_ran_is_eagers(after, capsys):
    # hunt Y: once a call goes on otherwise than recorded after the program ran at the read,
    # nothing of the record answers for it any more (a module's forward in the tail after the
    # input was written; a second step's forward and backward on the real parameters; an excluded
    # block the record does not have)
    (model_a, opt_a), (model_b, opt_b) = _sgd_twins(lambda: torch.nn.Linear(4, 3))

    def make(model, opt, log):
        def step(x, y, *, i):
            loss = F.mse_loss(model(x), y)
            _update(loss, opt)
            log.append(loss.item())
            if i > 3:
                if after == "write the input":
                    x.mul_(2)
                elif after == "a second step":
                    again = F.mse_loss(model(x), y)
                    log.append(again.requires_grad)
                    again.backward()
                    opt.step()
                    opt.zero_grad()
                else:
                    with tracejit.exclude_from_trace():
                        print(f"step {i}")
            with torch.no_grad():
                evaluated = model(x)
            return loss.detach(), evaluated
        return step

    log_a, log_b = [], []
    eager, traced = make(model_a, opt_a, log_a), tracejit.trace(make(model_b, opt_b, log_b), backend="aten")
    for i in range(8):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)
        want, got = eager(x.clone(), y, i=i), traced(x.clone(), y, i=i)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), i
        for a, b in zip(model_a.parameters(), model_b.parameters()):
            assert torch.equal(a, b), i
    assert log_a == log_b
    stats = traced.stats
    assert stats.early_runs == stats.api_replays >= 4 and stats.api_fallbacks == 0, stats
