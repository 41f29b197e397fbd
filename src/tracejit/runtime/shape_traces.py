"""symbolic_shape: which calls a trace of symbolic sizes serves, and which sizes a recording makes symbolic.

A `ShapeTrace` is one symbolic-shape recording: its record (sizes as expressions of the input
symbols) and its guards. A call that has no trace of its exact signature, but the trace's *family*
(the signature without the input sizes and strides) and satisfies its guards, is served by a
concrete record specialized for its sizes (record/specialize.py): no recording, no Python run of
the function beyond the checked call itself. The specializations are ordinary trace entries
looked up by exact signature, so a call at a size seen before costs what a static trace costs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..ir.meta_check import MIXED_PRECISION_STATISTICS, REDUCED_PRECISION
from ..record.calls import data_dependent_size
from ..record.record import Record, describe_math_bits
from ..record.symbolic_shapes import ShapeGuards

# Concrete programs kept per symbolic-shape trace: each may hold a planned memory arena (up to a
# few MiB: values over 1 MiB are not planned), so a function fed many sizes keeps the ones used
# most recently (an evicted size is specialized again).
MAX_SPECIALIZATIONS = 64


def family(key: tuple) -> tuple:
    """The input signature without the tensor inputs' sizes and strides (their rank stays)."""
    positional, keyword, *rest = key
    return (tuple(_shape_free(k) for k in positional), tuple((name, _shape_free(k)) for name, k in keyword),
            *rest)


def _shape_free(tensor_key: tuple) -> tuple:
    shape, _, *rest = tensor_key
    return (len(shape), *rest)


def input_shapes(key: tuple) -> list[tuple[int, ...]]:
    positional, keyword, *_ = key
    return [tuple(k[0]) for k in positional] + [tuple(k[0]) for _, k in keyword]


def all_dims(key: tuple) -> tuple[tuple[bool, ...], ...]:
    return tuple(tuple(True for _ in shape) for shape in input_shapes(key))


def why_static_inputs(key: tuple, arg_names: list[str]) -> str | None:
    """Why calls with this signature cannot get stand-ins for their inputs, or None. A stand-in is
    another tensor object: one input passed twice, or two inputs sharing memory, would become
    unrelated tensors, and an input that requires grad would get its `.grad` on the stand-in."""
    positional, keyword, _, repeated, shared, *_ = key
    names = arg_names + [name for name, _ in keyword]
    for i, j in enumerate(repeated):
        if i != j:
            return f"input {names[i]} is the same tensor as input {names[j]}"
    if shared:
        i, j, _ = shared[0]
        return f"input {names[i]} lies in the memory of input {names[j]}"
    for i, tensor_key in enumerate([*positional, *(k for _, k in keyword)]):
        if tensor_key[4]:
            return f"input {names[i]} requires grad (its .grad would be set on a stand-in)"
        if tensor_key[6]:
            return f"input {names[i]} is{describe_math_bits(tensor_key[6])[1:]} (a stand-in would have no such bit)"
        if tensor_key[7] is not torch.Tensor:
            return f"input {names[i]} is a {tensor_key[7].__qualname__} (a stand-in would be a plain torch.Tensor)"
    return None


def why_static(record: Record) -> str | None:
    """Why a call like the one `record` holds cannot be recorded with symbolic sizes, or None.

    Symbolic-shape recording runs the function on stand-ins without values, so what needs values
    during the call rules it out; the automatic mode checks the static trace it would generalize."""
    if record.host_reads:
        read = record.host_reads[0]
        return f"it reads a tensor value on the host ({read.what} at {read.source})"
    if record.hidden_reads:
        return f"torch reads a tensor value on the host: {record.hidden_reads[0].describe()}"
    if record.excluded_blocks:
        return f"it has an exclude_from_trace() block at {record.excluded_blocks[0].source}"
    dynamic = next((op for op in record.ops if data_dependent_size(op, record)), None)
    if dynamic is not None:
        return f"op #{dynamic.index} {dynamic.name} at {dynamic.source} has a data-dependent output size"
    if record.rng_calls:
        return f"it sets the random generator's state ({record.rng_calls[0][0]})"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "torch.distributed is initialized (the ranks must agree on each recording)"
    mixed = next((op for op in record.ops if op.op in MIXED_PRECISION_STATISTICS and len(op.outputs) > 1
                  and record.tensors[op.inputs[0]].meta.dtype in REDUCED_PRECISION
                  and op.outputs[1] is not None and record.tensors[op.outputs[1]].meta.dtype == torch.float32), None)
    if mixed is not None:
        # the meta kernel says bf16 statistics where the CPU kernel makes float32 ones, and the
        # stand-ins would carry the wrong dtype on: the recording cannot be right
        return (f"op #{mixed.index} {mixed.name} at {mixed.source} normalizes a {record.tensors[mixed.inputs[0]].meta.dtype} "
                f"input, whose statistics torch's meta kernels mispredict")
    return None


@dataclass
class ShapeTrace:
    family: tuple
    record: Record  # sizes as expressions of the input symbols
    guards: ShapeGuards
    dynamic: tuple[tuple[bool, ...], ...]  # per tensor input, the dims recorded as symbols
    grad_state: tuple | None  # as TraceEntry.grad_state
    specializations: OrderedDict = field(default_factory=OrderedDict)  # signature -> None, oldest first
    stateful_optimizers: frozenset = frozenset()  # as TraceEntry.stateful_optimizers
    state_sizes: tuple = ()  # as TraceEntry.state_sizes
    reached: tuple = ()  # as TraceEntry.reached and reached_bits
    reached_bits: int = 0
    evicted: set = field(default_factory=set)  # signatures let go of (see thrashing)
    warned: bool = False

    @property
    def provisional(self) -> bool:
        """The recorded call created Python state (lazy optimizer state): the next call that needs a
        new size records the trace again, with the state in place, rather than specializing it."""
        return self.record.created_state and not self.record.rerecorded

    def admit(self, key: tuple) -> tuple | None:
        """Note a new specialization; return the signature to evict (the least recently used), if any."""
        self.specializations[key] = None
        if len(self.specializations) > MAX_SPECIALIZATIONS:
            evicted = self.specializations.popitem(last=False)[0]
            self.evicted.add(evicted)
            return evicted
        return None

    def used(self, key: tuple) -> None:
        """A call ran this specialization: it is the most recently used one."""
        if key in self.specializations:
            self.specializations.move_to_end(key)

    def thrashing(self, key: tuple) -> bool:
        """Whether `key` comes back after it was evicted, for the first time in this trace."""
        if key in self.evicted and not self.warned:
            self.warned = True
            return True
        return False

    def describe(self) -> str:
        return f"symbolic {self.guards.describe()}"
