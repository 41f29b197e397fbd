"""Findings of a hunt over realistic training pipelines (many steps, compared with eager step by
step): gradient accumulation whose stepping trace never reached the torch API level, a scheduler
created after some steps that turned the optimizer stand-ins off for good, a mismatch message
that named the wrong argument, and a tensor lr with StepLR stepped inside the step."""


import pytest
import torch
import torch.nn.functional as F

import tracejit
from tracejit import TraceMismatchError

# -- a mismatch names the argument that changed -------------------------------------------------


@pytest.mark.parametrize("first, then, said", [
    # the dispatcher drops trailing defaults together: huber_loss(x, y, 1, 0.7) against
    # huber_loss(x, y), where reduction (1, its default) is only passed to reach delta
    (0.7, 1.0, r"delta left at its default 1.0 where the recorded call passed 0.7"),
    (1.0, 0.7, r"delta=0.7 where the recorded call left it at its default 1.0"),
])
def test_a_mismatch_names_the_argument_that_left_its_default(first, then, said, monkeypatch):
    monkeypatch.setenv("TRACEJIT_REPLAY", "aten")  # the API level binds the number (a call of its own)
    w = torch.randn(4, requires_grad=True)
    x, y = torch.randn(4) * 3, torch.randn(4)

    @tracejit.trace
    def step(x, y, *, delta):
        loss = F.huber_loss(x * w, y, delta=delta)
        loss.backward()
        return loss

    for _ in range(3):
        step(x, y, delta=first)
    with pytest.raises(TraceMismatchError, match=rf"aten.huber_loss.default got different non-tensor arguments \({said}"):
        step(x, y, delta=then)
