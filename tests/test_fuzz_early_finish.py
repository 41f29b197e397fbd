"""Fuzzer: what a training step does after reading its loss on the host (runtime/early_finish.py).

Each program reads the loss after the update (`item()`, `float()`, `tolist()`), which runs the
compiled program at the read, and then, on each call after the ones that record and note the
trace, does a drawn list of things the record may not have: log a formatted number, check the
output for NaNs, log a slice, keep the logits, keep a value computed from them, write the input,
run the model again under no_grad, take a second step, return another structure. Every returned
value, every logged or kept value, the parameters and their gradients are compared bitwise with
an eager twin (backend="aten") after every call, and the program must have run at the read on
every API-level call.

CI runs a fixed sample (derandomize); TRACEJIT_FUZZ_EXAMPLES=n runs n programs."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracejit

CALLS = 7
TRACED_CALLS = 3  # record, record again (the optimizer's state), note the torch calls
EXAMPLES = int(os.environ.get("TRACEJIT_FUZZ_EXAMPLES", "12"))
FUZZ = settings(max_examples=EXAMPLES, derandomize="TRACEJIT_FUZZ_EXAMPLES" not in os.environ, deadline=None,
                database=None, suppress_health_check=list(HealthCheck))
READS = ("item", "float", "tolist")
ACTIONS = ("format", "isnan", "slice", "keep logits", "keep derived", "write input", "evaluate", "second step",
           "other return")


def _program(read: str, actions: list[list[str]]):
    def make(model, opt, log):
        def step(x, y, *, i):
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            logits = out.detach()
            log.append(loss.item() if read == "item" else float(loss) if read == "float" else loss.tolist())
            extra = actions[i - TRACED_CALLS] if i >= TRACED_CALLS else []
            for action in extra:
                if action == "format":
                    log.append(f"{loss:.6f}")
                elif action == "isnan":
                    log.append(bool(torch.isnan(out).any()))
                elif action == "slice":
                    log.append(out[0, :3].tolist())
                elif action == "keep logits":
                    log.append(logits)
                elif action == "keep derived":
                    log.append(logits.softmax(1)[:, 0])
                elif action == "write input":
                    x.mul_(0.5)
                elif action == "evaluate":
                    with torch.no_grad():
                        log.append(model(x))
                elif action == "second step":
                    again = F.cross_entropy(model(x), y)
                    again.backward()
                    opt.step()
                    opt.zero_grad()
            if "other return" in extra:
                return loss.detach(), logits.argmax(1)
            return loss.detach()
        return step
    return make


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@FUZZ
@given(read=st.sampled_from(READS),
       actions=st.lists(st.lists(st.sampled_from(ACTIONS), max_size=3), min_size=CALLS - TRACED_CALLS,
                        max_size=CALLS - TRACED_CALLS))
def test_whatever_a_step_does_after_its_loss_is_read_is_eagers(read, actions):
    torch.manual_seed(0)
    modules = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)) for _ in range(2)]
    modules[1].load_state_dict(modules[0].state_dict())
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in modules]
    logs: list[list] = [[], []]
    make = _program(read, actions)
    eager, traced = make(modules[0], opts[0], logs[0]), tracejit.trace(make(modules[1], opts[1], logs[1]), backend="aten")
    for i in range(CALLS):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        want, got = eager(x.clone(), y, i=i), traced(x.clone(), y, i=i)
        assert _same(want, got), (i, actions)
        assert _same(logs[0], logs[1]), (i, actions)
        for a, b in zip(modules[0].parameters(), modules[1].parameters()):
            assert torch.equal(a, b) and (a.grad is None) == (b.grad is None), (i, actions)
    stats = traced.stats
    assert stats.api_fallbacks == 0 and stats.api_replays >= CALLS - TRACED_CALLS - 1, stats
    assert stats.early_runs == stats.api_replays, stats
