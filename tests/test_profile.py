"""profiling=True: per-node timings, the summary, the Chrome trace, torch.profiler labels."""

import json

import pytest
import torch
from models import batch, make_model, train_step, twin

import tracejit
from tracejit.runtime.profile import format_table


def test_get_profile_without_profiling_says_what_to_do():
    traced = tracejit.trace(lambda x: x + 1)
    traced(torch.ones(2))
    with pytest.raises(RuntimeError, match="pass profiling=True"):
        traced.get_profile()
    with pytest.raises(RuntimeError, match="pass profiling=True"):
        traced.export_chrome_trace("unused.json")


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_profile_rows_cover_the_program_and_name_lines(without_host, tmp_path):
    (model_a, opt_a), (model_b, opt_b) = twin(make_model("mlp"), "adam_fused")
    plain = tracejit.trace(train_step, without_host=without_host)
    profiled = tracejit.trace(train_step, without_host=without_host, profiling=True)
    calls = 6
    for i in range(calls):
        x, y = batch("mlp", i)
        assert torch.equal(plain(x, y, model=model_a, opt=opt_a), profiled(x, y, model=model_b, opt=opt_b))
    report = profiled.get_profile()
    json.dumps(report)  # JSON-compatible
    summary = report["summary"]
    recorded = profiled.stats.records + profiled.stats.rerecords  # Adam's state made by the first call: a re-record
    assert summary["recording_calls"] == recorded and summary["calls"] == calls - recorded
    assert 0 < summary["nodes_total_ms"] <= summary["call_total_ms"]
    rows = report["rows"]
    addmm = [r for r in rows if r["node"] == "aten.addmm.default"]
    assert addmm and all(r["sources"][0].startswith("models.py:") for r in addmm)
    assert all("in forward" in r["sources"][0] for r in addmm)  # the line of nn.Linear's caller
    adam = [r for r in rows if r["node"] == "aten._fused_adam_.default"]
    assert adam and "in train_step" in adam[0]["sources"][0]
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    # the table shows every row given room (which rows make the top 15 depends on machine load)
    assert "aten.addmm.default" in format_table(report, limit=len(rows))

    path = tmp_path / "trace.json"
    profiled.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert events and all(e["ph"] == "X" and e["dur"] >= 0 for e in events)
    assert {e["name"] for e in events} >= {"aten.addmm.default", "aten._fused_adam_.default"}


def test_nodes_show_up_inside_torch_profiler():
    model = make_model("mlp").eval()

    @tracejit.trace(without_host=True, profiling=True)
    def infer(x, *, model):
        with torch.no_grad():
            return model(x)

    x, _ = batch("mlp", 0)
    infer(x, model=model), infer(x, model=model)
    with torch.profiler.profile() as prof:
        infer(x, model=model)
    names = {e.name for e in prof.events()}
    assert "tracejit/infer/aten.addmm.default" in names


def _line_of(function, text: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_rows_add_up_to_the_step_time_and_name_the_lines():
    from models import MLP, make_optimizer

    torch.manual_seed(0)
    model = MLP((256, 512, 512, 10))  # big enough that the nodes' work dominates a step
    opt = make_optimizer("adam_fused", model.parameters())
    # unfused, so every recorded op below is a node of its own
    profiled = tracejit.trace(train_step, without_host=True, profiling=True, backend="aten")
    for _ in range(8):
        profiled(torch.randn(64, 256), torch.randint(0, 10, (64,)), model=model, opt=opt)
    report = profiled.get_profile()
    summary, rows = report["summary"], report["rows"]
    checked = max((r["calls"] for r in rows if r["program"] == "checked replay"), default=0)
    host_free = [r for r in rows if r["program"] == "without_host"]
    replayed = 8 - profiled.stats.records - profiled.stats.rerecords  # fused Adam's fresh state: a re-record
    assert summary["calls"] == replayed and checked + host_free[0]["calls"] == replayed
    assert all(r["calls"] == host_free[0]["calls"] for r in host_free)  # every node timed once per call
    assert sum(r["total_ms"] for r in rows) == pytest.approx(summary["nodes_total_ms"])
    assert summary["outside_nodes_ms"] == pytest.approx(summary["call_total_ms"] - summary["nodes_total_ms"])
    # what is outside the rows is guards, binding and Python: how much depends on the machine's load
    # (under load, Python slows down more than the ops), so only the bounds are asserted
    assert 0 < summary["nodes_total_ms"] <= summary["call_total_ms"]

    forward = f"models.py:{_line_of(MLP.forward, 'return self.net(x)')} in forward"
    loss = f"models.py:{_line_of(train_step, 'F.cross_entropy')} in train_step"
    backward = f"models.py:{_line_of(train_step, 'loss.backward()')} in train_step"
    update = f"models.py:{_line_of(train_step, 'opt.step()')} in train_step"
    expected = {"aten.addmm.default": forward, "aten._addmm_activation.default": forward,
                "aten._log_softmax.default": loss, "aten.nll_loss_forward.default": loss,
                "aten.mm.default": backward, "aten.threshold_backward.default": backward,
                "aten._fused_adam_.default": update}
    for row in host_free:
        if row["node"] in expected:
            assert row["sources"] == [expected[row["node"]]], row
    assert {r["node"] for r in host_free} >= set(expected)
