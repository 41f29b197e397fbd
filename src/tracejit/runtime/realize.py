"""Running a symbolically recorded call for real (`symbolic=True`, see record/symbolic.py).

A symbolic first call ends with placeholders where eager execution would have left values. The
`Realizer` runs the recorded program and makes every placeholder storage still held anywhere hold
what eager execution would have left in it. Rather than copying at the end, it *redirects*: right
after the node producing a placeholder's value runs, the value moves into the placeholder's
storage (by swapping memory when it can, by copying otherwise) and the program continues on that
storage. Later in-place ops and views then act on the memory the host sees -- including tensors
that reach it without passing through the recorder (`.data`, tensors autograd unpacks) -- and no
second copy of the value lives on.

A call may be run in several catch-ups (an `exclude_from_trace()` block needs the values recorded
before it): each run continues where the previous one stopped, with the same environment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import SymbolicTraceError
from ..record.autocast_keys import outside_autocast
from ..record.calls import rebuild_call
from ..record.placeholders import Placeholder, storage_key
from ..record.record import Flag, OpRecord, Record, TensorMeta

_copy = torch.ops.aten.copy_.default
# Swapping two storages' memory needs these private hooks (torch 2.x); without them values are copied.
_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_") and hasattr(torch._C, "_storage_Use_Count")


class Realizer:
    """Runs one symbolically recorded call for real, in one or more consecutive runs."""

    def __init__(self) -> None:
        self._env: list = []
        self._position = 0  # record position up to which ops have run
        self._redirected: set[int] = set()
        self._failed = False  # an op raised mid-run: like eager execution, stop there for good
        # the storages of placeholders held outside whose op never ran (the run raised before it):
        # unwritten memory, which the Python state must not keep (eager never made those values)
        self.unwritten: set = set()

    def run(self, program: Any, inputs: dict[int, torch.Tensor],
            placeholders: dict[int, Placeholder]) -> list[str]:
        """Run the program's ops from where the last run stopped; return stride disagreements.

        `program` covers the record so far (a prefix of the final record, or all of it); `inputs`
        maps handles of arguments, externals and constants to their tensors.
        """
        if self._failed:
            return []
        with _outside_the_trace():
            targets = {}
            for handle, placeholder in placeholders.items():
                if handle not in self._redirected:
                    target = placeholder.target()
                    if target is not None:  # something outside the program still holds this storage
                        targets[handle] = target
            redirected: set[int] = set()
            try:
                self._env, self._position, disagreements = run_program(
                    program, self._position, self._env, inputs, targets, redirected)
            except BaseException:
                self._failed = True
                self.unwritten = {storage_key(t) for h, t in targets.items() if h not in redirected} - {None}
                raise
        self._redirected.update(targets)
        return disagreements

    def computed(self, handle: int) -> torch.Tensor:
        """The value the runs left for an escaped handle (kept to the end of the call)."""
        value = self._env[handle] if handle < len(self._env) else None
        if value is None:
            raise RuntimeError(f"tracejit internal error: the program left no value for t{handle}")
        return value


def run_program(program: Any, start: int, carried_env: list, inputs: dict[int, torch.Tensor],
                targets: dict[int, torch.Tensor], redirected: set[int] | None = None) -> tuple[list, int, list[str]]:
    """Run every recorded op at positions >= `start`, redirecting values into `targets`.

    `program` is a compiled program of the record, or the record itself (a catch-up runs the
    record so far); either way the ops run one by one, unfused, exactly as recorded — the first
    call of a trace must leave what an eager call leaves. `carried_env` is the environment an
    earlier run left (values by handle), `inputs` bind arguments, externals and constants. Values
    are dropped after their last use, so the run has the memory behaviour of the program rather
    than of the recording. Returns (environment, position reached, a line for every output whose
    strides differ from the recorded, predicted ones). `redirected` collects the handles whose
    targets got their values, as they do (a run that raises leaves the others unwritten).
    """
    record: Record = getattr(program, "record", program)
    env: list = [None] * len(record.tensors)
    env[:len(carried_env)] = carried_env
    for handle, tensor in inputs.items():
        env[handle] = tensor
    release = _release_points(record)
    disagreements: list[str] = []
    for op in record.ops[start:]:
        args, kwargs = rebuild_call(op.statics, [env[h] for h in op.inputs], list(op.scalars))
        try:
            result = op.op(*args, **kwargs)
        except Exception as error:
            _note_position(error, record, op)
            raise
        _store_outputs(op, result, env)
        for handle in _produced(op, record):
            value = env[handle]
            disagreement = _compare(record, op, handle, value)
            if disagreement is not None:
                disagreements.append(disagreement)
            target = targets.get(handle)
            if target is not None:
                _redirect(value, target)
                env[handle] = target
                if redirected is not None:
                    redirected.add(handle)
        for handle in release[op.index]:
            env[handle] = None
    return env, len(record.ops), disagreements


def _store_outputs(op: OpRecord, result: Any, env: list) -> None:
    if op.out_kind == "tensor":
        env[op.outputs[0]] = result
    elif op.out_kind in ("tuple", "list"):
        for handle, value in zip(op.outputs, result):
            if handle is not None:
                env[handle] = value


def _release_points(record: Record) -> list[list[int]]:
    """For each position, the handles no later op reads and nothing outside keeps."""
    last_use: dict[int, int] = {}
    for op in record.ops:
        for handle in op.inputs:
            last_use[handle] = op.index
        for handle in op.outputs:
            if handle is not None:
                last_use.setdefault(handle, op.index)
    keep = Flag.ESCAPED | Flag.RETURNED
    release: list[list[int]] = [[] for _ in record.ops]
    for handle, position in last_use.items():
        if not record.tensors[handle].flags & keep:
            release[position].append(handle)
    return release


def _redirect(value: torch.Tensor, target: torch.Tensor) -> None:
    """Give `target`'s storage the contents of `value`, which must not be used afterwards.

    When no other tensor sees `value`'s memory and the layouts agree, the two storages swap
    memory: the host's storage takes the freshly computed memory, as after an eager op, and the
    placeholder's untouched memory goes back to the allocator without ever being written.
    """
    source, destination = value.untyped_storage(), target.untyped_storage()
    alone = _CAN_SWAP and torch._C._storage_Use_Count(source._cdata) == 2  # `value` and `source` itself
    if (alone and source.nbytes() == destination.nbytes() and source.device == destination.device
            and value.storage_offset() == target.storage_offset() and value.stride() == target.stride()):
        destination._swap_data_ptr_(source)
    else:
        _copy(target, value)


def _produced(op: OpRecord, record: Record) -> list[int]:
    return [h for h in op.outputs if h is not None and record.tensors[h].producer == op.index]


def _compare(record: Record, op: OpRecord, handle: int, value: torch.Tensor | None) -> str | None:
    predicted = record.tensors[handle].meta
    if value is None:
        raise RuntimeError(f"tracejit internal error: the program left t{handle} (output of op #{op.index} "
                           f"{op.name}) unmaterialized after running it")
    actual = TensorMeta.of(value)
    if (actual.shape, actual.dtype, actual.device) != (predicted.shape, predicted.dtype, predicted.device):
        # Nothing correct can be written into the placeholder: stop before more state changes.
        raise SymbolicTraceError(
            f"tracejit: op #{op.index} {op.name} at {op.source} produced {actual}, but symbolic recording "
            f"predicted {predicted} from torch's fake (meta) kernel for it. The call's values are "
            f"incomplete. Trace this function with symbolic=False."
        )
    if _same_layout(actual, predicted):
        return None
    return (f"op #{op.index} {op.name} at {op.source}: {predicted} predicted strides {predicted.stride}, "
            f"the kernel produced {actual.stride}")


def _same_layout(a: TensorMeta, b: TensorMeta) -> bool:
    """Equal strides where they matter: no step is taken along a size-1 dimension or in an empty tensor."""
    if 0 in a.shape:
        return True
    return all(size == 1 or x == y for size, x, y in zip(a.shape, a.stride, b.stride))


def _note_position(error: Exception, record: Record, op: OpRecord) -> None:
    if hasattr(error, "add_note"):
        error.add_note(f"tracejit: raised by op #{op.index} {op.name}, recorded at {op.source}, when "
                       f"{record.function_name}()'s symbolically recorded first call ran for real")


@contextlib.contextmanager
def _outside_the_trace() -> Iterator[None]:
    """Run ops as a traced call's program runs them: below autograd, unseen by the call's modes.

    No graph is built and no version counter moves: the host's in-place ops already bumped each
    counter once while the call was recorded, exactly as eager execution does.
    """
    below_autograd = torch._C._AutoDispatchBelowADInplaceOrView
    with _disable_current_modes(), torch._C.DisableTorchFunction(), below_autograd(), outside_autocast():
        yield
