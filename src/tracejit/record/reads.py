"""What a host read of a record depends on: the ops before it that lead to its value, and the
tensors they start from."""

from __future__ import annotations

from .record import Kind, Record


def read_slice(record: Record, position: int, handle: int) -> tuple[list[int], set[int]]:
    """The ops before `position` that the value of `handle` there depends on, in order (every op
    that writes the storage of a needed value, and then what it reads), and the storages (base
    handles) the value depends on."""
    def root(h: int) -> int:
        return storage_root(record, h)

    needed = {root(handle)}
    ops = []
    for op in reversed(record.ops[:position]):
        writes = {root(h) for h in (*op.outputs, *op.mutated) if h is not None}
        if writes & needed:
            ops.append(op.index)
            needed |= {root(h) for h in op.inputs}
    return ops[::-1], needed


def reads_state_it_changes(record: Record) -> bool:
    """Whether the recorded call read on the host a value that depends on tensors from outside
    the call alone (a module's buffer, optimizer state), not on its inputs, and wrote one of them
    after the read: a first-call branch
    such as AveragedModel's `if self.n_averaged == 0: copy` that the next call takes the other
    way, as an optimizer's lazily made state is different on the next call (trace.py lets the
    first replay of such a record record again rather than diverge)."""
    for read in record.host_reads:
        if read.handle is None:
            continue
        _, roots = read_slice(record, read.position, read.handle)
        if any(record.tensors[h].kind in (Kind.ARG, Kind.KWARG) for h in roots):
            continue  # a branch on the inputs' values (`if loss.item() > 0`): a divergence raises
        state = {h for h in roots if record.tensors[h].kind is Kind.EXTERNAL}
        if state and any(h is not None and storage_root(record, h) in state
                         for op in record.ops[read.position:] for h in op.mutated):
            return True
    return False


def storage_root(record: Record, handle: int) -> int:
    """The handle whose memory `handle` lies in: itself, or the base its views were made from."""
    while record.tensors[handle].base is not None:
        handle = record.tensors[handle].base
    return handle
