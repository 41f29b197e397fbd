"""Splitting an op call into tensors, structural arguments and dynamic scalars.

A Python float handed to an elementwise or optimizer op (a learning rate read from
`param_groups`, Adam's step size computed from `step.item()`) changes from call to call without
changing the program: it is a *dynamic scalar*, observed afresh on every replay. Every other
non-tensor argument (dims, shapes, dtypes, flags) is *structural*: a change is a mismatch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from .record import TENSOR, KwargStatic, ScalarSlot

aten = torch.ops.aten

# Ops whose float/Scalar arguments change values, never shapes, besides the pointwise ones.
_VALUE_SCALAR_OPS = {
    "addmm", "addmv", "addbmm", "baddbmm", "addr", "native_dropout", "native_dropout_backward",
    "native_batch_norm", "native_batch_norm_backward", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training",
    "native_layer_norm", "native_group_norm", "native_group_norm_backward", "fill", "fill_", "full",
    "full_like", "new_full", "bernoulli", "bernoulli_", "uniform", "uniform_", "normal", "normal_",
    "exponential_", "leaky_relu_backward", "hardtanh_backward", "elu_backward", "softplus_backward",
    "threshold", "smooth_l1_loss", "smooth_l1_loss_backward", "huber_loss", "huber_loss_backward",
    "rrelu_with_noise", "celu", "_fused_dropout", "dropout", "clamp", "clamp_min", "clamp_max",
    "clamp_", "clamp_min_", "clamp_max_", "mse_loss", "l1_loss", "cross_entropy_loss",
    # the value of torch.where(c, x, 0.5)'s scalar, of x // k, and of the fill ops
    "scalar_tensor", "floor_divide", "floor_divide_", "index_fill", "index_fill_",
    # GradScaler's growth and backoff factors (set_growth_factor() between calls)
    "_amp_update_scale", "_amp_update_scale_",
}
# A Python number can also arrive in a Tensor slot: the dispatcher unwraps wrapped-number tensors
# (`t / 0.5` reaches aten.div.Tensor with a float).
_SCALAR_TYPES = {
    "number", "float", "Optional[number]", "Optional[float]", "List[number]", "List[float]",
    "Tensor", "Optional[Tensor]",
}

# Ops that hand a value to the host rather than producing a tensor.
HOST_VALUE_OPS = frozenset({aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default,
                            aten.allclose.default})


def _is_value_scalar_op(op: torch._ops.OpOverload) -> bool:
    name = op._schema.name.split("::")[-1]
    return (
        torch.Tag.pointwise in op.tags
        or name.startswith(("_foreach_", "_fused_"))
        or name in _VALUE_SCALAR_OPS
        or _is_in_place_pointwise(op, name)
    )


def _is_in_place_pointwise(op: torch._ops.OpOverload, name: str) -> bool:
    """`masked_fill_`, `threshold_`, `eq_`...: torch tags the functional form pointwise but not all of
    the in-place forms, whose scalars are just as much values."""
    if not name.endswith("_") or op.namespace != "aten":
        return False
    functional = getattr(getattr(aten, name[:-1], None), op._overloadname, None)
    return functional is not None and torch.Tag.pointwise in functional.tags


# Integer arguments that are values, not sizes: GradScaler's growth interval (set_growth_interval())
_INT_VALUES = {"_amp_update_scale": frozenset({"growth_interval"}), "_amp_update_scale_": frozenset({"growth_interval"})}


@functools.cache
def dynamic_slots(op: torch._ops.OpOverload) -> tuple[frozenset[int], frozenset[str]]:
    """Positions and keyword names of `op`'s arguments that carry dynamic scalars."""
    if not isinstance(op, torch._ops.OpOverload) or not _is_value_scalar_op(op):
        return frozenset(), frozenset()
    int_values = _INT_VALUES.get(op._schema.name.split("::")[-1], frozenset())
    positions, names = set(), set()
    for i, arg in enumerate(op._schema.arguments):
        if str(arg.type) in _SCALAR_TYPES or arg.name in int_values:
            names.add(arg.name)
            if not arg.kwarg_only:
                positions.add(i)
    return frozenset(positions), frozenset(names)


def _split(value: Any, dynamic: bool, tensors: list, scalars: list) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return TENSOR
    if isinstance(value, (list, tuple)):
        return tuple(_split(v, dynamic, tensors, scalars) for v in value)
    if dynamic and type(value) in (float, int):  # bool stays structural
        scalars.append(value)
        return ScalarSlot(type(value))
    return value


def split_call(op: Any, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], tuple, list]:
    """Return (tensors in argument order, structural description, dynamic scalar values)."""
    positions, names = dynamic_slots(op)
    tensors: list[torch.Tensor] = []
    scalars: list = []
    statics = [_split(a, i in positions, tensors, scalars) for i, a in enumerate(args)]
    for name, value in kwargs.items():
        statics.append(KwargStatic(name, _split(value, name in names, tensors, scalars)))
    return tensors, tuple(statics), scalars


def rebuild_call(statics: tuple, tensors: list, scalars: list) -> tuple[list, dict]:
    """Inverse of `split_call`: put tensors and scalars back into the argument structure."""
    tensor_iter = iter(tensors)
    scalar_iter = iter(scalars)
    args, kwargs = [], {}
    for item in statics:
        if isinstance(item, KwargStatic):
            kwargs[item.name] = _fill(item.value, tensor_iter, scalar_iter)
        else:
            args.append(_fill(item, tensor_iter, scalar_iter))
    return args, kwargs


def _fill(value: Any, tensors: Iterator, scalars: Iterator) -> Any:
    # A module-level function, not a closure: a recursive closure is a reference cycle that
    # would keep every tensor of the call alive until the garbage collector runs.
    if value is TENSOR:
        return next(tensors)
    if isinstance(value, ScalarSlot):
        return next(scalars)
    if isinstance(value, tuple):
        return [_fill(v, tensors, scalars) for v in value]
    return value


def scalar_slot_names(op: Any, statics: tuple) -> list[str]:
    """Schema argument name of each dynamic scalar slot in `statics`, in slot order."""
    arguments = op._schema.arguments if isinstance(op, torch._ops.OpOverload) else []
    names: list[str] = []
    for index, item in enumerate(statics):
        if isinstance(item, KwargStatic):
            _slot_names(item.value, item.name, names)
        else:
            _slot_names(item, arguments[index].name if index < len(arguments) else f"arg{index}", names)
    return names


def _slot_names(value: Any, name: str, names: list[str]) -> None:
    if isinstance(value, ScalarSlot):
        names.append(name)
    elif isinstance(value, tuple):
        for item in value:
            _slot_names(item, name, names)


# Batch norms in training update their running statistics in place although their schemas do not
# say so: op name -> (positions written, position of `training`, or None: always). Without this,
# a batch norm whose output nobody reads (recalibrating the statistics) was dead code.
_UNDECLARED_WRITES = {
    "native_batch_norm": ((3, 4), 5),
    "cudnn_batch_norm": ((3, 4), 5),
    "miopen_batch_norm": ((3, 4), 5),
    "batch_norm_update_stats": ((1, 2), None),
}


def mutated_tensors(op: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among `op`'s arguments that it writes into (per its schema, and the running
    statistics of a batch norm in training)."""
    if not isinstance(op, torch._ops.OpOverload):
        return []
    positions, names = _mutated(op)
    found: list[torch.Tensor] = []
    for i in positions:
        if i < len(args):
            _split(args[i], False, found, [])
    for name in names:
        if name in kwargs:
            _split(kwargs[name], False, found, [])
    undeclared = _UNDECLARED_WRITES.get(op._schema.name.split("::")[-1])
    if undeclared is not None:
        written, training = undeclared
        arguments = op._schema.arguments
        if training is None or _argument(args, kwargs, arguments[training].name, training) is True:
            for i in written:
                value = _argument(args, kwargs, arguments[i].name, i)
                if isinstance(value, torch.Tensor):
                    found.append(value)
    return found


def _argument(args: tuple, kwargs: dict, name: str, position: int) -> Any:
    return args[position] if position < len(args) else kwargs.get(name)


@functools.cache
def _mutated(op: torch._ops.OpOverload) -> tuple[frozenset[int], frozenset[str]]:
    positions, names = set(), set()
    for i, arg in enumerate(op._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            names.add(arg.name)
            if not arg.kwarg_only:
                positions.add(i)
    return frozenset(positions), frozenset(names)


# Ops whose outputs share their input's memory although their schema does not say so (GRU and
# LSTM cells split their gates with them; `reshape` of a non-contiguous tensor ends in
# `_unsafe_view` of a clone). The record treats them as views: a write through the output is a
# write to the input's storage.
UNDECLARED_ALIASES = frozenset({"unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk", "_unsafe_view"})


# Ops that return their input tensor itself, not a copy and not a view, although their schemas
# promise a new tensor: the dropouts when not training or with p == 0 (`return input;` in
# ATen's Dropout.cpp). Like the other CompositeImplicitAutograd ops that can hand back their input
# (`type_as`, `atleast_2d`, `sum_to_size`, `flatten`, `to`...), torch runs them above the
# recorder while gradients are on, and hands them to it under torch.inference_mode(). Whether
# these return their input depends on a number (`p`, a dynamic scalar) rather than on metadata
# alone, so a recorded one may return its input on a later call: the memory plan leaves the
# input's storage to the allocator (passes/plan_memory.py), and a fake run of one runs torch's
# own kernel, whose aliasing is the real one's (torch._decomp's `dropout` copies its input).
RETURNS_INPUT_FOR_SOME_NUMBERS = frozenset({"dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"})


def returns_input_itself(op: Any) -> bool:
    """An op of RETURNS_INPUT_FOR_SOME_NUMBERS."""
    return isinstance(op, torch._ops.OpOverload) and op._schema.name.split("::")[-1] in RETURNS_INPUT_FOR_SOME_NUMBERS


# Composite ops whose schema says the output aliases the input (`Tensor(a) -> Tensor(a)`) but that
# return a copy when a view cannot express the result (`contiguous` of a transposed tensor,
# `reshape` of one, `to` another dtype, `resolve_conj` of a conjugate view). Eager code reaches
# them as aten ops only under torch.inference_mode(), where torch hands composites over whole:
# whether an output is a view is then what the recorded call did (the output's memory), never the
# schema alone, or a copy of a buffer the program reuses is made once and kept (a "static view")
MAY_COPY = frozenset({
    "aten::contiguous", "aten::reshape", "aten::reshape_as", "aten::flatten", "aten::ravel", "aten::to",
    "aten::resolve_conj", "aten::resolve_neg", "aten::coalesce", "aten::pin_memory",
    "aten::_autocast_to_full_precision", "aten::_autocast_to_reduced_precision",
})


def may_copy(op: Any) -> bool:
    return isinstance(op, torch._ops.OpOverload) and op._schema.name in MAY_COPY


@functools.cache
def aliases_its_input(op: Any) -> bool:
    """A view op, or one that aliases without saying so (UNDECLARED_ALIASES)."""
    return is_view_op(op) or (isinstance(op, torch._ops.OpOverload)
                              and op._schema.name.split("::")[-1] in UNDECLARED_ALIASES)


@functools.cache
def is_view_op(op: Any) -> bool:
    """True when the op's tensor outputs alias an input without writing to it."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)


# Kernels whose outputs depend on grad mode itself: the oneDNN LSTM layer runs its training primitive
# and returns the workspace its backward reads only when gradients are enabled, and its inference
# primitive (other rounding) otherwise. The recorder notes the grad mode each one ran under.
GRAD_MODE_KERNELS = frozenset({"aten::mkldnn_rnn_layer"})


def depends_on_grad_mode(op: Any) -> bool:
    return getattr(getattr(op, "_schema", None), "name", "") in GRAD_MODE_KERNELS


# Ops whose output size depends on tensor values that torch does not tag as such: pack_padded_sequence's
# packed data has sum(lengths) rows
_UNTAGGED_DYNAMIC_OUTPUT_OPS = frozenset({"aten::_pack_padded_sequence"})


@functools.cache
def has_dynamic_output_shape(op: Any) -> bool:
    """The op's schema says its output size may depend on tensor values (see data_dependent_size)."""
    return isinstance(op, torch._ops.OpOverload) and (torch.Tag.dynamic_output_shape in op.tags
                                                       or op._schema.name in _UNTAGGED_DYNAMIC_OUTPUT_OPS)


# Index tensors that select by mask: their number of True elements is the output size
_MASK_DTYPES = (torch.bool, torch.uint8)


def data_dependent_size(op: Any, record: Any) -> bool:
    """Whether this recorded op's output size depends on tensor values. torch tags `x[idx]` as
    dynamic for all its uses, but an integer index gives a result of the index's size, which
    follows the inputs' sizes as any other op's does; a mask's count of True does not."""
    if not has_dynamic_output_shape(op.op):
        return False
    if op.op is torch.ops.aten.index.Tensor:
        return any(record.tensors[h].meta.dtype in _MASK_DTYPES for h in op.inputs[1:])
    return True


def is_ignored_op(op: Any) -> bool:
    """Profiler bookkeeping ops, which carry no computation and are never matched."""
    return getattr(op, "namespace", "") == "profiler"


def default_dtype_checks(record) -> dict[int, torch.dtype]:
    """position -> dtype of each op whose result dtype the default dtype decides: the factories of
    default_dtype_results, and the ops that make a floating tensor from integer or bool tensors
    alone (`int_tensor * 0.1`, `int_tensor / 3`). A call that reaches one under another default
    dtype (the function sets it on some calls) diverges there."""
    found = default_dtype_results(record)
    for position, op in enumerate(record.ops):
        if position in found or not op.inputs or len(op.outputs) != 1 or op.outputs[0] is None:
            continue
        dtype = record.tensors[op.outputs[0]].meta.dtype
        if dtype.is_floating_point and promotes_to_default_dtype(
                op.op, [record.tensors[h].meta.dtype for h in op.inputs]):
            found[position] = dtype
    return found


def promotes_to_default_dtype(op: Any, input_dtypes: list[torch.dtype]) -> bool:
    """An op making a floating tensor from integer or bool tensors alone decides its dtype by the
    default dtype, unless it is told one (`_to_copy(x, dtype=torch.float16)`, `view(dtype)`,
    autocast's `cpu_dtype`)."""
    schema = getattr(op, "_schema", None)
    if schema is None or any("dtype" in a.name for a in schema.arguments):
        return False
    return bool(input_dtypes) and not any(d.is_floating_point or d.is_complex for d in input_dtypes)


def default_dtype_results(record) -> dict[int, torch.dtype]:
    """position -> dtype of each op that makes a floating tensor of the default dtype (a factory,
    `torch.full((4,), 0.5)`, with no `dtype=`): `torch.set_default_dtype` inside the function makes
    the same call another dtype, with the same arguments."""
    found = {}
    for position, op in enumerate(record.ops):
        schema = getattr(op.op, "_schema", None)
        if schema is None or not any(a.name == "dtype" and a.kwarg_only for a in schema.arguments):
            continue
        if len(op.outputs) != 1 or op.inputs:  # `zeros_like(t)`, `t.new_zeros()`: t's dtype
            continue
        dtype = record.tensors[op.outputs[0]].meta.dtype
        if not dtype.is_floating_point:
            continue
        _, kwargs = rebuild_call(op.statics, [], list(op.scalars))
        if kwargs.get("dtype") is None:
            found[position] = dtype
    return found
