"""Every Triton kernel the tests generate compiles offline for CUDA: `triton.compile` for
GPUTarget("cuda", 80, 32) and ("cuda", 90, 32), with the options the launches use, and no
approximate division or square root in the PTX."""

from __future__ import annotations

import pytest
import triton_support as ts
from triton_cases import CASES, huge_kernel, trace


@pytest.fixture(autouse=True)
def _interpret():
    with ts.interpreter():
        yield


def all_generated_kernels() -> list:
    """The kernels of every case, plus any other kernel the tests of this session generated."""
    for make in CASES.values():
        function, args, kwargs, info = make()
        traced = trace(function, **info.get("options", {}))
        for _ in range(info.get("calls", 1)):
            traced(*args, **kwargs)
        ts.triton_launchers(traced)  # records its kernels in ts.GENERATED
    kernel = huge_kernel()
    ts.GENERATED.setdefault(kernel.source, kernel)
    return list(ts.GENERATED.values())


def test_every_generated_kernel_compiles_for_cuda_targets():
    kernels = all_generated_kernels()
    assert len(kernels) >= len(CASES)
    problems = ts.compile_all(kernels)
    assert not problems, "\n\n".join(problems)
