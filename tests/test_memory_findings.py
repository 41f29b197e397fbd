"""Findings of an adversarial hunt on the memory options and loaded graphs: recomputation that
must give the program's own bits, planner scores that must not overflow, loaded graphs that
write re-laid-out inputs and crafted files with arguments torch checks only in the kernel.

Each test failed before its fix (see the stop note of 2026-11-26).
"""

import copy
import io
import json
import zipfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 4))


def _step(x, y, *, model, opt):
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss, out


def _train(steps: int = 5, **options) -> tuple[list, list, tracejit.trace]:
    torch.manual_seed(0)
    model = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    traced = tracejit.trace(_step, **options)
    generator = torch.Generator().manual_seed(1)
    outputs = []
    for _ in range(steps):
        x, y = torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 4, (4,), generator=generator)
        outputs.append([t.clone() for t in traced(x, y, model=model, opt=opt)])
    return outputs, [p.detach().clone() for p in model.parameters()], traced


@pytest.mark.skipif(tracejit.backends.resolve_backend("c") is None, reason="no C compiler")
@pytest.mark.parametrize("without_host, memory", [
    (True, {"dtr_config": tracejit.DTRConfig(eviction_threshold=0, evictee_minimum_size=0)}),
    (False, {"sublinear_memory_config": tracejit.SublinearMemoryConfig(checkpoint_every=3)}),
], ids=["dtr_without_host", "sublinear_checked"])
def test_recomputation_keeps_the_programs_bits_with_batch_norm_row_kernels(without_host, memory):
    """At opt_level=3 the forward batch norm is a row kernel; backward's recomputation through
    aten's no_stats batch norm gave other bits (about 1e-6 after 5 steps)."""
    options = {"without_host": without_host, "backend": "c", "opt_level": 3}
    base_outputs, base_params, _ = _train(**options)
    outputs, params, traced = _train(**options, **memory)
    for got, want in zip(outputs, base_outputs):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(params, base_params))
    stats = traced.stats
    assert stats.host_free_calls >= 2 if without_host else stats.api_replays >= 2


def test_a_dtr_planner_with_large_factors_plans_instead_of_overflowing():
    torch.manual_seed(0)
    model = _cnn()
    eager_model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.05, momentum=0.9)
    config = tracejit.DTRConfig(eviction_threshold=0, evictee_minimum_size=0, recomp_time_factor=1000,
                                recomp_memory_factor=400.0)
    traced = tracejit.trace(_step, without_host=True, backend="aten", dtr_config=config)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 4, (4,), generator=generator)
        got = traced(x, y, model=model, opt=opt)
        want = _step(x, y, model=eager_model, opt=eager_opt)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), eager_model.parameters()))
    assert traced.stats.host_free_calls >= 2


def _writes_its_input(x):
    x.mul_(2)
    return x + 1


@pytest.mark.parametrize("backend", ["c", "aten"])
@pytest.mark.parametrize("layout", ["transposed", "negative"])
def test_a_loaded_graph_writes_an_input_given_in_another_layout(backend, layout):
    if backend == "c" and tracejit.backends.resolve_backend("c") is None:
        pytest.skip(f"no {backend} backend")
    traced = tracejit.trace(_writes_its_input, capture_as_const=True)
    traced(torch.randn(4, 3))
    buffer = io.BytesIO()
    traced.dump(buffer)
    graph = tracejit.load(buffer.getvalue(), backend=backend)
    x = torch.randn(3, 4).t() if layout == "transposed" else torch.randn(4, 3)._neg_view()
    eager_x = x.clone()
    (result,) = graph(x)
    assert torch.equal(result, _writes_its_input(eager_x))
    assert torch.equal(x, eager_x)  # the caller's tensor holds the write, as after eager's mul_


@pytest.mark.parametrize("op_name, dim_slot", [("aten::_softmax.default", 1)])
def test_load_refuses_a_dim_out_of_range_that_only_the_kernel_would_check(op_name, dim_slot):
    traced = tracejit.trace(lambda x: torch.softmax(x * 2, -1), capture_as_const=True)
    traced(torch.randn(2, 8))
    buffer = io.BytesIO()
    traced.dump(buffer, optimize_for_inference=False)
    archive = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    document = json.loads(archive.read("graph.json"))
    op = next(op for op in document["graphs"][0]["ops"] if op["op"] == op_name)
    op["args"][dim_slot] = 16  # a 2-d input
    crafted = io.BytesIO()
    with zipfile.ZipFile(crafted, "w") as out:
        out.writestr(zipfile.ZipInfo("graph.json"), json.dumps(document), compress_type=zipfile.ZIP_DEFLATED)
        out.writestr(zipfile.ZipInfo("weights.safetensors"), archive.read("weights.safetensors"),
                     compress_type=zipfile.ZIP_STORED)
    with pytest.raises(tracejit.LoadError, match="dim 16 is out of range for its 2-d input"):
        tracejit.load(crafted.getvalue())
