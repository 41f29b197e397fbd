"""A step that reaches its model and optimizer as globals, re-created between calls (a notebook
cell run again) while the old ones stay referenced: the new optimizer creates its state as the
recorded call did, and the new model trains as in eager."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit

MODEL = OPTIMIZER = None


def make(seed):
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def step(x, y):
    OPTIMIZER.zero_grad()
    loss = F.cross_entropy(MODEL(x), y)
    loss.backward()
    OPTIMIZER.step()
    return loss


@pytest.mark.parametrize("options", [{}, {"backend": "c"}, {"without_host": True}], ids=str)
def test_a_recreated_global_model_and_optimizer_train_as_in_eager(options):
    global MODEL, OPTIMIZER
    traced = tracejit.trace(step, backend=options.get("backend", "aten"), without_host=options.get("without_host", False))
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(5, 4, generator=generator), torch.randint(0, 2, (5,), generator=generator)) for _ in range(7)]
    history = []
    results = {}
    for run in ("eager", "traced"):
        call = step if run == "eager" else traced
        MODEL, OPTIMIZER = make(0)
        history.append((MODEL, OPTIMIZER))  # the old pair stays referenced
        losses = [call(*batch) for batch in batches[:3]]
        MODEL, OPTIMIZER = make(1)
        history.append((MODEL, OPTIMIZER))
        losses += [call(*batch) for batch in batches[3:]]
        results[run] = losses, [p.detach().clone() for p in MODEL.parameters()], \
            [s["momentum_buffer"].clone() for s in OPTIMIZER.state.values()]
    same = torch.equal if "backend" not in options else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    for want, got in zip(results["eager"], results["traced"], strict=True):
        assert len(want) == len(got)
        assert all(same(a, b) for a, b in zip(want, got, strict=True))
    stats = traced.stats
    assert stats.checked_replays + stats.host_free_calls >= 3, stats
