"""torch.distributed collectives inside a traced call, recorded as tracejit's own collective ops.

`dist.all_reduce(t)` (and DDP's reducer, from C++) dispatches `c10d.allreduce_(tensors, process_group,
reduce_op, ...)`, whose process group and reduce op are TorchScript objects: no structural
argument a replay can compare, no value a program can keep, and a schema that does not even say it
writes its tensors. The dispatch mode therefore hands every c10d op to `run_collective`, which
translates it into a `tracejit::` op over plain arguments (the group's name, the reduce op's number)
whose schema declares what it writes, runs it through the call's handler like any aten op (recorded,
matched, executed by the program), and answers the caller with what c10d returns: the tensors and a
completed `Work`. The collective itself always completes before the op returns, so a program runs
collectives in record order and a later op never sees a reduction in flight; it waits through
`ranks.wait`, which stops when a peer rank failed (see ranks.py).

The translated ops are barriers for the compiler (`is_collective`): never removed, merged,
recomputed, fused across or planned into a shared buffer, because another process waits for each
of them in this exact order (see docs/distributed.md).
"""

from __future__ import annotations

from typing import Any

import torch

from .ranks import wait

_c10d = torch._C._distributed_c10d if torch.distributed.is_available() else None
_LIBRARY = torch.library.Library("tracejit", "DEF")  # noqa: TOR901 - ops of our own, defined once at import

_SCHEMAS = {
    "all_reduce_": "all_reduce_(Tensor(a!)[] tensors, str group, int reduce_op) -> ()",
    "all_reduce_coalesced_": "all_reduce_coalesced_(Tensor(a!)[] tensors, str group, int reduce_op) -> ()",
    # made by the bucketing pass (passes/bucket_collectives.py), never recorded
    "all_reduce_bucket_": "all_reduce_bucket_(Tensor(a!)[] tensors, str group, int reduce_op) -> ()",
    "broadcast_": "broadcast_(Tensor(a!)[] tensors, str group, int root_rank, int root_tensor) -> ()",
    "all_gather_into_tensor_": "all_gather_into_tensor_(Tensor(a!) output, Tensor input, str group) -> ()",
    "all_gather_": "all_gather_(Tensor(a!)[] outputs, Tensor input, str group) -> ()",
    "reduce_scatter_tensor_": "reduce_scatter_tensor_(Tensor(a!) output, Tensor input, str group, int reduce_op) -> ()",
    "reduce_scatter_": "reduce_scatter_(Tensor(a!) output, Tensor[] inputs, str group, int reduce_op) -> ()",
}


def _group(name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def group_ranks(name: str) -> list[int]:
    """The global ranks of the process group called `name`."""
    return torch.distributed.get_process_group_ranks(_group(name))


def _reduce_op(number: int) -> Any:
    return _c10d.ReduceOp.RedOpType(number)


def _on_host(tensors: list[torch.Tensor]) -> bool:
    """A collective over host tensors that a compiled program runs: polled before its wait blocks
    (ranks.wait). One a recording or aten-level call runs keeps the blocking wait: gloo's worker
    lets go of a collective's tensors only after marking it complete, and such a call notes right
    after it which tensors something still holds (a tensor the call keeps refuses the API level)."""
    from .modes import current_context  # modes.py dispatches to this module

    return current_context() is None and all(t.device.type == "cpu" for t in tensors)


def _all_reduce(tensors: list[torch.Tensor], group: str, reduce_op: int) -> None:
    options = _c10d.AllreduceOptions()
    options.reduceOp = _reduce_op(reduce_op)
    wait(_group(group).allreduce(tensors, options), "all_reduce", group, _on_host(tensors))


def _all_reduce_coalesced(tensors: list[torch.Tensor], group: str, reduce_op: int) -> None:
    options = _c10d.AllreduceCoalescedOptions()
    options.reduceOp = _reduce_op(reduce_op)
    wait(_group(group).allreduce_coalesced(tensors, options), "all_reduce_coalesced", group, _on_host(tensors))


def _all_reduce_bucket(tensors: list[torch.Tensor], group: str, reduce_op: int) -> None:
    """All-reduce the tensors as one flat buffer: one round trip instead of one per tensor."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    _all_reduce([flat], group, reduce_op)
    pieces = flat.split([t.numel() for t in tensors])
    torch._foreach_copy_(tensors, [piece.view(t.shape) for piece, t in zip(pieces, tensors)])


def _broadcast(tensors: list[torch.Tensor], group: str, root_rank: int, root_tensor: int) -> None:
    options = _c10d.BroadcastOptions()
    options.rootRank, options.rootTensor = root_rank, root_tensor
    wait(_group(group).broadcast(tensors, options), "broadcast", group, _on_host(tensors))


def _all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: str) -> None:
    wait(_group(group)._allgather_base(output, input, _c10d.AllgatherOptions()),
         "all_gather_into_tensor", group, _on_host([output]))


def _all_gather(outputs: list[torch.Tensor], input: torch.Tensor, group: str) -> None:
    wait(_group(group).allgather([outputs], [input], _c10d.AllgatherOptions()), "all_gather", group,
         _on_host(outputs))


def _reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: str, reduce_op: int) -> None:
    options = _c10d.ReduceScatterOptions()
    options.reduceOp = _reduce_op(reduce_op)
    wait(_group(group)._reduce_scatter_base(output, input, options), "reduce_scatter_tensor", group,
         _on_host([output]))


def _reduce_scatter(output: torch.Tensor, inputs: list[torch.Tensor], group: str, reduce_op: int) -> None:
    options = _c10d.ReduceScatterOptions()
    options.reduceOp = _reduce_op(reduce_op)
    wait(_group(group).reduce_scatter([output], [inputs], options), "reduce_scatter", group, _on_host([output]))


_KERNELS = {
    "all_reduce_": _all_reduce, "all_reduce_coalesced_": _all_reduce_coalesced,
    "all_reduce_bucket_": _all_reduce_bucket, "broadcast_": _broadcast,
    "all_gather_into_tensor_": _all_gather_into_tensor, "all_gather_": _all_gather,
    "reduce_scatter_tensor_": _reduce_scatter_tensor, "reduce_scatter_": _reduce_scatter,
}
for _name, _schema in _SCHEMAS.items():
    _LIBRARY.define(_schema)
    _LIBRARY.impl(_name, _KERNELS[_name], "CompositeExplicitAutograd")

COLLECTIVE_OPS = frozenset(getattr(torch.ops.tracejit, name).default for name in _SCHEMAS)
# torch's functional collectives carry plain arguments already and are recorded as they are.
_FUNCTIONAL_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})


def is_collective(target: Any) -> bool:
    """True for an op that communicates with other processes: a barrier for every pass."""
    return target in COLLECTIVE_OPS or getattr(target, "namespace", None) in _FUNCTIONAL_NAMESPACES


# -- translation of c10d's ops ---------------------------------------------------------------------

def _group_name(process_group: Any) -> str:
    return torch._C._distributed_c10d.ProcessGroup.unbox(process_group).group_name


def _reduce_op_number(reduce_op: Any) -> int:
    number = int(reduce_op.op())
    if number == int(_c10d.ReduceOp.PREMUL_SUM):
        raise NotImplementedError("tracejit: ReduceOp.PREMUL_SUM inside a traced call is not supported")
    return number


def _translate(name: str, args: list) -> tuple[Any, tuple, Any]:
    """(tracejit op, its arguments, what the c10d op returns besides the Work) for one c10d call."""
    ops = torch.ops.tracejit
    if name == "allreduce_":
        tensors, group, reduce_op = args[:3]
        return ops.all_reduce_.default, (tensors, _group_name(group), _reduce_op_number(reduce_op)), tensors
    if name == "allreduce_coalesced_":
        tensors, group, reduce_op = args[:3]
        return (ops.all_reduce_coalesced_.default, (tensors, _group_name(group), _reduce_op_number(reduce_op)),
                None)
    if name == "broadcast_":
        tensors, group, root_rank, root_tensor = args[:4]
        return ops.broadcast_.default, (tensors, _group_name(group), root_rank, root_tensor), tensors
    if name == "_allgather_base_":
        output, input, group = args[:3]
        return ops.all_gather_into_tensor_.default, (output, input, _group_name(group)), output
    if name == "allgather_" and len(args[1]) == 1:
        outputs, inputs, group = args[:3]
        return ops.all_gather_.default, (outputs[0], inputs[0], _group_name(group)), outputs
    if name == "_reduce_scatter_base_":
        output, input, group, reduce_op = args[:4]
        return (ops.reduce_scatter_tensor_.default,
                (output, input, _group_name(group), _reduce_op_number(reduce_op)), output)
    if name == "reduce_scatter_" and len(args[0]) == 1:
        outputs, inputs, group, reduce_op = args[:4]
        return (ops.reduce_scatter_.default,
                (outputs[0], inputs[0], _group_name(group), _reduce_op_number(reduce_op)), outputs)
    raise NotImplementedError(
        f"tracejit: torch.distributed op c10d.{name} inside a traced call is not supported. Supported: "
        f"all_reduce, all_reduce_coalesced, broadcast, all_gather_into_tensor, all_gather (one tensor), "
        f"reduce_scatter_tensor, reduce_scatter (one output) - on the default or a named group. Run other "
        f"collectives (barrier, send/recv, gather, scatter...) outside the traced function or inside "
        f"tracejit.exclude_from_trace()."
    )


def _completed_work(result: Any) -> Any:
    """A finished c10d `Work` whose future holds `result`, the way c10d's own Work does."""
    future = torch.futures.Future()
    future.set_result(result if isinstance(result, list) else [result] if result is not None else [])
    return torch._C._distributed_c10d._create_work_from_future(future).boxed()


def run_collective(handler: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """Hand the c10d op `func` to the call's handler as its tracejit op; answer as c10d does."""
    name = func._schema.name.split("::")[-1]
    arguments = list(args) + [kwargs[a.name] for a in func._schema.arguments[len(args):] if a.name in kwargs]
    op, translated, returned = _translate(name, arguments)
    handler.on_op(op, translated, {})
    work = _completed_work(returned)
    if func._schema.returns and len(func._schema.returns) == 2:
        return returned, work
    return work
