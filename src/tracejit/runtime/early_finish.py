"""Which host reads of a checked call may run the compiled program early.

A step that logs its loss (`running_loss += loss.item()`) reads a value the program computes. The
reader (api_replay._Reader) computes it op by op from the call's inputs, and the program computes
it again once the function has returned. Where what follows the read computes only what the call
returns, the program can run at the read instead: every torch call that changes state has been
made and matched by then, so the program leaves the state eager leaves, the read takes its value
from the program, and the rest of the function is matched against the record as before.

The price is the fallback: a call that diverges after the program ran cannot run again at the
aten level (its effects are done), so it raises TraceMismatchError, as MegEngine's trace does for
every divergence. Only the record's pure tail may follow the read, so the effects done are exactly
the ones eager has made by then."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..record.collectives import is_collective
from ..record.record import Flag, Kind, Record

# torch calls that read a tensor's metadata only: a placeholder has the recorded metadata, so
# after the program ran they are answered by the placeholder (`print(x.shape)` on some calls)
METADATA_CALLS = frozenset({
    "TensorBase.shape.__get__", "TensorBase.ndim.__get__", "TensorBase.dtype.__get__",
    "TensorBase.device.__get__", "TensorBase.layout.__get__", "TensorBase.is_cuda.__get__",
    "TensorBase.size", "TensorBase.dim", "TensorBase.numel", "TensorBase.nelement", "TensorBase.stride",
    "TensorBase.is_contiguous", "TensorBase.is_floating_point", "TensorBase.element_size",
    "TensorBase.__len__", "Tensor.__len__", "TensorBase.storage_offset",
})


# autograd's attributes and methods: a value the program computed has no history, so after the
# program ran they are eager's only for the call's inputs and externals
_AUTOGRAD = frozenset({"requires_grad", "grad_fn", "is_leaf", "grad", "backward", "retain_grad", "retains_grad",
                       "register_hook", "requires_grad_", "register_post_accumulate_grad_hook", "_base",
                       "output_nr", "_version", "is_inference"})


def autograd_query(name: str) -> bool:
    parts = name.split(".")
    return (parts[-2] if len(parts) > 1 and parts[-1] in ("__get__", "__set__") else parts[-1]) in _AUTOGRAD


def pure_tail_start(record: Record) -> int:
    """The first op position from which every op computes a value only the call's return value or
    later ops hold: it draws no random number, writes into no memory, passes no number, is no
    collective, and no excluded block or value kept in Python state comes after it."""
    tensors = record.tensors
    start = len(record.ops)
    last_block = max((block.position for block in record.excluded_blocks), default=0)
    for op in reversed(record.ops):
        # a number the tail passes may come from the read (`x * (1.0 / n.item())`): not known before it
        if op.index < last_block or op.mutated or op.scalars or is_collective(op.op) or draws_random(op):
            break
        if any(h is not None and tensors[h].flags & Flag.ESCAPED and not tensors[h].flags & Flag.RETURNED
               for h in op.outputs):
            break
        start = op.index
    return max(start, last_block)


def finishing_reads(record: Record) -> frozenset[int]:
    """The handles of the host reads after which only the pure tail runs: the program, run at the
    first of them, must leave their values to be read (all but inputs and externals themselves,
    which are read where they are)."""
    start = pure_tail_start(record)
    return frozenset(read.handle for read in record.host_reads
                     if read.handle is not None and read.position >= start and not read_where_it_is(record, read.handle))


def read_exports(record: Record, visible: set[int]) -> frozenset[int]:
    """What a checked call's program leaves when it runs at a read: the values read there, and
    every value the function's own code may hold then (`visible`, api_replay.held_after_calls: it
    may read or keep one after the program ran, on a call whose traced call did not: `if step %
    100 == 99: print(acc.item())`). None without such a read, so that a program with none keeps
    all its fusion and memory reuse."""
    reads = finishing_reads(record)
    if not reads:
        return reads
    return reads | {h for h in visible if not read_where_it_is(record, h)}


def read_where_it_is(record: Record, handle: int) -> bool:
    """An input, an external, or a constant no call writes or lets outlive it, itself (not a
    view): after the program ran, its value at a read in the pure tail is the one it has."""
    info = record.tensors[handle]
    if info.base is not None or info.kind is Kind.INTERNAL:
        return False
    return not info.literal or handle not in record.fresh_literals()


def draws_random(op: Any) -> bool:
    return isinstance(op.op, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in op.op.tags


@dataclass
class Finished:
    """A call whose program ran at a host read: what it returns, the values read after, the
    numbers it ran with, and the placeholders it filled (handle -> a fresh one for later calls)."""
    output: Any
    values: dict[int, torch.Tensor]
    scalars: list
    handed: dict[int, torch.Tensor]
    source: str


def hand_over(placeholders: dict[int, torch.Tensor], values: dict[int, torch.Tensor],
              tail: frozenset[int]) -> dict[int, torch.Tensor]:
    """Point the placeholders of `values` that something holds (the function's locals, a kept
    `loss.detach()`, Python state), and those the rest of the call will get (`tail`), at them:
    what the function does with them after the read is eager's. Returns a fresh placeholder (the
    same view of the scratch memory) for each, for later calls."""
    handed = {}
    grad = torch.is_grad_enabled()  # off: a view of a parameter is set_ into a placeholder, a leaf
    torch._C._set_grad_enabled(False)
    try:
        with torch._C.DisableTorchFunction():
            for handle, value in values.items():
                # held by the dict, the program's list of them and getrefcount alone: nobody has it
                if handle not in placeholders or (handle not in tail and sys.getrefcount(placeholders[handle]) <= 3):
                    continue
                placeholder = placeholders[handle]
                if placeholder.dtype == value.dtype and placeholder.device == value.device:
                    handed[handle] = placeholder.detach()
                    placeholder.set_(value)
    finally:
        torch._C._set_grad_enabled(grad)
    return handed


def take_back(program: Any, handed: dict[int, torch.Tensor]) -> None:
    """Give later calls fresh placeholders for those the function now holds with values."""
    placeholders, handles = program.placeholders, program.placeholder_handles
    for handle, fresh in handed.items():
        handles.pop(id(placeholders[handle]), None)
        placeholders[handle] = fresh
        handles[id(fresh)] = handle
    program.placeholder_values = list(placeholders.values())
    handed.clear()  # held here, a placeholder would count as kept (ApiProgram.kept_placeholders)
