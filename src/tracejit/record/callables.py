"""The fastest correct Python callable for a recorded aten op.

Calling an op through its public binding (`torch._C._VariableFunctions.addmm`) skips the Python
frame of `OpOverload.__call__` and is 20-30% cheaper per call. The binding picks an overload
from its arguments, so a binding is used only after it was *verified*: called once on meta
tensors of the recorded shapes under a dispatch mode that sees which overload it reaches. If it
reaches exactly the recorded overload, it is used; otherwise the overload itself is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .autocast_keys import outside_autocast
from .calls import rebuild_call
from .record import TensorMeta

_NAMESPACES = (torch._C._VariableFunctions, torch._C._nn)


class _CaptureOverloads(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seen.append((func, _identity_view(args), _identity_view(kwargs)))
        return func(*args, **kwargs)


def _identity_view(value: Any) -> Any:
    """The argument structure with tensors replaced by their identity, for exact comparison."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (list, tuple)):
        return tuple(_identity_view(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _identity_view(v)) for k, v in value.items())
    return value


def _candidates(op: torch._ops.OpOverload) -> list[Callable]:
    """Public bindings that might reach `op`: functions first, then (unbound) tensor methods."""
    name = op._schema.name.split("::")[-1]
    found = [getattr(ns, name) for ns in _NAMESPACES if hasattr(ns, name)]
    method = getattr(torch._C.TensorBase, name, None)
    if method is not None:
        found.append(method)
    return found


def _waited(op: Any) -> Any:
    """What a program runs for `op` outside ATen. A functional collective's result is wrapped in an
    AsyncCollectiveTensor (`_c10d_functional._wrap_tensor_autograd`), a tensor without memory of its
    own that waits for the collective when an op dispatches on it: a compiled kernel given its
    address (0) crashed. The program waits where it is wrapped and goes on with the plain result."""
    if getattr(op, "namespace", None) == "_c10d_functional" and op._schema.name.endswith("::_wrap_tensor_autograd"):
        return torch.ops._c10d_functional.wait_tensor.default
    return op


def resolve_callable(op: Any, statics: tuple, metas: tuple[TensorMeta, ...], scalars: tuple) -> Callable:
    """A callable taking the same arguments as `op`, verified to reach the same overload.

    `statics`, `metas` and `scalars` describe one recorded call: the argument structure, the
    metadata of its tensors in argument order, and its dynamic scalars.
    """
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return _waited(op)
    if torch.Tag.nondeterministic_seeded in op.tags:
        return op._op  # an RNG op is never run an extra time, not even on meta tensors
    try:
        with outside_autocast():  # the recorded op and its bindings compared as autocast left the op
            return _resolve(op, statics, metas, scalars) or op._op
    except TypeError:  # unhashable static argument: no caching, no verification
        return op._op


@functools.lru_cache(maxsize=8192)
def _resolve(op: torch._ops.OpOverload, statics: tuple, metas: tuple, scalars: tuple) -> Callable | None:
    samples = [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta") for m in metas]
    args, kwargs = rebuild_call(statics, samples, list(scalars))
    reference = _CaptureOverloads()
    try:
        with reference:
            expected = _structure(op._op(*args, **kwargs))
    except Exception:  # no meta kernel: nothing to verify a binding against
        return None
    for candidate in _candidates(op):
        capture = _CaptureOverloads()
        try:
            with capture:
                result = candidate(*args, **kwargs)
        except Exception:  # the binding rejects these arguments
            continue
        # The same overload with the same arguments as seen by the dispatcher (a binding may
        # have other defaults: torch._C._nn.mse_loss(a, b) does not mean reduction="mean"), and
        # the same return structure (torch._foreach_add_ returns its list, the overload None).
        if capture.seen == reference.seen and _structure(result) == expected:
            return candidate
    return None


def _structure(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_structure(v) for v in value))
    return type(value)
