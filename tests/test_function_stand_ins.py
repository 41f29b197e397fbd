"""Checked replay at the API level answers torch.nn.utils' clip_grad_norm_() and clip_grad_value_()
as a whole when their arguments are the recorded ones (runtime/function_stand_ins.py). Every test
compares with eager after each step, bit for bit (backend="aten"), and reads
`stats.function_stand_ins` to tell a stand-in that answered from torch's function matched call by
call."""

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import assert_same_state, batch, make_model
from torch.nn.utils import clip_grad, clip_grad_norm_

import tracejit
from tracejit.record.function_calls import ANSWERABLE


def pair(optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)):
    models = [make_model("mlp"), make_model("mlp")]
    models[1].load_state_dict(models[0].state_dict())
    return [(m, optimizer(m.parameters())) for m in models]


def clip_norm_generator(model):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


def clip_norm_imported_list(model):
    return clip_grad_norm_(list(model.parameters()), max_norm=0.5, norm_type=float("inf"))


def clip_norm_without_foreach(model):
    return clip_grad.clip_grad_norm_(tuple(model.parameters()), 0.5, 1.0, False, False)


def clip_norm_one_tensor(model):
    return torch.nn.utils.clip_grad_norm_(model.net[0].weight, 0.1)


def clip_value(model):
    torch.nn.utils.clip_grad_value_(model.parameters(), clip_value=0.01)
    return torch.zeros(())


CLIPS = [clip_norm_generator, clip_norm_imported_list, clip_norm_without_foreach, clip_norm_one_tensor, clip_value]


def step_with(clip, set_to_none=True):
    """A training step clipping with `clip(model, **keywords)` between backward and the step."""
    def step(x, y, *, model, opt, **keywords):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norm = clip(model, **keywords)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return loss, norm
    return step


def run(traced, step, pairs, steps, extra=None, start=0):
    (model_a, opt_a), (model_b, opt_b) = pairs
    for i in range(start, start + steps):
        x, y = batch("mlp", i)
        keywords = (extra or {}).get(i, {})
        got = traced(x, y, model=model_b, opt=opt_b, **keywords)
        want = step(x, y, model=model_a, opt=opt_a, **keywords)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), (i, g, w)
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)


def traced_after(step, steps, pairs=None):
    """The step traced (backend="aten") and run `steps` times against eager twins: (traced, pairs)."""
    pairs = pairs or pair()
    traced = tracejit.trace(step, backend="aten")
    run(traced, step, pairs, steps)
    return traced, pairs


def same_or_loud(traced, step, pairs, i, **keywords):
    """One call that the record does not have: eager's results, or a TraceMismatchError (after which
    the tensors are as an eager call that raised there leaves them: the comparison ends)."""
    (model_a, opt_a), (model_b, opt_b) = pairs
    x, y = batch("mlp", i)
    want = step(x, y, model=model_a, opt=opt_a, **keywords)
    try:
        got = traced(x, y, model=model_b, opt=opt_b, **keywords)
    except tracejit.TraceMismatchError:
        return False
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), i
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    return True


def run_close(traced, step, pairs, steps):
    """`steps` calls on the compiled backend against eager: close rather than equal."""
    (model_a, opt_a), (model_b, opt_b) = pairs
    for i in range(steps):
        x, y = batch("mlp", i)
        got, want = traced(x, y, model=model_b, opt=opt_b), step(x, y, model=model_a, opt=opt_a)
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=False)


def torchs_own():
    return all(a.held() is a.function for a in ANSWERABLE)


@pytest.mark.parametrize("clip", CLIPS, ids=lambda f: f.__name__)
def test_a_clipped_step_is_answered_whole_and_matches_eager(clip):
    step = step_with(clip)
    traced, pairs = traced_after(step, 6)
    stats = traced.stats
    assert stats.records == 1 and stats.api_fallbacks == 0 and stats.api_replays >= 3, stats
    assert stats.function_stand_ins == stats.api_replays  # one clipping call each
    assert torchs_own()


def test_the_compiled_backend_clips_as_eager_does():
    step = step_with(clip_norm_generator)
    pairs = pair(lambda p: torch.optim.Adam(p, lr=1e-2, fused=True))
    traced = tracejit.trace(step, backend="c")
    run_close(traced, step, pairs, 6)
    assert traced.stats.function_stand_ins >= 3


def test_a_new_max_norm_is_passed_on_to_the_program():
    step = step_with(lambda model, max_norm=0.5: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    pairs = pair()
    traced = tracejit.trace(step, backend="aten")
    numbers = {i: {"max_norm": n} for i, n in enumerate([0.5, 0.5, 0.5, 0.5, 0.05, 0.01, 0.5, 2.0])}
    run(traced, step, pairs, len(numbers), numbers)
    stats = traced.stats
    assert stats.api_fallbacks == 0 and stats.api_replays >= 5, stats
    assert stats.function_stand_ins == stats.api_replays  # as `max_norm / total_norm` would pass it


def test_another_parameter_list_is_not_answered_with_the_recorded_one():
    def clip(model, head_only=False):
        params = list(model.net[4].parameters()) if head_only else list(model.parameters())
        return torch.nn.utils.clip_grad_norm_(params, 0.01)

    step = step_with(clip)
    traced, pairs = traced_after(step, 5)
    answered = traced.stats.function_stand_ins
    assert answered >= 2
    same_or_loud(traced, step, pairs, 5, head_only=True)
    assert traced.stats.function_stand_ins == answered


def test_a_patched_helper_turns_the_stand_in_off(monkeypatch):
    step = step_with(clip_norm_generator)
    traced, pairs = traced_after(step, 5)
    answered = traced.stats.function_stand_ins
    assert answered >= 2
    real = clip_grad._get_total_norm

    def doubled(*args, **kwargs):  # a user's norm: the clip it decides differs from the recorded one
        return real(*args, **kwargs) * 2

    monkeypatch.setattr(clip_grad, "_get_total_norm", doubled)
    assert not same_or_loud(traced, step, pairs, 9)  # the doubled norm's ops are not the recorded ones
    assert traced.stats.function_stand_ins == answered


def test_autocast_entered_around_the_clip_inside_the_function_is_not_answered_as_recorded():
    def clip(model, under_autocast=False):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
            return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)

    step = step_with(clip)
    traced, pairs = traced_after(step, 4)
    answered = traced.stats.function_stand_ins
    same_or_loud(traced, step, pairs, 7, under_autocast=True)
    assert traced.stats.function_stand_ins == answered


def test_a_nonfinite_check_reads_the_norm_and_runs_torchs_function():
    step = step_with(lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, error_if_nonfinite=True))
    traced, pairs = traced_after(step, 5)
    assert traced.stats.function_stand_ins == 0 and traced.stats.api_replays >= 2
    refused = traced._fast_api.api.stand_ins_refused
    assert any(k.startswith("clip_grad_norm_()") and "reads a tensor on the host" in v for k, v in refused.items())


def test_gradients_accumulated_across_calls_are_clipped_where_they_are():
    # zero_grad(set_to_none=False) at the end: the gradients live on between calls, and the clip's
    # `p.grad` reads are the first of each call
    step = step_with(clip_norm_generator, set_to_none=False)
    traced, pairs = traced_after(step, 6)
    assert traced.stats.function_stand_ins >= 3 and traced.stats.api_fallbacks == 0


def test_a_frozen_layer_without_gradients_is_skipped_as_eager_skips_it():
    pairs = pair()
    for model, _ in pairs:
        model.net[0].requires_grad_(False)
    step = step_with(clip_norm_generator)
    traced = tracejit.trace(step, backend="aten")
    run(traced, step, pairs, 5)
    assert traced.stats.function_stand_ins >= 2


def test_the_norm_read_on_the_host_after_the_clip_is_this_calls():
    logged = {"a": [], "b": []}

    def logging_step(log):
        def step(x, y, *, model, opt):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            log.append(norm.item())
            opt.step()
            opt.zero_grad()
            return loss, norm
        return step

    pairs = pair()
    traced = tracejit.trace(logging_step(logged["b"]), backend="aten")
    run(traced, logging_step(logged["a"]), pairs, 6)
    assert logged["a"] == logged["b"] and len(set(logged["a"])) == 6
    assert traced.stats.function_stand_ins >= 3


def test_torchs_function_is_back_after_every_call_and_after_a_raising_one():
    step = step_with(clip_norm_generator)
    traced, pairs = traced_after(step, 4)
    assert torchs_own()

    def failing(x, y, *, model, opt):
        step(x, y, model=model, opt=opt)
        raise KeyError("user error")

    traced_failing = tracejit.trace(failing, backend="aten")
    with pytest.raises(KeyError):
        traced_failing(*batch("mlp", 0), model=pairs[1][0], opt=pairs[1][1])
    assert torchs_own()


def test_another_threads_clip_during_a_checked_call_runs_torchs_function():
    model = make_model("mlp")
    other = [torch.ones(3, requires_grad=True)]
    other[0].grad = torch.full((3,), 4.0)
    results = []

    def clip_elsewhere():
        results.append(torch.nn.utils.clip_grad_norm_(other, 1.0))

    def step(x, y, *, model):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        thread = threading.Thread(target=clip_elsewhere)
        thread.start()
        thread.join()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        model.zero_grad()
        return loss, norm

    traced = tracejit.trace(step, backend="aten")
    for i in range(5):
        other[0].grad = torch.full((3,), 4.0)
        traced(*batch("mlp", i), model=model)
        assert torch.allclose(other[0].grad, torch.full((3,), 4.0 / (48**0.5 + 1e-6)))
    assert len(results) == 5 and all(torch.allclose(r, torch.tensor(48**0.5)) for r in results)
    assert traced.stats.function_stand_ins >= 2


def test_a_module_parameter_replaced_between_calls_is_not_answered_with_the_old_one():
    pairs = pair()
    step = step_with(clip_norm_generator)
    traced = tracejit.trace(step, backend="aten")
    run(traced, step, pairs, 4)
    for model, opt in pairs:
        old = model.net[4].bias
        new = nn.Parameter(old.detach().clone() + 1)
        model.net[4].bias = new
        opt.param_groups[0]["params"][-1] = new
        opt.state[new] = opt.state.pop(old)
    run(traced, step, pairs, 3, start=5)


@pytest.mark.parametrize("params", [
    lambda m: filter(lambda p: p.requires_grad, m.parameters()),
    lambda m: (p for p in m.parameters() if p.grad is not None),  # torch calls before the span
    lambda m: {n: p for n, p in m.named_parameters()}.values(),
], ids=["filter", "generator_reading_grads", "dict_values"])
def test_parameters_from_any_iterable_are_listed_as_torch_lists_them(params):
    step = step_with(lambda model: torch.nn.utils.clip_grad_norm_(params(model), 0.5))
    traced, pairs = traced_after(step, 6)
    assert traced.stats.function_stand_ins == traced.stats.api_replays >= 3


def test_a_torch_function_wrapped_before_the_trace_keeps_the_clip_checked_call_by_call(monkeypatch):
    # the wrapper's Python (a global scale) ran inside the recorded span: answering the span whole
    # would freeze it
    scale = {"value": 1.0}
    real = torch._foreach_norm

    def scaled_norm(tensors, *args, **kwargs):
        return [n * scale["value"] for n in real(tensors, *args, **kwargs)]

    monkeypatch.setattr(torch, "_foreach_norm", scaled_norm)
    step = step_with(clip_norm_generator)
    traced, pairs = traced_after(step, 5)
    scale["value"] = 4.0
    run(traced, step, pairs, 3, start=5)  # the scale is a number passed on to the program's mul
    assert traced.stats.function_stand_ins == 0 and traced.stats.api_replays >= 5
    refused = traced._fast_api.api.stand_ins_refused
    assert any("_foreach_norm, which torch does not hold under that name now" in v for v in refused.values()), refused


def _norm_of_mine(grads):
    return grads


def _clip_like(parameters, max_norm):
    return _norm_of_mine(parameters)


def test_a_clip_calling_a_helper_that_is_not_torchs_is_not_answerable():
    # a library that wrapped clip_grad's helpers before tracejit was imported: fail closed
    from tracejit.record.function_calls import _helpers

    assert _helpers(clip_grad.clip_grad_norm_) is not None
    assert _helpers(_clip_like) is None


@pytest.mark.parametrize("operator", ["__add__", "__rtruediv__"])
def test_a_tensor_operator_patched_after_the_trace_turns_the_stand_in_off(monkeypatch, operator):
    # `total_norm + 1e-6` reaches the checker as Tensor.add and `max_norm / t` as Tensor.__rdiv__;
    # Python calls the operator's own binding
    step = step_with(clip_norm_generator)
    traced, pairs = traced_after(step, 5)
    answered = traced.stats.function_stand_ins
    real = getattr(torch.Tensor, operator)
    monkeypatch.setattr(torch.Tensor, operator, lambda a, b: real(a, b * 1000 if operator == "__add__" else b * 0.1))
    run(traced, step, pairs, 2, start=5)
    assert traced.stats.function_stand_ins == answered


def test_a_host_read_after_the_clip_reads_the_gradient_the_call_found():
    # the clip reads the gradients first (they live on between calls); one is replaced between calls
    # while the old one stays alive: the norm read on the host is this call's
    def logging_step(log):
        def step(x, y, *, model, opt):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            log.append(norm.item())
            opt.step()
            opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss, norm
        return step

    logs, kept = ([], []), []
    pairs = pair()
    steps = [logging_step(log) for log in logs]
    traced = tracejit.trace(steps[1], backend="aten")
    (model_a, opt_a), (model_b, opt_b) = pairs
    for i in range(8):
        for model in (model_a, model_b):
            weight = model.net[0].weight
            if i >= 4 and weight.grad is not None:
                kept.append(weight.grad)
                weight.grad = weight.grad * 3.0
        x, y = batch("mlp", i)
        want, got = steps[0](x, y, model=model_a, opt=opt_a), traced(x, y, model=model_b, opt=opt_b)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), i
        assert logs[0] == logs[1], i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    assert traced.stats.function_stand_ins >= 3


# -- nn.Module.zero_grad ---------------------------------------------------------------------


def module_zero_grad_step(where="start", set_to_none=True):
    """A training step clearing the gradients with `model.zero_grad()` before the forward or after
    the optimizer step."""
    def step(x, y, *, model, opt):
        if where == "start":
            model.zero_grad(set_to_none=set_to_none)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if where == "end":
            model.zero_grad(set_to_none)
        return loss, loss.detach() * 2
    return step


@pytest.mark.parametrize("where", ["start", "end"])
def test_model_zero_grad_is_answered_whole_and_matches_eager(where):
    step = module_zero_grad_step(where)
    traced, pairs = traced_after(step, 8)  # the first call finds no gradients: a record of its own
    stats = traced.stats
    assert stats.api_fallbacks == 0 and stats.api_replays >= 3, stats
    assert stats.function_stand_ins == stats.api_replays  # one zero_grad() each
    assert torchs_own() and nn.Module.__dict__["zero_grad"] is ANSWERABLE[-1].function
    if where == "end":
        assert all(p.grad is None for p in pairs[1][0].parameters())


def test_model_zero_grad_on_the_compiled_backend_matches_eager():
    step = module_zero_grad_step()
    pairs = pair(lambda p: torch.optim.Adam(p, lr=1e-2, fused=True))
    traced = tracejit.trace(step, backend="c")
    run_close(traced, step, pairs, 8)
    assert traced.stats.function_stand_ins == traced.stats.api_replays >= 3


def test_model_zero_grad_without_set_to_none_runs_for_real():
    step = module_zero_grad_step(set_to_none=False)
    traced, _ = traced_after(step, 8)
    assert traced.stats.api_replays >= 3 and traced.stats.function_stand_ins == 0
    assert any("set_to_none" in why for why in traced._entries()[-1].api.stand_ins_refused.values())


def test_zero_grad_of_another_model_or_a_frozen_layer_is_not_the_recorded_one():
    step = module_zero_grad_step()
    traced, pairs = traced_after(step, 6)
    answered = traced.stats.function_stand_ins
    assert answered >= 2
    # a layer frozen since: zero_grad() lists the same parameters and leaves its gradient None,
    # the backward no longer makes one (another trace), and every call compares with eager
    for model, _ in pairs:
        model.net[0].weight.requires_grad_(False)
        model.net[0].weight.grad = None
    run(traced, step, pairs, 4, start=6)
    # another model with the same layout: other parameters, so torch's zero_grad() runs
    other = [(m, o) for m, o in pair()]
    run(traced, step, other, 4, start=10)
    assert torchs_own()


def test_a_subclass_with_its_own_zero_grad_runs_it():
    calls = []

    class Counting(nn.Sequential):
        def zero_grad(self, set_to_none=True):
            calls.append(1)
            super().zero_grad(set_to_none)

    def make():
        torch.manual_seed(0)
        return Counting(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    models = [make(), make()]
    pairs = [(m, torch.optim.SGD(m.parameters(), lr=0.1)) for m in models]

    def step(x, y, *, model, opt):
        model.zero_grad()
        loss = F.cross_entropy(model(x[:, :4]), y % 2)
        loss.backward()
        opt.step()
        return loss, loss.detach()

    traced = tracejit.trace(step, backend="aten")
    run(traced, step, pairs, 8)
    assert len(calls) == 16  # its Python ran on every call, traced and eager
    assert traced.stats.api_replays >= 3


def test_the_class_attribute_is_restored_when_the_function_raises():
    step = module_zero_grad_step()
    traced, pairs = traced_after(step, 4)

    def failing(x, y, *, model, opt):
        model.zero_grad()
        raise KeyError("the user's error")

    traced._function = failing
    with pytest.raises(KeyError):
        traced(*batch("mlp", 5), model=pairs[1][0], opt=pairs[1][1])
    assert torchs_own() and nn.Module.__dict__["zero_grad"] is ANSWERABLE[-1].function
