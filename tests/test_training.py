"""Traced training steps against eager ones: same seed, several steps, every piece of state compared."""

import pytest
import torch
import torch.nn.functional as F
from models import assert_same_state, batch, make_model, train_step, twin
from side_by_side import assert_replayed


def reads_step_on_host(opt_name):
    # The for-loop and foreach Adam/AdamW read step.item() every step, which symbolic recording refuses
    # (tests/test_symbolic.py checks the error and its advice to use fused=True).
    return pytest.param(opt_name, marks=pytest.mark.skip_mode("symbolic", reason="optimizer reads step.item()"))


OPTIMIZERS = ["sgd", "sgd_momentum", reads_step_on_host("adam"), reads_step_on_host("adam_foreach"), "adam_fused",
              reads_step_on_host("adamw"), reads_step_on_host("adamw_foreach"), "adamw_fused",
              reads_step_on_host("adam_loop")]


# Linear and ReLU with a one-op parameter update (SGD's add_, _fused_adam_): no elementwise chain of
# two ops, so the fused mode has nothing to fuse.
NOTHING_TO_FUSE = {("mlp", "sgd"), ("mlp", "adam_fused"), ("mlp", "adamw_fused")}


def run_both(trace, kind, opt_name, steps=5, step_fn=train_step):
    (model_a, opt_a), (model_b, opt_b) = twin(make_model(kind), opt_name)
    traced = trace(step_fn)
    for i in range(steps):
        x, y = batch(kind, i)
        torch.manual_seed(100 + i)
        loss_a = step_fn(x, y, model=model_a, opt=opt_a)
        torch.manual_seed(100 + i)
        loss_b = traced(x, y, model=model_b, opt=opt_b)
        assert torch.equal(loss_a, loss_b), f"step {i}: {loss_a.item()} vs {loss_b.item()}"
    assert_replayed(traced, steps, fused=trace.mode == "fused" and (kind, opt_name) not in NOTHING_TO_FUSE)
    return (model_a, opt_a), (model_b, opt_b), traced


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_training_matches_eager_bitwise(trace, kind, opt_name):
    (model_a, opt_a), (model_b, opt_b), traced = run_both(trace, kind, opt_name)
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    # one trace, replayed: the lazy optimizer state re-recorded it at most once
    assert len(traced.records) == 1


@pytest.mark.parametrize("opt_name", [reads_step_on_host("adam"), "adam_fused"])
def test_params_actually_change_and_loss_decreases(trace, opt_name):
    _, (model_b, opt_b), traced = run_both(trace, "mlp", opt_name, steps=1)
    before = [p.detach().clone() for p in model_b.parameters()]
    x, y = batch("mlp", 0, batch_size=32)
    losses = [traced(x, y, model=model_b, opt=opt_b).item() for _ in range(20)]
    assert losses[-1] < losses[0] * 0.5
    assert all(not torch.equal(a, b) for a, b in zip(before, model_b.parameters()))


def accumulate_step(x, y, *, model, opt):
    # two micro-batches, one optimizer step: no zero_grad between the backward calls
    half = x.shape[0] // 2
    loss1 = F.cross_entropy(model(x[:half]), y[:half])
    loss1.backward()
    loss2 = F.cross_entropy(model(x[half:]), y[half:])
    loss2.backward()
    opt.step()
    opt.zero_grad()
    return loss1 + loss2


@pytest.mark.parametrize("opt_name", ["sgd_momentum", reads_step_on_host("adam"), "adamw_fused"])
def test_gradient_accumulation(trace, opt_name):
    (model_a, opt_a), (model_b, opt_b), _ = run_both(trace, "mlp", opt_name, step_fn=accumulate_step)
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)


def test_gradient_accumulation_across_calls(trace):
    # zero_grad only every second call: .grad is created on call 1 and accumulated into on call 2
    def step(x, y, *, model, opt, update):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "sgd")
    traced = trace(step)
    for i in range(6):
        x, y = batch("mlp", i)
        assert torch.equal(step(x, y, model=model_a, opt=opt_a, update=False),
                           traced(x, y, model=model_b, opt=opt_b, update=False))
        for pa, pb in zip(model_a.parameters(), model_b.parameters()):
            assert torch.equal(pa.grad, pb.grad)
        if i % 2 == 1:
            opt_a.step(), opt_b.step()
            opt_a.zero_grad(), opt_b.zero_grad()
    assert_replayed(traced, 6, records=2)  # one trace creates .grad, one accumulates into it


@pytest.mark.parametrize("opt_name", ["sgd_momentum", reads_step_on_host("adam"), "adam_fused",
                                      reads_step_on_host("adamw_foreach")])
def test_lr_scheduler_changes_lr_every_step(trace, opt_name):
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), opt_name)
    sched_a = torch.optim.lr_scheduler.ExponentialLR(opt_a, gamma=0.7)
    sched_b = torch.optim.lr_scheduler.ExponentialLR(opt_b, gamma=0.7)
    traced = trace(train_step)
    for i in range(6):
        x, y = batch("mlp", i)
        assert torch.equal(train_step(x, y, model=model_a, opt=opt_a), traced(x, y, model=model_b, opt=opt_b))
        sched_a.step(), sched_b.step()
    assert opt_b.param_groups[0]["lr"] < 1e-2 * 0.7 ** 5 + 1e-12
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    assert_replayed(traced, 6)


@pytest.mark.parametrize("opt_name", [reads_step_on_host("adam"), "adam_fused"])
def test_scheduler_inside_the_traced_step(trace, opt_name):
    def step(x, y, *, model, opt, sched):
        loss = train_step(x, y, model=model, opt=opt)
        sched.step()
        return loss

    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), opt_name)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.5)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=1, gamma=0.5)
    traced = trace(step)
    for i in range(5):
        x, y = batch("mlp", i)
        assert torch.equal(step(x, y, model=model_a, opt=opt_a, sched=sched_a),
                           traced(x, y, model=model_b, opt=opt_b, sched=sched_b))
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    assert_replayed(traced, 5)


def test_inference_function_with_no_grad(trace):
    model = make_model("cnn").eval()

    @trace
    def infer(x, *, model):
        with torch.no_grad():
            return model(x).softmax(-1)

    for i in range(4):
        x, _ = batch("cnn", i)
        with torch.no_grad():
            expected = model(x).softmax(-1)
        assert torch.equal(infer(x, model=model), expected)
    assert_replayed(infer, 4)
