"""Traced functions and loaded graphs called from several threads at once.

A trace's compiled program reuses its buffers from call to call, and its checker holds the state
of one call: calls from several threads must take turns, and each must get its own results. Every
thread compares each result with eager on the same input, computed in that thread."""

from __future__ import annotations

import io
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tracejit

THREADS = 3
CALLS = 150


def _run_threads(work) -> list[str]:
    """Run `work(thread_index, barrier)` on THREADS threads started together; the errors they raised."""
    barrier = threading.Barrier(THREADS)
    errors: list[str] = []

    def run(index: int) -> None:
        try:
            work(index, barrier)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(f"thread {index}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


def _infer(x: torch.Tensor, *, model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        time.sleep(0)  # lets another thread in mid-call, as a longer function would
        return model(x).sigmoid() * 2 + x[:, :4]


@pytest.mark.parametrize("backend", ["aten", "c"])
@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
def test_one_traced_function_called_from_several_threads(backend, without_host):
    model = _mlp()
    traced = tracejit.trace(_infer, backend=backend, without_host=without_host)
    inputs = [torch.randn(8, 16) for _ in range(THREADS * 2)]
    for _ in range(3):
        traced(inputs[0], model=model)
    wrong = []

    def work(index: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        for i in range(CALLS):
            x = inputs[(index + i) % len(inputs)]
            got = traced(x, model=model)
            expected = _infer(x, model=model)
            if not torch.allclose(got, expected, rtol=1e-5, atol=1e-6):
                wrong.append((index, i))

    assert _run_threads(work) == []
    assert wrong == [], f"{len(wrong)} of {THREADS * CALLS} calls returned another call's values"
    stats = traced.stats
    if without_host:
        assert stats.host_free_calls >= THREADS * CALLS
    else:
        assert stats.api_replays >= THREADS * CALLS and stats.api_fallbacks == 0
    assert stats.records == 1


# the threads' calls alternate between models, which keeps this trace's checked calls at the aten level
@pytest.mark.filterwarnings("ignore::tracejit.ReplayLevelWarning")
def test_several_threads_train_their_own_models_through_one_traced_step():
    """One traced step, a model and an optimizer per thread (keyword arguments): each thread's
    model ends where eager training of a copy ends."""

    def step(x, y, *, model, opt):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        time.sleep(0)
        opt.step()
        return loss

    traced = tracejit.trace(step, backend="aten")
    torch.manual_seed(1)
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(4)]
    models = [_mlp().train() for _ in range(THREADS)]
    references = [_mlp().train() for _ in range(THREADS)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    reference_optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in references]
    steps = 20
    losses: dict[int, list] = {i: [] for i in range(THREADS)}

    def work(index: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        for i in range(steps):
            x, y = data[(index + i) % len(data)]
            losses[index].append(traced(x, y, model=models[index], opt=optimizers[index]).item())

    assert _run_threads(work) == []
    for index in range(THREADS):
        for i in range(steps):
            x, y = data[(index + i) % len(data)]
            expected = step(x, y, model=references[index], opt=reference_optimizers[index]).item()
            assert losses[index][i] == expected, (index, i)
        for got, expected in zip(models[index].parameters(), references[index].parameters()):
            assert torch.equal(got, expected)
            assert torch.equal(got.grad, expected.grad)
    assert traced.stats.checked_replays >= THREADS * (steps - 2)


def test_two_traced_functions_sharing_a_model_in_two_threads():
    """The forward stand-in one thread's checked call installs on the shared module answers only
    that thread: the other thread's call of the module runs it (and is checked by its own call)."""
    model = _mlp()
    first, second = tracejit.trace(_infer, backend="aten"), tracejit.trace(_infer, backend="aten")
    inputs = [torch.randn(8, 16) for _ in range(4)]
    for traced in (first, second):
        for _ in range(3):
            traced(inputs[0], model=model)
    wrong = []

    def work(index: int, barrier: threading.Barrier) -> None:
        traced = (first, second)[index % 2]
        barrier.wait()
        for i in range(CALLS):
            x = inputs[(index + i) % len(inputs)]
            if not torch.equal(traced(x, model=model), _infer(x, model=model)):
                wrong.append((index, i))

    assert _run_threads(work) == []
    assert wrong == []
    for traced in (first, second):
        assert traced.stats.api_replays >= CALLS and traced.stats.api_fallbacks == 0


def test_a_traced_function_called_again_from_its_own_excluded_block_raises():
    calls = {"again": False}

    @tracejit.trace
    def f(x):
        y = x * 2
        if calls["again"]:
            with tracejit.exclude_from_trace():
                f(x)
        return y + 1

    x = torch.randn(3)
    for _ in range(3):
        assert torch.equal(f(x), x * 2 + 1)
    calls["again"] = True
    with pytest.raises(RuntimeError, match=r"f\(\) was called again while its own call runs on this thread"):
        f(x)
    calls["again"] = False
    for _ in range(3):  # nothing left half done: the lock is free, the trace replays
        assert torch.equal(f(x), x * 2 + 1)
    assert f.stats.checked_replays >= 4


@pytest.mark.parametrize("backend", ["aten", "c"])
def test_a_loaded_graph_called_from_several_threads(backend):
    model = _mlp()

    def infer(x, *, model):
        with torch.no_grad():
            return model(x).sigmoid() * 2 + x[:, :4]

    traced = tracejit.trace(infer, capture_as_const=True)
    inputs = [torch.randn(8, 16) for _ in range(THREADS * 2)]
    traced(inputs[0], model=model)
    file = io.BytesIO()
    traced.dump(file)
    file.seek(0)
    loaded = tracejit.load(file, backend=backend)
    wrong = []

    def work(index: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        for i in range(CALLS):
            x = inputs[(index + i) % len(inputs)]
            (got,) = loaded(x)
            if not torch.allclose(got, infer(x, model=model), rtol=1e-5, atol=1e-6):
                wrong.append((index, i))

    assert _run_threads(work) == []
    assert wrong == [], f"{len(wrong)} of {THREADS * CALLS} calls returned another call's values"
