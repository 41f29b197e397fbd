"""Traces that differ in the output size of a data-dependent op (`nonzero`, `masked_select`,
`unique`, `repeat_interleave` with tensor repeats, boolean indexing).

The input signature cannot tell which size such an op produces: only running it can. So one
signature holds a family of *variants*, checked programs that agree on every op up to a
data-dependent op and differ from there. A checked replay starts in the variant its last call
ended in; when a data-dependent op produces a size that variant did not record, the replay moves
to the variant that did (ops before the op ran already, and no fused group spans the op, so
the new variant continues from a settled state), or records a new variant from there on. Each
variant counts against `max_traces`.

A variant recorded by a call that created Python-side state (the optimizer's lazy state, made by
the first call) is *provisional* until a call ends in it: the next call that moves to it runs
without that creation, so it may record the variant again from where it diverges, as the first
replay of such a record does.
"""

from __future__ import annotations

from ..errors import TraceCacheFullError
from ..record.record import OpRecord, Record, TensorMeta
from .program import CheckedProgram


def _op_key(op: OpRecord) -> tuple:
    return op.op, op.statics, op.inputs, op.outputs, op.out_metas, op.mutated


class ShapeVariants:
    """The checked programs of one input signature, one per path of data-dependent output sizes."""

    def __init__(self, program: CheckedProgram):
        self.programs = [program]
        self.settled: set[int] = set()  # ids of the programs a call ended in

    def settle(self, program: CheckedProgram) -> None:
        self.settled.add(id(program))

    def provisional(self, program: CheckedProgram) -> bool:
        record = program.record
        return record.created_state and not record.rerecorded and id(program) not in self.settled

    def replace(self, old: CheckedProgram, new: CheckedProgram) -> None:
        self.programs[self.programs.index(old)] = new
        self.settled.discard(id(old))

    def __len__(self) -> int:
        return len(self.programs)

    def add(self, program: CheckedProgram) -> None:
        self.programs.append(program)

    def find(self, current: CheckedProgram, position: int, metas: tuple) -> CheckedProgram | None:
        """The variant that recorded `metas` as the outputs of op `position` after the same ops as
        `current` before it (which has run them), or None."""
        for program in self.programs:
            ops = program.record.ops
            if (program is not current and position < len(ops) and ops[position].out_metas == metas
                    and _op_key(ops[position])[:4] == _op_key(current.record.ops[position])[:4]
                    and _same_prefix(current.record, program.record, position)):
                return program
        return None

    def find_branch(self, current: CheckedProgram, position: int, func) -> CheckedProgram | None:
        """The variant that dispatched `func` at op `position` after the same ops as `current`: the
        other side of a host-read branch (GradScaler's inf check), or None."""
        for program in self.programs:
            ops = program.record.ops
            if (program is not current and position < len(ops) and ops[position].op is func
                    and _same_prefix(current.record, program.record, position)):
                return program
        return None

    def branch_cache_full(self, record: Record, position: int, max_traces: int) -> TraceCacheFullError:
        read = next((r for r in record.host_reads if r.position == position), None)
        where = f" at {read.source}" if read is not None else ""
        return TraceCacheFullError(
            f"{record.function_name}() needs another trace: GradScaler's inf check{where} took a branch no "
            f"trace has recorded (the optimizer step skipped or taken), but max_traces={max_traces} traces "
            f"exist already. Raise max_traces, or use an optimizer that takes the scaler on the device "
            f"(torch.optim.Adam/AdamW(fused=True)), which has no such branch."
        )

    def sizes_at(self, position: int, current: CheckedProgram) -> list[str]:
        """The output sizes recorded for op `position` by the variants sharing `current`'s prefix."""
        return [", ".join(str(m) for m in p.record.ops[position].out_metas) for p in self.programs
                if position < len(p.record.ops) and _same_prefix(current.record, p.record, position)]


def _same_prefix(a: Record, b: Record, position: int) -> bool:
    if len(a.ops) < position or len(b.ops) < position:
        return False
    return all(_op_key(x) == _op_key(y) for x, y in zip(a.ops[:position], b.ops[:position]))


def cache_full(record: Record, position: int, metas: list[TensorMeta | None], seen: list[str],
               max_traces: int) -> TraceCacheFullError:
    op = record.ops[position]
    code = f": {op.source.code}" if op.source.code else ""
    got = ", ".join(str(m) for m in metas)
    listed = "".join(f"\n    {sizes}" for sizes in seen)
    return TraceCacheFullError(
        f"{record.function_name}() needs another trace: op #{position} {op.name} at {op.source}{code} "
        f"produced outputs of a size no trace has recorded ({got}; a data-dependent shape), but "
        f"max_traces={max_traces} traces exist already. Sizes recorded there:{listed}\n"
        f"Each output size of a data-dependent op gets a trace of its own: raise max_traces, pad the "
        f"result to a few sizes, or compute it outside the traced function."
    )
