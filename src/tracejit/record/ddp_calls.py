"""A DistributedDataParallel module call, as the API tracer notes it.

Checked replay at the API level answers a DDP forward as a whole (runtime/ddp_stand_in.py): DDP's
`_pre_forward` (the reducer's `prepare_for_forward`, the one bucket rebuild, the buffer
broadcast) and `_post_forward` (the reducer's `prepare_for_backward`) do not run, and neither
does backward's autograd, so the C++ reducer keeps the consistent end-of-iteration state the last
call that ran autograd left, exactly as with `without_host` (docs/distributed.md); the program
runs the buffer broadcast, bucket copies and all-reduces it recorded. That is sound only while
DDP would dispatch the recorded ops again, which is decided by its Python attributes, the wrapped
module's state and the grad mode: the note keeps what the check needs, and says when a DDP
configuration does something the stand-in cannot repeat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass
class DdpNote:
    """What a DDP forward's check needs beyond the modules' snapshot."""

    grad_enabled: bool  # _pre_forward/_post_forward drive the reducer only with grad mode on
    forward_sync_after: bool | None = None  # require_forward_param_sync as _post_forward left it


def is_ddp(module: torch.nn.Module) -> bool:
    return isinstance(module, DistributedDataParallel)


def ddp_refusal(module: DistributedDataParallel, inner_refusal: Callable[[torch.nn.Module], str | None]
                ) -> str | None:
    """Why this DDP call cannot be answered whole on later calls, or None. `inner_refusal` is the
    torch.nn module check's (record/module_calls.py): the wrapped module must be answerable too."""
    if type(module) is not DistributedDataParallel:
        return f"{type(module).__qualname__} subclasses DistributedDataParallel"
    d = module.__dict__
    # each of these makes forward or backward run Python or host reads that a recorded program
    # does not repeat (DDPSink, unused-parameter search, the Python reducer, Join's all-reduces)
    for flag in ("find_unused_parameters", "static_graph", "_use_python_reducer", "_delay_all_reduce_all_params"):
        if d.get(flag):
            return f"{flag}=True"
    if getattr(d.get("_join_config"), "enable", False):
        return "it runs inside a Join context"
    if d.get("device_ids") or d.get("mixed_precision") is not None or d.get("device_mesh") is not None:
        return "device_ids, mixed_precision or device_mesh is set (forward moves or casts its inputs)"
    if "buffer_hook" in d or d.get("_comm_hooks"):
        return "it has a communication hook (Python code in forward or backward)"
    if torch.is_grad_enabled() and not d.get("_has_rebuilt_buckets", False):
        # until the one rebuild has happened, a forward with grad mode on may rebuild (with a
        # broadcast of the new bucket order), and whether it does is C++ state Python cannot see
        return "its gradient buckets are not rebuilt yet"
    if "forward" in d:
        return "its forward was replaced"
    inner = d.get("_modules", {}).get("module")
    if inner is None:
        return "it wraps no module"
    why = inner_refusal(inner)
    if why is not None:
        return f"the module it wraps cannot be answered whole: {why}"
    return None


def stateful_comm_hooks(module: DistributedDataParallel) -> list[str]:
    """The communication hooks of a DDP module that have Python state (`register_comm_hook(state,
    hook)` with a state other than None or a process group: PowerSGD's `PowerSGDState` counts
    iterations and switches from all-reduce to compression, an optimizer-overlap hook holds the
    optimizer), described as `hook with a State`. A hook runs in every backward and may change its
    state and what it computes; a stateless one (`allreduce_hook`, `fp16_compress_hook`) computes
    what it computed when recorded."""
    return [f"{getattr(hook, '__qualname__', repr(hook))} with a {type(state).__qualname__}"
            for hook, state in module.__dict__.get("_comm_hooks") or ()
            if state is not None and not isinstance(state, dist.ProcessGroup)]


def ddp_python_state(module: DistributedDataParallel) -> tuple:
    """What of a DDP module runs Python around its collectives, as a recording call found it:
    the names of its communication hooks, whether it has a buffer hook, whether Join is on."""
    d = module.__dict__
    return (tuple(getattr(hook, "__qualname__", repr(hook)) for hook, _ in d.get("_comm_hooks") or ()),
            "buffer_hook" in d, bool(getattr(d.get("_join_config"), "enable", False)))


def ddp_changes_note(recorded: tuple) -> str:
    """For a TraceMismatchError: how the DDP modules a record ran (`Record.ddp_states`, (weak
    reference, ddp_python_state) pairs) differ now from when it was recorded, or ''."""
    notes = []
    for ref, (hooks, buffer_hook, joined) in recorded:
        module = ref()
        if module is None:
            continue
        now_hooks, now_buffer_hook, now_joined = ddp_python_state(module)
        if now_joined != joined:
            notes.append("runs inside a Join context (torch.distributed.algorithms.Join) now, and its forward "
                         "issues Join's all-reduces, which the recorded call (outside Join) did not" if now_joined
                         else "ran inside a Join context when recorded, and does not now")
        if now_hooks != hooks:
            notes.append(f"has the communication hooks {list(now_hooks)} now, {list(hooks)} when recorded "
                         f"(register_comm_hook)")
        if now_buffer_hook != buffer_hook:
            notes.append("has a buffer hook now" if now_buffer_hook else "had a buffer hook when recorded")
    if not notes:
        return ""
    return ("\n  note: the DistributedDataParallel module " + "; it ".join(notes) + ". A trace serves the DDP "
            "configuration it was recorded with: make the change before the first call, or trace the step "
            "used under it as a function of its own (another tracejit.trace).")
