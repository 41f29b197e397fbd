"""Checked replay at the API level answers a torch.nn module's call as a whole when the modules of
its subtree are torch.nn's own and their state is the one recorded (runtime/stand_ins.py). Every
test compares with eager on each call, bit for bit (backend="aten"), and reads
`stats.module_stand_ins` to tell a stand-in that answered from a forward that ran."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import CNN, assert_same_state, batch, make_model, train_step, twin

import tracejit

step = train_step  # forward, backward, opt.step(), opt.zero_grad()


def infer(x, *, model):
    with torch.no_grad():
        return model(x)


def pair(make):
    torch.manual_seed(0)
    a = make()
    b = make()
    b.load_state_dict(a.state_dict())
    return a, b


def mlp():
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 4))


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_training_with_answered_modules_is_bitwise_eager(kind):
    # the CNN's convolutions, BatchNorm (running statistics), pooling and Dropout (random numbers)
    (model_a, opt_a), (model_b, opt_b) = twin(make_model(kind), "adam_fused")
    traced = tracejit.trace(step, backend="aten")
    for i in range(6):
        x, y = batch(kind, i)
        torch.manual_seed(i)
        want = step(x, y, model=model_a, opt=opt_a)
        torch.manual_seed(i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), want), i
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    stats = traced.stats
    assert stats.api_replays >= 3 and stats.api_fallbacks == 0
    answered = stats.module_stand_ins
    if kind == "mlp":
        assert answered == stats.api_replays  # the whole Sequential, once a call
    else:  # CNN is the tests' own module: its torch.nn submodules are answered one by one
        assert answered >= 5 * stats.api_replays


def test_inference_answers_the_whole_model():
    model_a, model_b = pair(mlp)
    model_a.eval(), model_b.eval()
    traced = tracejit.trace(infer, backend="aten")
    for i in range(5):
        x = torch.randn(3, 8)
        assert torch.equal(traced(x, model=model_b), infer(x, model=model_a))
    assert traced.stats.module_stand_ins == traced.stats.api_replays >= 2


def change(model, how):
    if how == "dropout_p":
        model[3].p = 0.5
    elif how == "inplace":
        model[2].inplace = True
    elif how == "new_weight":
        model[0].weight = nn.Parameter(model[0].weight.detach() * 2)
    elif how == "reordered":  # the same children, ReLU and Tanh swapped in the order they run
        children = dict(model._modules)
        model._modules.clear()
        model._modules.update((name, children[name]) for name in ("0", "1", "5", "3", "4", "2", "6"))
    elif how == "replaced_child":
        model[2] = nn.GELU()
    elif how == "submodule_eval":  # BatchNorm normalizes with its running statistics
        model[1].eval()
    elif how == "forward_hook":
        model[0].register_forward_hook(lambda module, args, out: out * 2)
    elif how == "global_hook":
        return nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    elif how == "replaced_forward":
        model[4].forward = lambda x: F.linear(x, model[4].weight) * 3
    elif how == "deleted_setting":  # Linear's forward does not read it; the identity check's subscript fails
        del model[0].in_features
    return None


HOW = ["dropout_p", "inplace", "new_weight", "reordered", "replaced_child", "submodule_eval", "forward_hook",
       "global_hook", "replaced_forward", "deleted_setting"]


@pytest.mark.parametrize("reached", ["keyword", "closure"])
@pytest.mark.parametrize("how", HOW)
def test_another_module_state_runs_the_real_forward(how, reached, monkeypatch):
    # whatever the snapshot does not hold any more, the stand-in declines: the forward runs and is
    # checked call by call (a new path records or raises as it would without stand-ins), and the
    # values are eager's. A module reached through a closure is not part of the input signature
    # (a keyword module's training flags are): there only the stand-in's own check sees a change.
    def outcome(replay):
        monkeypatch.setenv("TRACEJIT_REPLAY", replay)
        model_a, model_b = pair(mlp)
        if reached == "keyword":
            traced, call_a, call_b = tracejit.trace(infer, backend="aten"), (lambda x: infer(x, model=model_a)), None
            call_b = lambda x: traced(x, model=model_b)  # noqa: E731
        else:
            def closure(x):
                with torch.no_grad():
                    return model_b(x)

            traced = tracejit.trace(closure, backend="aten")
            call_a, call_b = (lambda x: infer(x, model=model_a)), traced
        for i in range(4):
            x = torch.randn(3, 8)
            assert torch.equal(call_b(x), call_a(x))
        handles = [change(model, how) for model in (model_a, model_b)]
        results = []
        try:
            for i in range(3):
                torch.manual_seed(i)
                x = torch.randn(3, 8)
                torch.manual_seed(100 + i)
                got = call_b(x)
                torch.manual_seed(100 + i)
                want = call_a(x)
                assert torch.equal(got, want), (how, i)
                results.append(got)
        except tracejit.TraceMismatchError as error:
            results = str(error).splitlines()[0]
        finally:
            for handle in handles:
                if handle is not None:
                    handle.remove()
        return traced, results

    traced, got = outcome("api")
    assert traced.stats.module_stand_ins >= 1  # the calls before the change were answered
    _, expected = outcome("aten")
    if isinstance(expected, str):
        assert got == expected
    else:
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_setting_set_again_to_an_equal_value_is_still_answered():
    # the first check compares the settings with the recorded objects by identity; a new float
    # object of the same value fails it and the second check, by type and value, answers the call
    model_a, model_b = pair(mlp)
    traced = tracejit.trace(infer, backend="aten")
    for i in range(3):
        x = torch.randn(3, 8)
        assert torch.equal(traced(x, model=model_b), infer(x, model=model_a))
    for i in range(3):
        model_b[3].p = float(str(model_b[3].p))  # 0.0, a new object each time
        before = traced.stats.module_stand_ins
        x = torch.randn(3, 8)
        assert torch.equal(traced(x, model=model_b), infer(x, model=model_a))
        assert traced.stats.module_stand_ins == before + 1


def test_a_users_module_runs_and_its_torch_nn_parts_are_answered():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            self.calls = 0

        def forward(self, x):
            self.calls += 1  # the user's Python runs on every call
            return x + self.body(x)

    model_a, model_b = pair(Residual)
    traced = tracejit.trace(infer, backend="aten")
    for i in range(5):
        x = torch.randn(2, 8)
        assert torch.equal(traced(x, model=model_b), infer(x, model=model_a))
    assert model_b.calls == model_a.calls == 5
    assert traced.stats.module_stand_ins == traced.stats.api_replays >= 2


def test_a_profiler_runs_the_real_forward():
    model_a, model_b = pair(mlp)
    traced = tracejit.trace(infer, backend="aten")
    for i in range(4):
        x = torch.randn(3, 8)
        assert torch.equal(traced(x, model=model_b), infer(x, model=model_a))
    before = traced.stats.module_stand_ins
    with torch.profiler.profile():
        x = torch.randn(3, 8)
        assert torch.equal(traced(x, model=model_b), infer(x, model=model_a))
    assert traced.stats.module_stand_ins == before
    assert "forward" not in model_b.__dict__ and "forward" not in model_b[0].__dict__


def test_a_cnn_module_keeps_its_state_check_small():
    # BatchNorm's running statistics and num_batches_tracked are buffers, checked by identity
    model = CNN()
    traced = tracejit.trace(step, backend="aten")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(4):
        traced(*batch("cnn", i), model=model, opt=opt)
    program = traced._entries()[0].api
    assert program.module_stand_ins is not None
    sources = [s for s in program.sources if s.startswith("def forward")]
    assert sources and all("running_mean" in s for s in sources if "BatchNorm" in s or "num_batches" in s)
