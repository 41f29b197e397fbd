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
    assert summary["recording_calls"] == 1 and summary["calls"] == calls - 1
    assert 0 < summary["nodes_total_ms"] <= summary["call_total_ms"]
    rows = report["rows"]
    addmm = [r for r in rows if r["node"] == "aten.addmm.default"]
    assert addmm and all(r["sources"][0].startswith("models.py:") for r in addmm)
    assert all("in forward" in r["sources"][0] for r in addmm)  # the line of nn.Linear's caller
    adam = [r for r in rows if r["node"] == "aten._fused_adam_.default"]
    assert adam and "in train_step" in adam[0]["sources"][0]
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert "aten.addmm.default" in format_table(report)

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
