"""Gradients compared too: a step that clears gradients first leaves them set after every call, so
losses, parameters, gradients and optimizer state are all compared bitwise with eager's."""

import pytest
import torch
import torch.nn.functional as F
from models import assert_same_state, batch, make_model, twin


def zero_first_step(x, y, *, model, opt):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


@pytest.mark.parametrize("kind, opt_name", [
    ("mlp", "adam_fused"),
    ("cnn", "sgd_momentum"),
    pytest.param("transformer", "adamw_foreach",
                 marks=pytest.mark.skip_mode("symbolic", reason="foreach AdamW reads step.item()")),
    ("transformer", "adamw_fused"),
])
def test_gradients_and_state_after_every_step(trace, kind, opt_name):
    (model_a, opt_a), (model_b, opt_b) = twin(make_model(kind), opt_name)
    traced = trace(zero_first_step)
    for i in range(5):
        x, y = batch(kind, i)
        torch.manual_seed(100 + i)
        want = zero_first_step(x, y, model=model_a, opt=opt_a)
        torch.manual_seed(100 + i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), want), f"step {i}"
        assert all(p.grad is not None for p in model_b.parameters())
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)  # includes every .grad
    assert len(traced.records) <= 2  # the first call (no .grad yet) and the steady state
