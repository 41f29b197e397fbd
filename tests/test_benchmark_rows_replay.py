"""The benchmark rows' traced steps are served as docs/performance.md claims: every checked call
after the first few at the torch API level (no fallback, no refusal), and `without_host` calls by
the host-free program. A change that silently sends a row back to the aten level (a guard that
always misses, Python tracejit runs inside backward taken for a user's hook) fails here rather
than only showing as a slower benchmark."""

from __future__ import annotations

import pytest

import tracejit
from benchmarks import workloads

ROWS = ["mlp_train_small[foreach=False]", "mlp_train_small[fused=True]", "mlp_train_clipped", "mlp_infer_small",
        "cnn_train", "transformer_train"]


@pytest.mark.parametrize("backend", ["aten", "c"])  # c: what the benchmarks run (the default backend on CPU)
@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
@pytest.mark.parametrize("row", ROWS)
def test_a_benchmark_row_is_served_by_the_fast_path(row, without_host, backend):
    if without_host and row == "mlp_train_small[foreach=False]":
        pytest.skip("refused without the host (Adam's step.item()), as documented")
    case = workloads.WORKLOADS[row].build()
    traced = tracejit.trace(case.function, without_host=without_host, backend=backend)
    calls = 8
    for _ in range(calls):
        traced(*case.args, **case.kwargs)
    stats = traced.stats
    served = stats.host_free_calls if without_host else stats.api_replays
    assert served >= calls - 4, (stats, [e.api_refused or e.api_last_fallback for e in traced._entries()])
    assert stats.api_fallbacks == 0 and stats.host_free_misses == 0
    assert all(e.api_refused is None for e in traced._entries())
    if row == "mlp_train_clipped" and not without_host:  # the clip answered whole, not call by call
        assert stats.function_stand_ins == stats.api_replays
