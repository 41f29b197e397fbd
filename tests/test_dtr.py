"""dtr_config: training under a memory budget. The planner (passes/recompute_budget.py) chooses
forward values to recompute in backward so that the step's planned peak stays under the threshold;
results stay bit for bit eager's (backend="aten"), in without_host and in checked replay (served
at the API level)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import (
    DropoutAttention,
    assert_same_state,
    attention_step,
    train_attention_beside_eager,
    views_outside_their_storage,
)

import tracejit
from tracejit.passes.recompute_budget import planned_peak
from tracejit.passes.rematerialize import find_candidates, recompute_all_but


def deep_mlp(depth: int = 16, width: int = 128) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class ConvNet(nn.Module):
    """Conv + BatchNorm + ReLU blocks, dropout before the head."""

    def __init__(self, blocks: int = 8, channels: int = 16):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1),
                                                  nn.BatchNorm2d(channels), nn.ReLU()) for _ in range(blocks))
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(channels, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.drop(x.mean((2, 3))))


def step(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


CASES = {
    "deep_mlp": (deep_mlp, lambda g: torch.randn(1024, 128, generator=g), 1024),
    "cnn": (ConvNet, lambda g: torch.randn(16, 3, 24, 24, generator=g), 16),
}
# the share of the planned peak each case reaches under a threshold of half of it. The CNN's
# batch norms update their running statistics and cannot run again; their outputs are recomputed
# by the same kernel without the statistics (passes/rematerialize.py)
REACHED = {"deep_mlp": 0.5, "cnn": 0.5}


def host_free_graph(traced):
    return traced.history[-1][1]


def planned_peak_without_dtr(kind: str) -> int:
    make, data, n = CASES[kind]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    traced = tracejit.trace(step, without_host=True, backend="aten")
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        traced(data(g), torch.randint(0, 10, (n,), generator=g), model=model, opt=opt)
    return planned_peak(host_free_graph(traced))


@pytest.mark.parametrize("without_host", [True, False], ids=["without_host", "checked"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_trains_under_half_the_planned_peak_bitwise_as_eager(kind, without_host):
    make, data, n = CASES[kind]
    peak = planned_peak_without_dtr(kind)
    torch.manual_seed(0)
    model_a = make()
    model_b = copy.deepcopy(model_a)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.01, momentum=0.9)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.01, momentum=0.9)
    config = tracejit.DTRConfig(eviction_threshold=peak // 2, evictee_minimum_size=0)
    traced = tracejit.trace(step, without_host=without_host, backend="aten", dtr_config=config)
    g = torch.Generator().manual_seed(1)
    for i in range(5):
        x, y = data(g), torch.randint(0, 10, (n,), generator=g)
        torch.manual_seed(i)  # dropout draws the same numbers in both
        want = step(x, y, model=model_a, opt=opt_a)
        torch.manual_seed(i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), want), i
        assert_same_state(model_a, opt_a, model_b, opt_b)
    stats = traced.stats
    if without_host:
        assert stats.host_free_calls >= 3, stats
    else:
        assert stats.api_replays >= 2, stats  # the calls that run the planned program
    plan = host_free_graph(traced).recompute_plan
    assert plan is not None and plan.peak_before == peak
    assert plan.peak <= peak * REACHED[kind] and plan.evicted > 0 and plan.recomputed_ops > 0, plan
    if kind == "cnn":  # batch norm outputs recomputed without touching the running statistics
        targets = {str(n.target) for n in host_free_graph(traced).nodes}
        assert "aten._native_batch_norm_legit.no_stats" in targets, targets
    assert 0 < plan.extra_flops < plan.step_flops


@pytest.mark.parametrize("without_host", [True, False], ids=["without_host", "checked"])
def test_backward_views_of_recomputed_values_follow_the_copy(without_host):
    # the planner recomputes with rematerialize's rewriter: bmm's backward transposes the
    # recomputed attention weights, a view that kept the original's root (see test_sublinear.py)
    torch.manual_seed(0)
    model_a = DropoutAttention()
    model_b = copy.deepcopy(model_a)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.01)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.01)
    config = tracejit.DTRConfig(eviction_threshold=0, evictee_minimum_size=0)  # recompute all it can
    traced = tracejit.trace(attention_step, without_host=without_host, backend="aten", dtr_config=config)
    train_attention_beside_eager(traced, (model_a, opt_a), (model_b, opt_b), without_host)
    names = [name for name, _, _ in traced.history]
    before, planned = (traced.history[i][1] for i in (names.index("plan_recomputation") - 1,
                                                       names.index("plan_recomputation")))
    assert planned.recompute_plan.evicted > 0, planned.recompute_plan
    assert views_outside_their_storage(planned) == []
    # it evicts values backward takes views of: left with the original's root, such a view made
    # the original look alive through backward next to its copy, so the planner saw no saving and
    # kept them (had it evicted one, plan_memory would have reused the copy's buffer under the view)
    views_of_copies = [n for n in planned.nodes if n.backward_of and n.inputs and n.inputs[0] >= len(before.values)
                       and any(v is not None and planned.values[v].root != planned.values[v].handle
                               for v in n.outputs)]
    assert views_of_copies, planned.recompute_plan
    candidates = find_candidates(before)  # every eviction the planner may try
    for root in candidates.saved_roots:
        assert views_outside_their_storage(recompute_all_but(candidates, set(candidates.saved_roots) - {root})) == []


def test_a_threshold_above_the_peak_changes_nothing():
    peak = planned_peak_without_dtr("deep_mlp")
    make, data, n = CASES["deep_mlp"]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    traced = tracejit.trace(step, without_host=True, backend="aten",
                            dtr_config=tracejit.DTRConfig(eviction_threshold=2 * peak, evictee_minimum_size=0))
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        traced(data(g), torch.randint(0, 10, (n,), generator=g), model=model, opt=opt)
    plan = host_free_graph(traced).recompute_plan
    assert plan.peak == plan.peak_before == peak and plan.evicted == 0 and plan.recomputed_ops == 0


def test_values_under_the_minimum_size_are_kept():
    make, data, n = CASES["deep_mlp"]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # every activation of this model is 512 KiB: none may be recomputed
    config = tracejit.DTRConfig(eviction_threshold=0, evictee_minimum_size="1MiB")
    traced = tracejit.trace(step, without_host=True, backend="aten", dtr_config=config)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        traced(data(g), torch.randint(0, 10, (n,), generator=g), model=model, opt=opt)
    plan = host_free_graph(traced).recompute_plan
    assert plan.evicted == 0 and plan.peak == plan.peak_before


def test_the_profile_reports_the_plan():
    make, data, n = CASES["deep_mlp"]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    traced = tracejit.trace(step, without_host=True, backend="aten", profiling=True,
                            dtr_config=tracejit.DTRConfig(eviction_threshold="2MB", evictee_minimum_size=0))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        traced(data(g), torch.randint(0, 10, (n,), generator=g), model=model, opt=opt)
    memory = traced.get_profile()["memory"]
    assert memory["eviction_threshold"] == 2_000_000
    assert memory["planned_peak_bytes"] < memory["planned_peak_bytes_before"]
    assert memory["under_threshold"] == (memory["planned_peak_bytes"] <= 2_000_000)
    assert memory["recomputed_ops"] > 0 and 0 < memory["extra_compute"] < 1 and memory["arena_bytes"] > 0


@pytest.mark.parametrize("config, error, match", [
    (dict(eviction_threshold="lots"), ValueError, "eviction_threshold must be a number of bytes or a size"),
    (dict(eviction_threshold=-1), ValueError, "eviction_threshold must be a number of bytes >= 0"),
    (dict(evictee_minimum_size=1.5), ValueError, "evictee_minimum_size must be a number of bytes"),
    (dict(recomp_time_factor=-2), ValueError, "recomp_time_factor must be a number >= 0"),
])
def test_bad_config_values_name_the_field(config, error, match):
    with pytest.raises(error, match=match):
        tracejit.DTRConfig(**config)


def test_sizes_with_units():
    assert tracejit.DTRConfig(eviction_threshold="1.5GiB").eviction_threshold == 3 * 2**29
    assert tracejit.DTRConfig(eviction_threshold="512MB").eviction_threshold == 512 * 10**6
    assert tracejit.DTRConfig(evictee_minimum_size="4096").evictee_minimum_size == 4096


def test_bad_options_are_refused_when_decorating():
    with pytest.raises(TypeError, match="dtr_config must be a tracejit.DTRConfig, got dict"):
        tracejit.trace(step, dtr_config={"eviction_threshold": 1})
    with pytest.raises(ValueError, match="sublinear_memory_config and dtr_config both choose"):
        tracejit.trace(step, dtr_config=tracejit.DTRConfig(), sublinear_memory_config=tracejit.SublinearMemoryConfig())
