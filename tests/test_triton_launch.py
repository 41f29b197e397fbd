"""The Triton launchers' device logic without a GPU: which tensors the backend takes, a launch
under a (faked) CUDA device, a kernel Triton cannot build, the per-call lane table."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton_support as ts
from triton.runtime.errors import PTXASError
from triton_cases import elementwise_chain, trace

from tracejit.backends import resolve_backend


@pytest.fixture(autouse=True)
def _interpret():
    with ts.interpreter():
        yield


def test_cpu_tensors_are_fused_only_in_the_interpreter(monkeypatch):
    from tracejit.backends.triton import TritonBackend

    assert TritonBackend.device_type == "cuda" and TritonBackend().device_types == {"cuda", "cpu"}
    monkeypatch.delenv("TRACEJIT_BACKEND", raising=False)
    auto = resolve_backend("auto")  # the C backend keeps the CPU tensors even when Triton interprets
    assert getattr(auto, "by_device", {}).get("cpu", auto).name != "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert TritonBackend().device_types == {"cuda"}
    traced = trace(elementwise_chain)
    x, y = torch.randn(100), torch.randn(100)
    for _ in range(2):
        assert torch.equal(traced(x, y), elementwise_chain(x, y))
    assert ts.fused_op_count(traced) == 0


class _Recorder:
    """Stands in for a CUDA device guard and a compiled kernel: notes what happens in which order."""

    def __init__(self):
        self.events = []

    def __enter__(self):
        self.events.append("enter device")

    def __exit__(self, *exc):
        self.events.append("exit device")

    def __getitem__(self, grid):
        return lambda *args, **options: self.events.append(("launch", grid, len(args), options))


def cuda_launcher(kernel):
    """The elementwise_chain launcher built for a (fake) cuda:1 device, launching `kernel`; it
    allocates on the CPU and its device guard is a recorder. Returns (launcher, inputs, scalars)."""
    from tracejit.backends.triton.launch import make_launcher

    traced = trace(elementwise_chain)
    x, y = torch.randn(1000), torch.randn(1000)
    traced(x, y)
    (launcher,) = ts.triton_launchers(traced)
    cuda = torch.device("cuda", 1)
    spec = dataclasses.replace(launcher.spec, device=cuda, allocations=tuple(
        dataclasses.replace(meta, device=cuda) for meta in launcher.spec.allocations))
    fake = make_launcher(spec, launcher.kernel, kernel, launcher.__globals__["FALLBACK"], interpret=False)
    assert fake.__globals__["DEVICE"].idx == 1
    fake.__globals__.update(DEVICE=kernel, V0=torch.device("cpu"))
    return fake, [x, y], traced._entries()[0].program.initial_scalars


def test_a_cuda_kernel_launches_under_its_device():
    recorder = _Recorder()
    launcher, inputs, scalars = cuda_launcher(recorder)
    (out,) = launcher(inputs, scalars)
    launch = ("launch", (1,), 5, {"num_warps": 4, "enable_fp_fusion": False, "enable_reflect_ftz": False})
    assert recorder.events == ["enter device", launch, "exit device"] and out.shape == (1000,)


class _Unbuildable(_Recorder):
    def __getitem__(self, grid):
        def launch(*args, **options):
            self.events.append("build")
            raise PTXASError("ptxas fatal: unsupported instruction")
        return launch


def test_a_kernel_triton_cannot_build_sends_its_group_to_aten():
    unbuildable = _Unbuildable()
    launcher, inputs, scalars = cuda_launcher(unbuildable)
    with pytest.warns(UserWarning, match="could not build kernel .* runs through aten") as caught:
        (out,) = launcher(inputs, scalars)
    assert caught[0].filename == __file__  # the caller's line, not the generated launcher's (issue 14.9)
    assert ts.mismatch(out, elementwise_chain(*inputs), exact_match=True) is None  # aten's result
    (again,) = launcher(inputs, scalars)
    assert torch.equal(again, out) and unbuildable.events.count("build") == 1


def test_the_lane_table_is_copied_only_when_it_changes():
    from tracejit.backends.triton.launch import LaneTable

    table = LaneTable(torch.device("cpu"))
    first, again, changed = table(b"\x01" * 16), table(b"\x01" * 16), table(b"\x02" * 16)
    assert first is again and changed is not first
    assert changed.tolist() == [0x0202020202020202] * 2
