"""What the calls of a traced function did: counters a test or a curious user can read.

`trace.stats` tells a JIT that replays from one that silently runs the function eagerly: after
a few calls of a stable function, `records` stays at 1 and the replays (or host-free calls) grow.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TraceStats:
    calls: int = 0  # every call of the traced function
    records: int = 0  # calls that recorded a new trace (a first call, a new input signature)
    rerecords: int = 0  # checked replays of a provisional trace that diverged and recorded it afresh
    shape_variants: int = 0  # checked calls that recorded a variant for a new data-dependent output size
    branch_variants: int = 0  # checked calls that recorded a variant for the other side of GradScaler's inf check
    checked_replays: int = 0  # calls that ran the function against a trace and matched it
    api_replays: int = 0  # of the checked replays, those run at the torch API level (no aten dispatch)
    api_fallbacks: int = 0  # API-level checked calls that diverged and ran at the aten level instead
    early_runs: int = 0  # of the API-level replays, those whose program ran at a host read (runtime/early_finish.py)
    optimizer_stand_ins: int = 0  # optimizer step()/zero_grad() calls API-level replays answered as a whole
    module_stand_ins: int = 0  # torch.nn module calls API-level replays answered as a whole
    ddp_stand_ins: int = 0  # of those, DistributedDataParallel calls (runtime/ddp_stand_in.py)
    function_stand_ins: int = 0  # clip_grad_norm_()/clip_grad_value_() calls API-level replays answered as a whole
    host_free_calls: int = 0  # calls served by the compiled program without running the function
    host_free_misses: int = 0  # without_host calls whose guards failed: the function ran instead
    shape_specializations: int = 0  # symbolic_shape: programs made for a new size from a symbolic trace, unrecorded
    eager_calls: int = 0  # calls run eagerly, unrecorded, that found a lazy module not materialized yet

    @property
    def replays(self) -> int:
        """Calls served from a recorded trace, checked or host-free."""
        return self.checked_replays + self.host_free_calls
