"""What each rank of the 2-process gloo tests runs (tests/test_distributed.py).

Process start-up dominates, so one spawned run plays every scenario; each scenario returns a dict
of facts (failures, stats) that the rank saves for the parent's tests to check. A scenario never
asserts itself: one failing scenario must not hide the others.
"""

from __future__ import annotations

import datetime
import itertools
import os
import time
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tracejit

STEPS = 10
ALL_REDUCE = "tracejit.all_reduce_.default"


def play_scenarios(table: dict, rank: int, world: int, directory: str, scenarios: list[str]) -> None:
    """Join the gloo group and play `scenarios` from `table`, saving {name: facts} to rank<rank>.pt
    after each (a scenario that raises has its traceback as its failure)."""
    torch.set_num_threads(1)
    os.environ["TRACEJIT_BACKEND"] = "aten"  # as in the parent test session; scenarios name others
    warnings.simplefilter("ignore")
    store = dist.FileStore(os.path.join(directory, "store"), world)
    # a hang shows as gloo's timeout error within a minute, not as a stuck test run
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {}
    for name in scenarios:
        started = time.perf_counter()
        try:
            facts = table[name](rank, world)
        except Exception:
            facts = {"failures": [f"raised:\n{traceback.format_exc()}"]}
        facts["seconds"] = time.perf_counter() - started
        results[name] = facts
        torch.save(results, os.path.join(directory, f"rank{rank}.pt"))


def run(rank: int, world: int, directory: str, scenarios: list[str]) -> None:
    """Entry point of a spawned rank: play `scenarios`, save {name: facts} to rank<rank>.pt."""
    play_scenarios(SCENARIOS, rank, world, directory, scenarios)
    if any(SCENARIOS_LEAVE_GROUP_BROKEN.intersection(scenarios)):
        os._exit(0)  # a collective abandoned on purpose may still wait inside gloo: do not join it
    dist.destroy_process_group()


# -- models and steps ----------------------------------------------------------------------------

def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def mlp_bn() -> nn.Module:
    """torch.nn layers only (the API level answers DDP around it whole), with BatchNorm's running
    statistics: buffers DDP broadcasts in every synchronized forward."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


class SmallCNN(nn.Module):
    """Convolution, BatchNorm (running statistics: buffers DDP broadcasts every forward), pooling."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(F.max_pool2d(F.relu(self.bn(self.conv(x))), 2).flatten(1))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN()


def batches(rank: int, steps: int = STEPS, shape: tuple = (8, 6)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    return [(torch.randn(*shape, generator=generator), torch.randn(shape[0], 3, generator=generator))
            for _ in range(steps)]


def all_reduce_step(x, y, *, model, opt, world):
    """Hand-written data parallelism: average the gradients with one all_reduce per parameter."""
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    opt.step()
    return loss


def ddp_step(x, y, *, model, opt):
    """The usual step; the DDP-wrapped model averages the gradients during backward."""
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def micro_step(x, y, *, model):
    """Forward and backward of one micro-batch of gradient accumulation."""
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=0.01, fused=True),
}


def train(step, model: nn.Module, opt: torch.optim.Optimizer, data: list, **kwargs) -> list[torch.Tensor]:
    return [step(x, y, model=model, opt=opt, **kwargs).detach().clone() for x, y in data]


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters, gradients, buffers and optimizer state by name."""
    found = {f"param {n}": p.detach() for n, p in model.named_parameters()}
    found.update({f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None})
    found.update({f"buffer {n}": b for n, b in model.named_buffers()})
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                found[f"opt {names[id(p)]}.{key}"] = value
    return found


def differences(expected: dict, got: dict, exact: bool) -> list[str]:
    """What differs between two state_of() dicts (bitwise, or within float tolerance)."""
    problems = []
    if expected.keys() != got.keys():
        problems.append(f"state keys differ: {sorted(expected.keys() ^ got.keys())}")
    for key in sorted(expected.keys() & got.keys()):
        a, b = expected[key], got[key]
        same = torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        if not same:
            problems.append(f"{key}: max difference {(a.float() - b.float()).abs().max().item():.3g}")
    return problems


def count_ops(traced, name: str) -> int:
    return max((sum(str(op.op) == name for op in record.ops) for record in traced.records), default=0)


# -- scenarios -------------------------------------------------------------------------------------

def hand_written_all_reduce(rank: int, world: int) -> dict:
    """10 steps of all_reduce data parallelism (MLP; CNN with BatchNorm), traced in each mode,
    against eager."""
    facts: dict = {"failures": [], "runs": {}}
    modes = [
        ("aten checked", {"backend": "aten"}, True),
        ("aten without_host", {"backend": "aten", "without_host": True}, True),
        ("auto checked", {"backend": "auto"}, False),
        ("auto without_host", {"backend": "auto", "without_host": True}, False),
    ]
    for (model_name, factory, shape), optimizer in itertools.product(
            (("mlp", mlp, (8, 6)), ("cnn", cnn, (4, 3, 8, 8))), OPTIMIZERS):
        data = batches(rank, shape=shape)
        model = factory()
        opt = OPTIMIZERS[optimizer](model.parameters())
        eager_losses = train(all_reduce_step, model, opt, data, world=world)
        eager = state_of(model, opt)
        for mode, options, exact in modes:
            if options.get("without_host") and optimizer == "adam":
                continue  # foreach Adam reads step.item() on the host: no without_host (see the guide)
            label = f"{model_name} {optimizer} {mode}"
            model = factory()
            opt = OPTIMIZERS[optimizer](model.parameters())
            traced = tracejit.trace(all_reduce_step, **options)
            losses = train(traced, model, opt, data, world=world)
            problems = differences(eager, state_of(model, opt), exact)
            problems += [f"loss {i}" for i, (a, b) in enumerate(zip(eager_losses, losses))
                         if not (torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5))]
            facts["failures"] += [f"{label}: {p}" for p in problems]
            stats = traced.stats
            facts["runs"][label] = {
                "replays": stats.checked_replays + stats.host_free_calls,
                "host_free_calls": stats.host_free_calls,
                "all_reduces": count_ops(traced, ALL_REDUCE),
                "parameters": len(list(model.parameters())),
                "bucketed": [len(n.inputs) for n in bucketed_nodes(traced)],
                "api_replays": stats.api_replays,
                "api_refused": [e.api_refused for e in traced._entries() if e.api_refused],
            }
    return facts


def bucketed_nodes(traced) -> list:
    """The bucketed all-reduces of the traced function's host-free program (bucket_all_reduces)."""
    graph = traced.history[-1][1] if traced.history else None
    return [n for n in graph.nodes if n.name == "tracejit.all_reduce_bucket_.default"] if graph else []


def other_collectives(rank: int, world: int) -> dict:
    """broadcast, all_gather_into_tensor, reduce_scatter_tensor and a MAX all_reduce in a trace."""

    def step(x, *, w):
        dist.broadcast(w, src=0)
        gathered = torch.empty(world * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(gathered, x * 2)
        scattered = torch.empty(gathered.shape[0] // world, *x.shape[1:])
        dist.reduce_scatter_tensor(scattered, gathered.sin())
        peak = x.abs().sum(0)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, async_op=True).wait()  # recorded as a finished Work
        w.add_(scattered.mean(0) + peak)
        return gathered.sum(1), scattered

    facts: dict = {"failures": [], "runs": {}}
    inputs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(rank * 10 + i)) for i in range(4)]
    w_eager = torch.full((3,), float(rank))
    expected = [tuple(t.clone() for t in step(x, w=w_eager)) for x in inputs]
    for mode, options in (("checked", {}), ("without_host", {"without_host": True}), ("symbolic", {"symbolic": True})):
        w = torch.full((3,), float(rank))
        traced = tracejit.trace(step, backend="aten", **options)
        got = [tuple(t.clone() for t in traced(x, w=w)) for x in inputs]
        for i, (a, b) in enumerate(zip(expected, got)):
            if not all(torch.equal(p, q) for p, q in zip(a, b)):
                facts["failures"].append(f"{mode}: call {i} returns other values than eager")
        if not torch.equal(w, w_eager):
            facts["failures"].append(f"{mode}: the broadcast and updated tensor differs from eager's")
        ops = [str(op.op) for op in traced.records[0].ops if str(op.op).startswith("tracejit.")]
        facts["runs"][mode] = {"replays": traced.stats.checked_replays + traced.stats.host_free_calls,
                               "collectives": ops}
    return facts


def ddp(rank: int, world: int) -> dict:
    """10 steps of DDP (MLP; CNN with BatchNorm), traced in each mode, against eager DDP."""
    from torch.nn.parallel import DistributedDataParallel

    facts: dict = {"failures": [], "runs": {}}
    modes = [
        ("aten checked", {"backend": "aten"}, True),
        ("aten without_host", {"backend": "aten", "without_host": True}, True),
        ("auto checked", {"backend": "auto"}, False),
        ("auto without_host", {"backend": "auto", "without_host": True}, False),
    ]
    for model_name, factory, shape in (("mlp", mlp, (8, 6)), ("cnn", cnn, (4, 3, 8, 8))):
        data = batches(rank, shape=shape)
        for optimizer in OPTIMIZERS:
            model = DistributedDataParallel(factory())
            opt = OPTIMIZERS[optimizer](model.parameters())
            eager_losses = train(ddp_step, model, opt, data)
            eager = state_of(model.module, opt)
            for mode, options, exact in modes:
                if options.get("without_host") and optimizer == "adam":
                    continue  # foreach Adam reads step.item() on the host
                label = f"{model_name} {optimizer} {mode}"
                model = DistributedDataParallel(factory())
                opt = OPTIMIZERS[optimizer](model.parameters())
                traced = tracejit.trace(ddp_step, **options)
                losses = train(traced, model, opt, data)
                problems = differences(eager, state_of(model.module, opt), exact)
                problems += [f"loss {i}" for i, (a, b) in enumerate(zip(eager_losses, losses))
                             if not (torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5))]
                facts["failures"] += [f"{label}: {p}" for p in problems]
                stats = traced.stats
                facts["runs"][label] = {
                    "replays": stats.checked_replays + stats.host_free_calls,
                    "host_free_calls": stats.host_free_calls,
                    "all_reduces": count_ops(traced, ALL_REDUCE),
                    "parameters": len(list(model.parameters())),
                    "broadcasts": count_ops(traced, "tracejit.broadcast_.default"),
                    "api_replays": stats.api_replays,
                    "ddp_stand_ins": stats.ddp_stand_ins,
                    "api_refused": [e.api_refused for e in traced._entries() if e.api_refused],
                }
    return facts


def ddp_options(rank: int, world: int) -> dict:
    """gradient_as_bucket_view=True without the host; find_unused_parameters=True checked, and refused
    without the host (its reducer reads a value on the host in backward)."""
    from torch.nn.parallel import DistributedDataParallel

    facts: dict = {"failures": [], "runs": {}}
    data = batches(rank)
    for label, ddp_options, options in (
        ("bucket view without_host", {"gradient_as_bucket_view": True}, {"without_host": True}),
        ("find unused checked", {"find_unused_parameters": True}, {}),
        ("find unused without_host", {"find_unused_parameters": True}, {"without_host": True}),
    ):
        results = []
        for traced in (False, True):
            model = DistributedDataParallel(mlp(), **ddp_options)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            step = tracejit.trace(ddp_step, backend="aten", **options) if traced else ddp_step
            try:
                train(step, model, opt, data)
            except tracejit.HostDependencyError as error:
                facts["runs"][label] = {"refused": str(error)}
                break
            results.append(state_of(model.module, opt))
            if traced:
                facts["runs"][label] = {"replays": step.stats.checked_replays + step.stats.host_free_calls}
                facts["failures"] += [f"{label}: {p}" for p in differences(results[0], results[1], exact=True)]
    return facts


def ddp_no_sync(rank: int, world: int) -> dict:
    """Gradient accumulation over 3 micro-batches, the first two under no_sync(): the synchronized
    micro-step selects a trace of its own."""
    from torch.nn.parallel import DistributedDataParallel

    facts: dict = {"failures": [], "runs": {}}
    data = batches(rank, steps=15)
    results = []
    for traced in (False, True):
        model = DistributedDataParallel(mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        step = tracejit.trace(micro_step, backend="aten") if traced else micro_step
        for i in range(0, len(data), 3):
            for j, (x, y) in enumerate(data[i:i + 3]):
                if j < 2:
                    with model.no_sync():
                        step(x, y, model=model)
                else:
                    step(x, y, model=model)
            opt.step()
            opt.zero_grad()
        results.append(state_of(model.module, opt))
        if traced:
            facts["runs"]["traced"] = {"replays": step.stats.checked_replays, "traces": len(step.records),
                                       "all_reduces": sorted(sum(str(op.op) == ALL_REDUCE for op in r.ops)
                                                             for r in step.records)}
    facts["failures"] += differences(results[0], results[1], exact=True)
    return facts


def ddp_micro_bucket_views(rank: int, world: int) -> dict:
    """gradient_as_bucket_view=True, the traced step only forward and backward, opt.step() and
    zero_grad() outside: DDP's backward sets each `.grad` to its bucket view again after
    zero_grad(), which calls without the aten-level backward left None (the step did nothing)."""
    from torch.nn.parallel import DistributedDataParallel

    facts: dict = {"failures": [], "runs": {}}
    data = batches(rank, steps=8)
    for label, options in (("checked aten", {"backend": "aten"}), ("checked c", {"backend": "c"}),
                           ("without_host", {"backend": "aten", "without_host": True})):
        models = [DistributedDataParallel(mlp(), gradient_as_bucket_view=True) for _ in range(2)]
        opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
        traced = tracejit.trace(micro_step, **options)
        for i, (x, y) in enumerate(data):
            for step, model, opt in ((micro_step, models[0], opts[0]), (traced, models[1], opts[1])):
                step(x, y, model=model)
                if any(p.grad is None for p in model.parameters()):
                    facts["failures"].append(f"{label} call {i}: a .grad is None after {step.__name__}()")
                opt.step()
                opt.zero_grad()
            facts["failures"] += [f"{label} call {i}: {d}" for d in differences(
                state_of(models[0].module, opts[0]), state_of(models[1].module, opts[1]), exact=options["backend"] == "aten")]
        facts["runs"][label] = {"api_replays": traced.stats.api_replays, "host_free_calls": traced.stats.host_free_calls}
    return facts


def ddp_forward(x, *, model):
    return model(x)


def ddp_forward_sync(rank: int, world: int) -> dict:
    """DDP(MLP + BatchNorm) without the host: a training step, then a forward under no_grad in train
    mode (BatchNorm updates its running statistics). DDP's _post_forward leaves
    require_forward_param_sync False after the no_grad forward, so the next training forward does
    not broadcast the buffers: a host-free call must leave the flag as eager does (it did not, and
    rank 1's running statistics took rank 0's)."""
    from torch.nn.parallel import DistributedDataParallel

    facts: dict = {"failures": [], "runs": {}}
    data = batches(rank, steps=8)
    results = []
    for traced in (False, True):
        model = DistributedDataParallel(mlp_bn())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        options = {"backend": "aten", "without_host": True}
        step = tracejit.trace(ddp_step, **options) if traced else ddp_step
        forward = tracejit.trace(ddp_forward, **options) if traced else ddp_forward
        flags = []
        for x, y in data:
            step(x, y, model=model, opt=opt)
            with torch.no_grad():
                forward(x, model=model)
            flags.append(model.require_forward_param_sync)
        results.append((state_of(model.module, opt), flags))
        if traced:
            facts["runs"]["traced"] = {"host_free_calls": step.stats.host_free_calls + forward.stats.host_free_calls}
    facts["failures"] += differences(results[0][0], results[1][0], exact=True)
    if results[0][1] != results[1][1]:
        facts["failures"].append(f"require_forward_param_sync: eager {results[0][1]}, traced {results[1][1]}")
    return facts


def stop_together(rank: int, key: str) -> None:
    """Rank 1 stays alive (its connections open) until rank 0 stopped: rank 0 cannot learn of the
    failure from a closed connection, only from the store."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set(key, "1")
    else:
        store.wait([key], datetime.timedelta(seconds=60))


def api_facts(traced) -> dict:
    stats = traced.stats
    return {"api_replays": stats.api_replays, "ddp_stand_ins": stats.ddp_stand_ins, "api_fallbacks": stats.api_fallbacks,
            "checked_replays": stats.checked_replays, "traces": len(traced.records),
            "api_refused": [e.api_refused for e in traced._entries() if e.api_refused],
            "last_fallbacks": [e.api_last_fallback for e in traced._entries() if e.api_last_fallback]}


def ddp_api_level(rank: int, world: int) -> dict:
    """Checked replay (the default mode) of DDP steps at the API level: DDP answered whole, the
    program running the reducer's all-reduces and the buffer broadcast. Eager DDP and the traced
    step run side by side; parameters, gradients, buffers and optimizer state must agree after
    every one of the 10 steps (bitwise with backend="aten")."""
    from torch.nn.parallel import DistributedDataParallel

    facts: dict = {"failures": [], "runs": {}}
    # gradients as views of the buckets, one bucket per parameter (bucket_cap_mb of 512 bytes)
    bucket_views = {"gradient_as_bucket_view": True, "bucket_cap_mb": 512 / 2**20}
    for (model_name, factory, options), optimizer, (backend, exact) in itertools.product(
            (("mlp", mlp, {}), ("mlp_bn", mlp_bn, {}), ("mlp_bn_views", mlp_bn, bucket_views)), OPTIMIZERS,
            (("aten", True), ("auto", False))):
        label = f"{model_name} {optimizer} {backend}"
        eager_model = DistributedDataParallel(factory(), **options)
        eager_opt = OPTIMIZERS[optimizer](eager_model.parameters())
        model = DistributedDataParallel(factory(), **options)
        opt = OPTIMIZERS[optimizer](model.parameters())
        traced = tracejit.trace(ddp_step, backend=backend)
        api_by_step = []
        for i, (x, y) in enumerate(batches(rank)):
            expected = ddp_step(x, y, model=eager_model, opt=eager_opt)
            got = traced(x, y, model=model, opt=opt)
            api_by_step.append(traced.stats.api_replays)
            problems = differences(state_of(eager_model.module, eager_opt), state_of(model.module, opt), exact)
            if not (torch.equal(expected, got) if exact else torch.allclose(expected, got, rtol=1e-5)):
                problems.append("loss")
            facts["failures"] += [f"{label} step {i}: {p}" for p in problems]
        facts["runs"][label] = {**api_facts(traced), "api_by_step": api_by_step,
                                "broadcasts": count_ops(traced, "tracejit.broadcast_.default"),
                                "all_reduces": count_ops(traced, ALL_REDUCE)}
    return facts


def ddp_api_no_sync(rank: int, world: int) -> dict:
    """Gradient accumulation at the API level: 8 rounds of 3 micro-batches, the first two under
    no_sync(). Each micro-step state (no_sync with and without gradients, the synchronizing one)
    selects its own trace, and each is answered at the API level once it has replayed."""
    from torch.nn.parallel import DistributedDataParallel

    facts: dict = {"failures": [], "runs": {}}
    data = batches(rank, steps=24)
    eager_model = DistributedDataParallel(mlp_bn())
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.05, momentum=0.9)
    model = DistributedDataParallel(mlp_bn())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = tracejit.trace(micro_step, backend="aten")
    for i in range(0, len(data), 3):
        for j, (x, y) in enumerate(data[i:i + 3]):
            for run, ddp_model in ((micro_step, eager_model), (step, model)):
                if j < 2:
                    with ddp_model.no_sync():
                        run(x, y, model=ddp_model)
                else:
                    run(x, y, model=ddp_model)
            facts["failures"] += [f"micro-step {i + j}: {p}" for p in differences(
                state_of(eager_model.module, eager_opt), state_of(model.module, opt), exact=True)]
        for o in (eager_opt, opt):
            o.step()
            o.zero_grad()
    facts["runs"]["traced"] = {**api_facts(step), "all_reduces": sorted(
        sum(str(op.op) == ALL_REDUCE for op in r.ops) for r in step.records)}
    return facts


def ddp_api_settings(rank: int, world: int) -> dict:
    """DDP settings changed by hand between API-level calls. With the model a keyword argument,
    `require_backward_grad_sync` and `forward_sync_buffers` (what broadcast_buffers sets) are part
    of the trace's signature: flipping one selects (records) a trace of its own on every rank, which
    trains as eager DDP. A setting outside the signature (`broadcast_bucket_size`, which splits the
    buffer broadcast) is found by the DDP stand-in's own check: the call falls back to the aten
    level, which raises its TraceMismatchError on every rank (other broadcasts than recorded), before
    any collective. Never a silently wrong result."""
    from torch.nn.parallel import DistributedDataParallel

    facts: dict = {"failures": [], "runs": {}}
    data = batches(rank, steps=12)
    for attribute in ("require_backward_grad_sync", "forward_sync_buffers"):
        eager_model, model = DistributedDataParallel(mlp_bn()), DistributedDataParallel(mlp_bn())
        eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.05, momentum=0.9)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        traced = tracejit.trace(ddp_step, backend="aten")
        api_before = None
        for i, (x, y) in enumerate(data):
            if i == 8:
                api_before = traced.stats.api_replays
                setattr(eager_model, attribute, False)
                setattr(model, attribute, False)
            ddp_step(x, y, model=eager_model, opt=eager_opt)
            traced(x, y, model=model, opt=opt)
            facts["failures"] += [f"{attribute} step {i}: {p}" for p in differences(
                state_of(eager_model.module, eager_opt), state_of(model.module, opt), exact=True)]
        facts["runs"][attribute] = {**api_facts(traced), "api_before_flip": api_before}

    # a setting outside the signature: the buffer broadcast's bucket size (8 bytes: one broadcast
    # per buffer instead of one for all three)
    model = DistributedDataParallel(mlp_bn())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    traced = tracejit.trace(ddp_step, backend="aten")
    run: dict = {"error_type": None}
    for i, (x, y) in enumerate(data):
        if i == 8:
            run["api_before_flip"] = traced.stats.api_replays
            model.broadcast_bucket_size = 8
        try:
            traced(x, y, model=model, opt=opt)
        except Exception as error:  # noqa: BLE001 - the fact checked
            run.update(step=i, error_type=type(error).__name__, error=str(error)[:2000])
            break
    facts["runs"]["broadcast_bucket_size"] = {**run, **api_facts(traced)}
    return facts


def ddp_unkeyworded(rank: int, world: int) -> dict:
    """DDP reached without a keyword: through the step's closure, or inside a keyword module. Its
    state (the bucket rebuild, the buffer broadcast) must select traces as a keyword DDP's does:
    10 steps in each mode against eager DDP, checked after every step."""
    from torch.nn.parallel import DistributedDataParallel

    def closure_step(model, opt):
        def step(x, y):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss
        return step

    def nested_step(x, y, *, holder, opt):
        opt.zero_grad()
        loss = F.mse_loss(holder["ddp"](x), y)
        loss.backward()
        opt.step()
        return loss

    facts: dict = {"failures": [], "runs": {}}
    modes = (("aten checked", {"backend": "aten"}, True), ("aten without_host", {"backend": "aten", "without_host": True}, True),
             ("auto checked", {"backend": "auto"}, False))
    for reached, (model_name, factory), optimizer, (mode, options, exact) in itertools.product(
            ("closure", "nested"), (("mlp", mlp), ("mlp_bn", mlp_bn)), ("sgd_momentum", "adam_fused"), modes):
        label = f"{reached} {model_name} {optimizer} {mode}"
        eager_model = DistributedDataParallel(factory())
        eager_opt = OPTIMIZERS[optimizer](eager_model.parameters())
        model = DistributedDataParallel(factory())
        opt = OPTIMIZERS[optimizer](model.parameters())
        if reached == "closure":
            traced = tracejit.trace(closure_step(model, opt), **options)
            call = traced
        else:
            holder = nn.ModuleDict({"ddp": model})
            traced = tracejit.trace(nested_step, **options)
            call = lambda x, y: traced(x, y, holder=holder, opt=opt)  # noqa: E731
        for i, (x, y) in enumerate(batches(rank)):
            expected = ddp_step(x, y, model=eager_model, opt=eager_opt)
            try:
                got = call(x, y)
            except Exception as error:  # noqa: BLE001 - a fact for the parent test
                facts["failures"].append(f"{label} step {i}: {type(error).__name__}: {str(error).splitlines()[0]}")
                break
            problems = differences(state_of(eager_model.module, eager_opt), state_of(model.module, opt), exact)
            if not (torch.equal(expected, got) if exact else torch.allclose(expected, got, rtol=1e-5)):
                problems.append("loss")
            facts["failures"] += [f"{label} step {i}: {p}" for p in problems]
        stats = traced.stats
        facts["runs"][label] = {**api_facts(traced), "host_free_calls": stats.host_free_calls,
                                "records": stats.records + stats.rerecords}
    return facts


def diverging_step(x, y, *, model, opt):
    """The usual DDP step, which takes another branch on the rank and step DIVERGE says."""
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    if DIVERGE["now"]:
        loss = loss * 2
    loss.backward()
    opt.step()
    return loss


def ddp_diverging_at(rank: int, step: int, steps: int, stopped_key: str) -> dict:
    """DDP training in which rank 1 takes another branch at `step`: the facts of the call that
    raised on each rank (how long it took, and whether it began at the API level)."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(mlp())
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    traced = tracejit.trace(diverging_step, backend="aten")
    facts: dict = {"failures": []}
    for i, (x, y) in enumerate(batches(rank, steps=steps)):
        DIVERGE["now"] = rank == 1 and i == step
        facts["api_before"] = traced.stats.api_replays
        facts["api_ready"] = any(e.api is not None for e in traced._entries())  # this call starts at the API level
        started = time.perf_counter()
        try:
            traced(x, y, model=model, opt=opt)
        except Exception as error:
            facts.update(step=i, error_type=type(error).__name__, error=str(error),
                         raised_after=time.perf_counter() - started, **api_facts(traced))
            stop_together(rank, stopped_key)
            return facts
    facts["failures"].append("every step ran")
    return facts


def ddp_api_divergence(rank: int, world: int) -> dict:
    """Rank 1 takes another branch at step 7, after the API level has answered the DDP steps: it
    diverges before the program runs and falls back to the aten level, which raises its mismatch;
    rank 0, inside the program's all-reduce, must raise too instead of waiting for gloo."""
    return ddp_diverging_at(rank, 7, 9, "test/ddp_rank0_stopped")


def record_disagreement(rank: int, world: int) -> dict:
    """Rank 1 reduces with MAX where rank 0 sums: both ranks raise at record time, naming it."""

    def step(x):
        total = x * 1
        dist.all_reduce(total, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
        return total

    traced = tracejit.trace(step, backend="aten")
    try:
        traced(torch.ones(3))
    except tracejit.CollectiveMismatchError as error:
        return {"failures": [], "error": str(error), "traces": len(traced.records)}
    return {"failures": ["no CollectiveMismatchError"]}


def handled_failure(rank: int, world: int) -> dict:
    """Every rank raises the same error (without_host refuses foreach Adam's host reads) and handles
    it; rank 1 takes 0.6 s longer to come back. Rank 0 waits in the next all-reduce beyond a polling
    slice while rank 1's posted failure still stands: it must keep waiting, not abort."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    refused = tracejit.trace(all_reduce_step, backend="aten", without_host=True)
    facts: dict = {"failures": []}
    data = batches(rank, steps=9)
    try:
        for x, y in data[:6]:
            refused(x, y, model=model, opt=opt, world=world)
        facts["failures"].append("without_host did not refuse foreach Adam")
    except tracejit.HostDependencyError:
        pass
    if rank == 1:
        time.sleep(0.6)
    checked = tracejit.trace(all_reduce_step, backend="aten")
    for x, y in data[6:]:
        checked(x, y, model=model, opt=opt, world=world)
    facts["replays"] = checked.stats.checked_replays
    return facts


DIVERGE = {"now": False}


def replay_divergence(rank: int, world: int) -> dict:
    """Rank 1 takes another branch at step 3 (a replay, not a record): both ranks raise at once,
    rank 1 its mismatch, rank 0 instead of waiting in the all-reduce rank 1 never joins."""

    def step(x, y, *, model, opt):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if DIVERGE["now"]:
            loss = loss * 2
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        return loss

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    traced = tracejit.trace(step, backend="aten")
    facts: dict = {"failures": []}
    for i, (x, y) in enumerate(batches(rank, steps=5)):
        DIVERGE["now"] = rank == 1 and i == 3
        started = time.perf_counter()
        try:
            traced(x, y, model=model, opt=opt)
        except Exception as error:
            facts.update(step=i, error_type=type(error).__name__, error=str(error),
                         raised_after=time.perf_counter() - started, replays=traced.stats.checked_replays)
            stop_together(rank, "test/rank0_stopped")
            return facts
    facts["failures"].append("every step ran")
    return facts


def lone_record(rank: int, world: int) -> dict:
    """Rank 1 calls with another batch size at step 2: it records a new trace while rank 0 replays.
    The collectives still match (gradients have the parameters' shapes), but rank 1 waits in vain
    for rank 0's list at the end of its record. Rank 0 is busy outside any collective for longer
    than TRACEJIT_DIST_TIMEOUT (so rank 1 cannot see it blocked): rank 1 raises at the timeout, and
    rank 0 stops in its next all-reduce."""
    os.environ["TRACEJIT_DIST_TIMEOUT"] = "2"
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    traced = tracejit.trace(all_reduce_step, backend="aten")
    facts: dict = {"failures": []}
    for i, (x, y) in enumerate(batches(rank, steps=6)):
        if rank == 1 and i == 2:
            x, y = x[:4], y[:4]
        if rank == 0 and i == 3:
            time.sleep(2.5)
        try:
            traced(x, y, model=model, opt=opt, world=world)
        except Exception as error:
            facts.update(step=i, error_type=type(error).__name__, error=str(error))
            store = dist.distributed_c10d._get_default_store()
            if rank == 0:
                store.set("test/rank0_stopped", "1")
            else:
                store.wait(["test/rank0_stopped"], datetime.timedelta(seconds=60))
            return facts
    facts["failures"].append("every step ran")
    return facts


def ddp_record_divergence(rank: int, world: int) -> dict:
    """Rank 1 takes another branch at step 3 of DDP training, while DDP's first iterations still
    re-record (bucket rebuilding): rank 1 records the step again, rank 0 replays it and waits in the
    next step's all-reduce. Rank 1 sees rank 0 blocked there and raises without waiting for
    TRACEJIT_DIST_TIMEOUT (30 s); rank 0 then raises in that all-reduce."""
    return ddp_diverging_at(rank, 3, 6, "test/ddp_record_rank0_stopped")


SCENARIOS = {
    "hand_written_all_reduce": hand_written_all_reduce,
    "other_collectives": other_collectives,
    "ddp": ddp,
    "ddp_options": ddp_options,
    "ddp_no_sync": ddp_no_sync,
    "ddp_micro_bucket_views": ddp_micro_bucket_views,
    "ddp_forward_sync": ddp_forward_sync,
    "ddp_api_level": ddp_api_level,
    "ddp_api_no_sync": ddp_api_no_sync,
    "ddp_api_settings": ddp_api_settings,
    "ddp_unkeyworded": ddp_unkeyworded,
    "record_disagreement": record_disagreement,
    "handled_failure": handled_failure,
    "replay_divergence": replay_divergence,  # last: it leaves an all-reduce in flight on rank 0
    "lone_record": lone_record,  # in a run of its own, for the same reason
    "ddp_api_divergence": ddp_api_divergence,  # and this one
    "ddp_record_divergence": ddp_record_divergence,  # and this one
}
SCENARIOS_LEAVE_GROUP_BROKEN = {"replay_divergence", "lone_record", "ddp_api_divergence", "ddp_record_divergence"}
