"""The record: a handle-indexed sequence of the aten ops one call of a traced function dispatched.

Every tensor object that takes part in the call gets a *handle*, an index into the table of
`TensorInfo`. Ops refer to tensors only through handles, so the record holds no tensor of the
call except constants (which it must keep to be replayable).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .source import SourceLocation


class Kind(enum.Enum):
    ARG = "arg"  # positional input of the traced function
    KWARG = "kwarg"  # tensor keyword input
    EXTERNAL = "external"  # reached from outside: parameter, buffer, optimizer state, closure
    CONST = "const"  # created from Python data inside the call, or any external under capture_as_const
    INTERNAL = "internal"  # output of a recorded op


class Flag(enum.Flag):
    NONE = 0
    DATA_READ = enum.auto()  # the host read the tensor's memory (numpy, tolist, repr)
    VALUE_READ = enum.auto()  # the host read a scalar out of it (item, bool, float)
    MUTATED = enum.auto()  # some recorded op wrote into it
    ESCAPED = enum.auto()  # alive after the call: returned, stored in .grad, in optimizer state...
    RETURNED = enum.auto()  # part of the traced function's return value
    # Python code of the call read its shape (.shape, size(), dim(), numel(), stride(), len()) while
    # it was recorded. Shapes are part of the input signature, so such reads never change a replay.
    SHAPE_READ = enum.auto()
    # memory the autograd graph of a returned tensor saved for backward (not state: see
    # recorder.mark_escapes); a checked call that keeps the graph alive needs its value
    SAVED = enum.auto()


NEG_BIT, CONJ_BIT = 1, 2  # TensorMeta.math_bits


def math_bits(t: torch.Tensor) -> int:
    """PyTorch's lazy negation and conjugation bits (`z.conj().imag`, `torch._neg_view(x)`,
    `z.conj()`): the tensor's memory holds the values before the negation or conjugation, which
    aten applies when an op reads it and a kernel reading the memory would not."""
    return t.is_neg() * NEG_BIT | t.is_conj() * CONJ_BIT


def describe_math_bits(bits: int) -> str:
    """`bits` as words for messages: "" for none, else ", a negative view" or ", a conjugate view"."""
    return "".join(f", a {name} view" for bit, name in ((NEG_BIT, "negative"), (CONJ_BIT, "conjugate")) if bits & bit)


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    math_bits: int = 0  # NEG_BIT | CONJ_BIT (see math_bits): no fused kernel reads such a tensor's memory

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, math_bits(t))

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.device.type} {dtype}{list(self.shape)}{describe_math_bits(self.math_bits)}"


@dataclass
class TensorInfo:
    handle: int
    kind: Kind
    meta: TensorMeta
    name: str  # argument name, keyword name, or a description of where it was first seen
    producer: int | None = None  # index of the op that created it (INTERNAL only)
    base: int | None = None  # handle of the tensor whose storage this view shares
    flags: Flag = Flag.NONE
    literal: bool = False  # CONST created from Python data (torch.tensor(...)) rather than captured
    # An external that stands for a tensor alive when an exclude_from_trace() block began (the
    # block may have replaced or changed it): the number of handles that existed then. A replay
    # binds whatever tensor the host passes here, of the recorded metadata; see recorder.py.
    cut: int | None = None
    # an input's storage offset in the recorded call: ops taking an absolute offset (`as_strided`)
    # address its storage from it (a dumped graph copies another offset's input there)
    storage_offset: int = 0

    def label(self) -> str:
        return f"t{self.handle}"


@dataclass(frozen=True)
class OpRecord:
    """One dispatched op.

    `statics` is the op's argument structure with every tensor replaced by `TENSOR` and every
    dynamic scalar by a `ScalarSlot`; everything else in it is a structural value that must
    match on replay. `inputs` lists the tensor arguments' handles in argument order, `scalars`
    the dynamic scalars' recorded values.
    """

    index: int
    op: torch._ops.OpOverload
    statics: tuple
    inputs: tuple[int, ...]
    scalars: tuple[Any, ...]
    outputs: tuple[int | None, ...]  # one per tensor output (None where the op returned None)
    out_kind: str  # "tensor" | "tuple" | "list" | "none" | "value"
    out_metas: tuple[TensorMeta | None, ...]
    mutated: tuple[int, ...]  # handles written in place
    source: SourceLocation
    regions: tuple[str, ...] = ()  # enclosing profiler ranges, e.g. "Optimizer.step#Adam.step"
    backward_of: str | None = None  # the autograd node running it ("ReluBackward0"); None: not backward
    inference: bool = False  # dispatched under torch.inference_mode() (its results are inference tensors)
    # the grad mode a kernel that depends on it ran under (record/calls.py GRAD_MODE_KERNELS); None for the others
    grad_enabled: bool | None = None

    @property
    def name(self) -> str:
        return str(self.op)


@dataclass(frozen=True)
class HostRead:
    position: int  # number of ops recorded before the read
    handle: int
    what: str  # "item", "numpy", "repr", ...
    source: SourceLocation


@dataclass(frozen=True)
class HiddenRead:
    """A torch function read tensor values on the host in C++ and chose its ops from them
    (record/modes.py HIDDEN_READS): the recorded ops hold for those values only."""

    position: int  # number of ops recorded before the call
    handle: int | None  # the tensor read; None: one from outside the trace that no op used
    what: str  # "torch.tensor_split() reads its tensor of split points"
    source: SourceLocation

    def describe(self) -> str:
        tensor = f" (t{self.handle})" if self.handle is not None else ""
        return f"{self.what}{tensor} at {self.source}"


@dataclass(frozen=True)
class ExcludedBlock:
    position: int  # ops recorded before the block began
    source: SourceLocation
    handles: int = 0  # handles that existed when the block began (those used after it are cut)


@dataclass(frozen=True)
class OutputSpec:
    """Structure of the traced function's return value: a tree of containers over handles."""

    kind: str  # "tensor" | "none" | "tuple" | "list" | "dict"
    handle: int | None = None
    keys: tuple = ()
    children: tuple[OutputSpec, ...] = ()
    # the container's class when it is no plain tuple/list/dict (a namedtuple, an OrderedDict), and
    # how a call without the function makes it again (container_rebuild); None: it cannot safely
    container: type | None = None
    rebuild: str | None = None

    def build(self, children: list) -> Any:
        """This container of `children` (its elements' values, in order) as the function returned it."""
        if self.kind == "dict":
            value = dict(zip(self.keys, children))
        else:
            value = tuple(children) if self.kind == "tuple" else children
        if self.container is None:
            return value
        if self.rebuild is None:
            raise TypeError(f"tracejit: a call without the function cannot return the "
                            f"{self.container.__qualname__} that the function returned")
        return self.container(*value) if self.rebuild == "fields" else self.container(value)

    def handles(self) -> list[int]:
        if self.kind == "tensor":
            return [self.handle]
        return [h for c in self.children for h in c.handles()]

    def describe(self) -> str:
        if self.kind == "tensor":
            return f"t{self.handle}"
        if self.kind == "none":
            return "None"
        if self.kind == "dict":
            inner = "{" + ", ".join(f"{k!r}: {c.describe()}" for k, c in zip(self.keys, self.children)) + "}"
            return f"{self.container.__qualname__}({inner})" if self.container is not None else inner
        inner = ", ".join(c.describe() for c in self.children)
        if self.container is not None:
            return f"{self.container.__qualname__}({inner})"
        if self.kind == "list":
            return f"[{inner}]"
        return f"({inner},)" if inner else "()"


def container_rebuild(value: tuple | list | dict) -> str | None:
    """How a returned container of a subclass of tuple, list or dict is made again from its elements:
    "fields" `cls(*items)` (a namedtuple), "items" `cls(items)` (torch.return_types, an OrderedDict
    from a dict of the items, a subclass that keeps its base's constructor); None when its class
    makes it otherwise (defaultdict, a custom __init__) or the object holds attributes of its own."""
    cls = type(value)
    if getattr(value, "__dict__", None):
        return None
    if isinstance(value, tuple) and isinstance(getattr(cls, "_fields", None), tuple) and hasattr(cls, "_make"):
        return "fields" if len(cls._fields) == len(value) and cls.__init__ is object.__init__ else None
    if isinstance(value, tuple) and hasattr(cls, "n_fields"):  # a structseq (torch.return_types)
        return "items" if cls.n_fields == getattr(cls, "n_sequence_fields", -1) == len(value) else None
    base = tuple if isinstance(value, tuple) else list if isinstance(value, list) else dict
    inits = {tuple: (object.__init__,), list: (list.__init__,), dict: (dict.__init__, OrderedDict.__init__)}[base]
    return "items" if cls.__new__ is base.__new__ and cls.__init__ in inits else None


@dataclass
class Record:
    function_name: str
    tensors: list[TensorInfo]
    ops: list[OpRecord]
    output: OutputSpec
    host_reads: list[HostRead] = field(default_factory=list)
    # host reads of tensors no op of the call had used (a buffer, a global, `max_norm` held as a
    # tensor): their data is real when the function runs, frozen without it (handle -1)
    outside_reads: list[HostRead] = field(default_factory=list)
    hidden_reads: list[HiddenRead] = field(default_factory=list)
    excluded_blocks: list[ExcludedBlock] = field(default_factory=list)
    # Tensors the record must hold to be replayable: captured constants (with the version
    # counter they had), and a private copy of each Python-data literal as the call made it
    # (recorder.snapshot_literal; never handed out, see `fresh_literals`).
    constants: dict[int, torch.Tensor] = field(default_factory=dict)
    constant_versions: dict[int, int] = field(default_factory=dict)
    # and the memory they had: `param.data = other` keeps the object and its version counter
    constant_storage: dict[int, int] = field(default_factory=dict)
    arg_handles: tuple[int, ...] = ()
    kwarg_handles: dict[str, int] = field(default_factory=dict)
    # A record whose call left new tensors in Python state (lazy optimizer state, a first .grad)
    # may legitimately see a different op sequence on its first replay; see runtime/replay.py.
    created_state: bool = False
    rerecorded: bool = False
    # calls of torch's RNG-setting functions the recorded call made, with the ops before each (record/rng.py)
    rng_calls: tuple[tuple[str, int], ...] = ()
    # the torch.nn modules whose forward ran in the recorded call, held weakly: a call without the
    # host checks that they are as they were (record/reached.py)
    modules_called: tuple = ()
    optimizers_stepped: tuple = ()  # likewise the optimizers whose step() ran (noted without the host only)
    scalers_updated: tuple = ()  # and the torch.amp.GradScalers whose update() ran (without the host only)
    # (weak reference, ddp_calls.ddp_python_state) of each DistributedDataParallel module whose
    # forward ran: a TraceMismatchError says what of it changed since (a comm hook, Join)
    ddp_states: tuple = ()
    inference_mode: bool = False  # the call began under torch.inference_mode() (part of its signature)
    # (ops before it, handle): a `.grad` set to None by Python (`opt.zero_grad()`), which no op shows;
    # a program that raises after that point clears it too (runtime/hostfree.py)
    grad_clears: tuple[tuple[int, int], ...] = ()
    # (ops before the clear, weak reference) of the tensors no op of the call used whose `.grad` the
    # call set to None and left None (`opt.zero_grad()` over the unused head of a multi-task model):
    # a call without the function sets them too, after its program or where it raises
    # (runtime/hostfree.py)
    outside_grad_clears: tuple = ()

    def info(self, handle: int) -> TensorInfo:
        return self.tensors[handle]

    def written_literals(self) -> set[int]:
        """The literals (`torch.tensor(data)`) whose memory some op writes."""
        tensors = self.tensors
        roots = {tensors[h].base if tensors[h].base is not None else h for op in self.ops for h in op.mutated}
        return {h for h in roots if tensors[h].literal}

    def fresh_literals(self) -> set[int]:
        """The literals a call without the function must make anew, as eager code does on every
        call: those the call writes, and those that outlive it (returned, a returned view's base,
        kept in Python state). A program may share the others' recorded values between calls."""
        tensors = self.tensors
        if not any(info.literal for info in tensors):
            return set()
        kept = {info.base if info.base is not None else info.handle for info in tensors
                if info.flags & (Flag.ESCAPED | Flag.RETURNED)}
        return {h for h in kept if tensors[h].literal} | self.written_literals()

    def describe_handle(self, handle: int) -> str:
        info = self.tensors[handle]
        if info.kind is Kind.INTERNAL:
            op = self.ops[info.producer]
            where = f"output of op #{op.index} {op.name} at {op.source}"
        elif info.kind is Kind.CONST and info.literal:
            where = "a tensor created from Python data"
        else:
            where = f"{info.kind.value} {info.name}"
        return f"t{handle} ({where}, {info.meta})"

    def format_op(self, op: OpRecord) -> str:
        args = render_statics(op.statics, [f"t{h}" for h in op.inputs], op.scalars)
        outs = ", ".join("None" if h is None else f"t{h}" for h in op.outputs)
        lhs = f"{outs} = " if outs else ""
        return f"#{op.index} {lhs}{op.name}({args})"

    def listing(self) -> str:
        """Numbered listing of the record, one op per line with its source location."""
        lines = [f"# record of {self.function_name}: {len(self.ops)} ops, {len(self.tensors)} tensors"]
        for info in self.tensors:
            if info.kind is not Kind.INTERNAL:
                lines.append(f"#   t{info.handle}: {info.kind.value} {info.name} {info.meta}")
        for op in self.ops:
            lines.append(f"{self.format_op(op):<72} # {op.source}")
        lines.append(f"return {self.output.describe()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.listing()


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


TENSOR = _Marker("<tensor>")


class ScalarSlot:
    """Stands in `statics` for a dynamic scalar; only its Python type is structural."""

    __slots__ = ("type",)

    def __init__(self, type_: type):
        self.type = type_

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ScalarSlot) and other.type is self.type

    def __hash__(self) -> int:
        return hash(self.type)

    def __repr__(self) -> str:
        return f"<{self.type.__name__}>"


def render_statics(statics: tuple, tensor_names: list[str], scalars: tuple | list) -> str:
    """Render an op's arguments with tensors and scalars filled in, for listings and errors."""
    tensors = iter(tensor_names)
    values = iter(scalars)
    parts = []
    for item in statics:
        if isinstance(item, KwargStatic):
            parts.append(f"{item.name}={_render(item.value, tensors, values)}")
        else:
            parts.append(_render(item, tensors, values))
    return ", ".join(parts)


def _render(value: Any, tensors: Iterator, values: Iterator) -> str:
    if value is TENSOR:
        return next(tensors, "?")
    if isinstance(value, ScalarSlot):
        return repr(next(values, "?"))
    if isinstance(value, tuple):
        return "[" + ", ".join(_render(v, tensors, values) for v in value) + "]"
    if isinstance(value, torch.dtype):
        return str(value)
    return repr(value)


@dataclass(frozen=True)
class KwargStatic:
    name: str
    value: Any
