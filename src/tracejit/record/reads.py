"""What a host read of a record depends on: the ops before it that lead to its value, and the
tensors they start from."""

from __future__ import annotations

import bisect
import weakref

from .record import Kind, Record


def read_slice(record: Record, position: int, handle: int) -> tuple[list[int], set[int]]:
    """The ops before `position` that the value of `handle` there depends on, in order (every op
    that writes the storage of a needed value, and then what it reads), and the storages (base
    handles) the value depends on.

    A storage is needed before some op: the read's before `position`, an included op's inputs
    before that op. Its writers before that bound are included; each is found through an index
    of the record's writers by storage, so a step reading a hundred parameters' `step.item()`
    does not scan the record a hundred times."""
    writers, inputs = _index(record)
    start = storage_root(record, handle)
    done: dict[int, int] = {}  # storage -> the bound up to which its writers are included
    pending = [(start, position)]
    included: set[int] = set()
    while pending:
        root, bound = pending.pop()
        low = done.get(root, 0)
        if bound <= low:
            continue
        done[root] = bound
        indices = writers.get(root, ())
        for index in indices[bisect.bisect_left(indices, low):bisect.bisect_left(indices, bound)]:
            if index not in included:
                included.add(index)
                pending += [(r, index) for r in inputs[index]]
    return sorted(included), set(done) | {start}


_INDEXES: dict[int, tuple] = {}  # id(record) -> (the record, weakly; its op count; writers; inputs)


def _index(record: Record) -> tuple[dict[int, list[int]], list[tuple[int, ...]]]:
    """storage -> the indices of the ops writing it, ascending; and each op's input storages."""
    cached = _INDEXES.get(id(record))
    if cached is not None and cached[0]() is record and cached[1] == len(record.ops):
        return cached[2], cached[3]
    writers: dict[int, list[int]] = {}
    inputs = []
    for op in record.ops:
        for root in {storage_root(record, h) for h in (*op.outputs, *op.mutated) if h is not None}:
            writers.setdefault(root, []).append(op.index)
        inputs.append(tuple({storage_root(record, h) for h in op.inputs}))
    if len(_INDEXES) > 64:
        _INDEXES.clear()
    _INDEXES[id(record)] = (weakref.ref(record), len(record.ops), writers, inputs)
    return writers, inputs


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
