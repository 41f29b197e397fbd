"""Recurrent layers in training steps: GRU and RNN cells split their gates with ops whose outputs
share the input's memory without saying so (`unsafe_split`), and keep the pieces for backward.
The memory planner must not hand that memory to a later op (issue 15: GRU drifted from eager
under without_host, and so would checked replay at the API level, which runs the same program).
The oneDNN LSTM layer returns the workspace its backward needs only with gradients enabled
(issue 11: an LSTM training step failed without the host)."""

import copy

import pytest
import torch
import torch.nn as nn

import tracejit

MODES = {
    "checked": {},
    "symbolic": {"symbolic": True},
    "without_host": {"without_host": True},
    "symbolic_without_host": {"symbolic": True, "without_host": True},
    # fused C kernels for the gates' elementwise ops: within a few ulp of eager, not bitwise
    "without_host_c": {"without_host": True, "backend": "c"},
    # row kernels, views made once, the gates' copies and kernel results in the arena
    "without_host_graph_opt": {"without_host": True, "backend": "c", "graph_opt_config": tracejit.GraphOptimizationConfig(
        jit_fuse_reduce=True, jit_fuse_dimshuffle=True)},
}


class Tagger(nn.Module):
    def __init__(self, cell: type, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = cell(5, 8, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y)


def step(x, y, *, model, opt):
    loss = nn.functional.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("cell", [nn.GRU, nn.RNN, nn.LSTM], ids=["gru", "rnn", "lstm"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_recurrent_training_matches_eager_bitwise(cell, batch_first, mode, optimizer):
    torch.manual_seed(0)
    model_a = Tagger(cell, batch_first)
    model_b = copy.deepcopy(model_a)
    # fused Adam reads nothing on the host: it runs without_host and is recorded symbolically
    make = (lambda p: torch.optim.SGD(p, lr=0.1)) if optimizer == "sgd" else (
        lambda p: torch.optim.Adam(p, lr=0.01, fused=True))
    opt_a, opt_b = make(model_a.parameters()), make(model_b.parameters())
    traced = tracejit.trace(step, **{"backend": "aten", **MODES[mode]})
    exact = "backend" not in MODES[mode]
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    if cell is nn.LSTM and mode.startswith("symbolic"):
        # torch's fake kernel of the oneDNN LSTM layer predicts an empty workspace: a clear error
        x, y = torch.randn(4, 6, 5), torch.randint(0, 3, (4, 6))
        with pytest.raises(tracejit.SymbolicTraceError, match="Trace this function with symbolic=False"):
            traced(x, y, model=model_b, opt=opt_b)
        return
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, 6, 5, generator=g)
        y = torch.randint(0, 3, (4, 6), generator=g)
        assert same(traced(x, y, model=model_b, opt=opt_b), step(x, y, model=model_a, opt=opt_a)), i
        for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
            assert same(a, b), f"step {i}: {name}"
    stats = traced.stats
    assert stats.records == 1
    if not MODES[mode].get("without_host"):
        assert stats.checked_replays + stats.rerecords == 4 and stats.api_replays >= 2
    else:
        assert stats.host_free_calls >= 3


def _infer(x, *, model):
    return model(x)[0]


@pytest.mark.parametrize("mode", ["checked", "without_host"])
@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("cell", [nn.GRU, nn.LSTM], ids=["gru", "lstm"])
def test_recurrent_inference_matches_eager_bitwise(cell, context, mode):
    # the oneDNN LSTM layer recorded without gradients ran its inference primitive: the program ran
    # it with gradients enabled (the training primitive, other rounding) and drifted by a few ulp
    torch.manual_seed(0)
    model_a = cell(6, 6, num_layers=2).eval()
    model_b = copy.deepcopy(model_a)
    traced = tracejit.trace(_infer, backend="aten", **MODES[mode])
    for i in range(4):
        x = torch.randn(5, 3, 6, generator=torch.Generator().manual_seed(i))
        with context():
            assert torch.equal(traced(x, model=model_b), _infer(x, model=model_a)), i
    if mode == "checked":
        assert traced.stats.checked_replays == 3 and traced.stats.api_replays >= 1
    else:
        assert traced.stats.host_free_calls >= 2


def _distill_step(x, *, teacher, student, opt):
    with torch.no_grad():  # the same kind of layer, once without and once with gradients
        target = teacher(x)[0]
    loss = nn.functional.mse_loss(student(x)[0], target)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss, target


@pytest.mark.parametrize("mode", ["checked", "without_host"])
def test_lstm_without_and_with_gradients_in_one_step_matches_eager_bitwise(mode):
    torch.manual_seed(0)
    teacher, student = nn.LSTM(6, 6), nn.LSTM(6, 6)
    kwargs_a = {"teacher": teacher, "student": student}
    kwargs_b = copy.deepcopy(kwargs_a)
    kwargs_a["opt"] = torch.optim.SGD(student.parameters(), lr=0.1)
    kwargs_b["opt"] = torch.optim.SGD(kwargs_b["student"].parameters(), lr=0.1)
    traced = tracejit.trace(_distill_step, backend="aten", **MODES[mode])
    for i in range(4):
        x = torch.randn(5, 3, 6, generator=torch.Generator().manual_seed(i))
        got, want = traced(x, **kwargs_b), _distill_step(x, **kwargs_a)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), i
        for a, b in zip(student.parameters(), kwargs_b["student"].parameters()):
            assert torch.equal(a, b), i
    if mode == "checked":
        assert traced.stats.api_replays >= 1
    else:
        assert traced.stats.host_free_calls >= 2
