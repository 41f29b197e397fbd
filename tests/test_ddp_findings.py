"""DistributedDataParallel findings of a bug hunt, on 2 real gloo processes (the helpers of
tests/distributed_workers.py; see docs/distributed.md):

- a communication hook registered after tracing was ignored by `without_host=True` (the host-free
  calls kept the recorded plain all-reduce: silently other gradients than eager DDP's);
- a communication hook with Python state (PowerSGD) registered before the first call: host-free
  calls never ran it, so its state never advanced (silently other gradients from
  `start_powerSGD_iter` on);
- `Join([model])` entered after tracing: host-free calls skipped the all-reduces DDP's forward
  issues under Join, and gloo aborted the job.

Each run of scenarios is one spawn (process start-up is the cost); each test checks the facts its
scenario saved on both ranks.
"""

from __future__ import annotations

import os

import distributed_workers as workers
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tracejit

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WORLD = 2
STEPS = 6
HOOKED_AT = 5  # after the first host-free calls (a trace's first calls record and check)


def run(rank: int, world: int, directory: str, scenarios: list[str]) -> None:
    """Entry point of a spawned rank: play `scenarios`, save {name: facts} to rank<rank>.pt."""
    workers.play_scenarios(SCENARIOS, rank, world, directory, scenarios)
    os._exit(0)  # the scenarios leave calls that raised inside DDP's backward: do not tear gloo down


def quartered_all_reduce(state, bucket):
    """A comm hook of the user's: averages a quarter of the gradients."""
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size() * 4)
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def train_steps(step, model, opt, data: list, before=None) -> dict:
    """Train on `data` step by step (`before(i)` first, if given); stop at an exception. The
    facts: the step that raised (None), its type and message, every step's first gradient."""
    facts = {"step": None, "error_type": None, "error": "", "grads": [], "host_free_before": None}
    try:
        for i, (x, y) in enumerate(data):
            if before is not None:
                before(i, facts)
            facts["step"] = i
            step(x, y, model=model, opt=opt)
            facts["grads"].append(model.module[0].weight.grad.clone())
        facts["step"] = None
    except Exception as error:
        facts["error_type"], facts["error"] = type(error).__name__, str(error)
    if hasattr(step, "stats"):
        facts["host_free_calls"] = step.stats.host_free_calls
    return facts


def same_grads(eager: dict, traced: dict) -> bool:
    return len(eager["grads"]) == len(traced["grads"]) and all(map(torch.equal, eager["grads"], traced["grads"]))


def comm_hook_after_tracing(rank: int, world: int) -> dict:
    """A comm hook registered once host-free calls run (a custom one, torch's fp16 compression):
    eager DDP follows it; a host-free call must not keep the recorded all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    facts: dict = {"failures": [], "runs": {}}
    data = workers.batches(rank, steps=STEPS)
    for kind, hook in (("custom", quartered_all_reduce), ("fp16", default_hooks.fp16_compress_hook)):
        runs = {}
        for traced in (False, True):
            model = DistributedDataParallel(workers.mlp())
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            step = tracejit.trace(workers.ddp_step, without_host=True) if traced else workers.ddp_step

            def register(i, found, model=model, step=step, hook=hook):
                if i == HOOKED_AT:
                    found["host_free_before"] = getattr(step, "stats", None) and step.stats.host_free_calls
                    model.register_comm_hook(None, hook)

            runs[traced] = train_steps(step, model, opt, data, register)
        run = runs[True]
        run["same_as_eager"] = same_grads(runs[False], run)
        del run["grads"]
        facts["runs"][kind] = run
    return facts


def stateful_comm_hook(rank: int, world: int) -> dict:
    """Comm hooks registered before the first call: PowerSGD (Python state that advances every
    iteration) is refused without the host; stateless hooks (state None or the process group)
    train as eager DDP without the host."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    facts: dict = {"failures": [], "runs": {}}
    data = workers.batches(rank, steps=STEPS)
    hooks = {
        "powerSGD": lambda: (powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                    start_powerSGD_iter=4, min_compression_rate=0.5,
                                                    random_seed=0), powersgd.powerSGD_hook),
        "allreduce (process group)": lambda: (dist.group.WORLD, default_hooks.allreduce_hook),
        "fp16 (None)": lambda: (None, default_hooks.fp16_compress_hook),
    }
    for kind, make in hooks.items():
        runs = {}
        for traced in (False, True):
            model = DistributedDataParallel(workers.mlp())
            model.register_comm_hook(*make())
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            step = tracejit.trace(workers.ddp_step, without_host=True) if traced else workers.ddp_step
            runs[traced] = train_steps(step, model, opt, data)
        run = runs[True]
        run["same_as_eager"] = same_grads(runs[False], run)
        del run["grads"]
        facts["runs"][kind] = run
    return facts


def join_after_tracing(rank: int, world: int) -> dict:
    """5 even steps, then uneven inputs under Join (rank 0 four more, rank 1 two more), traced
    checked and without the host: the first call inside Join must not replay the program recorded
    outside it."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    facts: dict = {"failures": [], "runs": {}}
    data = workers.batches(rank, steps=9)
    for mode, options in (("without_host", {"without_host": True}), ("checked", {})):
        model = DistributedDataParallel(workers.mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        step = tracejit.trace(workers.ddp_step, **options)
        run = {"step": None, "error_type": None, "error": ""}
        try:
            for i, (x, y) in enumerate(data[:5]):
                run["step"] = i
                step(x, y, model=model, opt=opt)
            run["host_free_before"] = step.stats.host_free_calls
            with Join([model]):
                for i, (x, y) in enumerate(data[5:9 if rank == 0 else 7], start=5):
                    run["step"] = i
                    step(x, y, model=model, opt=opt)
            run["step"] = None
        except Exception as error:
            run["error_type"], run["error"] = type(error).__name__, str(error)
        facts["runs"][mode] = run
    return facts


SCENARIOS = {
    "stateful_comm_hook": stateful_comm_hook,
    "comm_hook_after_tracing": comm_hook_after_tracing,
    "join_after_tracing": join_after_tracing,
}


def play(tmp_path_factory, scenarios: list[str]) -> list[dict]:
    """{scenario: facts} of each rank after one 2-process run of `scenarios`."""
    directory = str(tmp_path_factory.mktemp("gloo"))
    mp.spawn(run, args=(WORLD, directory, scenarios), nprocs=WORLD, join=True)
    facts = [torch.load(os.path.join(directory, f"rank{rank}.pt")) for rank in range(WORLD)]
    for rank, found in enumerate(facts):
        for name in scenarios:
            assert not found[name]["failures"], f"rank {rank}, {name}:\n" + "\n".join(found[name]["failures"])
    return facts


@pytest.fixture(scope="module")
def hook_ranks(tmp_path_factory) -> list[dict]:
    return play(tmp_path_factory, ["stateful_comm_hook", "comm_hook_after_tracing"])


@pytest.fixture(scope="module")
def join_ranks(tmp_path_factory) -> list[dict]:
    # a run of its own: before the fix, gloo aborted a rank here
    return play(tmp_path_factory, ["join_after_tracing"])


@pytest.mark.parametrize("kind", ["custom", "fp16"])
def test_a_comm_hook_registered_after_tracing_is_not_ignored_without_the_host(hook_ranks, kind):
    for rank, facts in enumerate(hook_ranks):
        run = facts["comm_hook_after_tracing"]["runs"][kind]
        assert run["host_free_before"] >= 1, (rank, run)  # the hook came when calls ran without the host
        # the guard sees the hook and runs the function, which diverges from the trace (the recorded
        # all-reduce is not what the hook does) rather than computing the recorded gradients
        assert run["error_type"] == "TraceMismatchError" and run["step"] == HOOKED_AT, (
            rank, run["error_type"], run["step"], run["error"][:300], f"same as eager: {run['same_as_eager']}")
        assert "has the communication hooks" in run["error"] and "register_comm_hook" in run["error"], run["error"]


def test_a_comm_hook_with_python_state_is_refused_without_the_host(hook_ranks):
    steps = set()
    for rank, facts in enumerate(hook_ranks):
        run = facts["stateful_comm_hook"]["runs"]["powerSGD"]
        assert run["error_type"] == "HostDependencyError", (rank, run["error_type"], run["step"], run["error"][:300],
                                                            f"same as eager: {run['same_as_eager']}")
        assert "DistributedDataParallel module `model`" in run["error"], run["error"]
        assert "powerSGD_hook with a PowerSGDState" in run["error"], run["error"]
        steps.add(run["step"])
    assert len(steps) == 1 and steps != {None}  # every rank at the same call, before PowerSGD compresses


@pytest.mark.parametrize("kind", ["allreduce (process group)", "fp16 (None)"])
def test_a_stateless_comm_hook_trains_as_eager_without_the_host(hook_ranks, kind):
    for rank, facts in enumerate(hook_ranks):
        run = facts["stateful_comm_hook"]["runs"][kind]
        assert run["error_type"] is None, (rank, run["error"])
        assert run["same_as_eager"], rank
        assert run["host_free_calls"] >= 2, (rank, run)


@pytest.mark.parametrize("mode", ["without_host", "checked"])
def test_join_entered_after_tracing_runs_the_function(join_ranks, mode):
    for rank, facts in enumerate(join_ranks):
        run = facts["join_after_tracing"]["runs"][mode]
        if mode == "without_host":
            assert run["host_free_before"] >= 1, (rank, run)
        # the first call inside Join diverges on every rank, before any collective: no gloo abort
        assert run["error_type"] == "TraceMismatchError" and run["step"] == 5, (rank, run)
        assert "runs inside a Join context" in run["error"], run["error"]
