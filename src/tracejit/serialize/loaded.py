"""A loaded graph: compiled for the local backend, called like the traced function was.

The portable graph becomes a `Graph`, runs through the same pipeline a trace's host-free program
does (fusion with the local backend's kernels, memory planning) and is executed by the same
generated straight-line program. Calls check every input against the signature the graph was
traced with.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..backends import resolve_backend
from ..ir.graph import Graph
from ..ir.printer import format_graph
from ..options import GraphOptimizationConfig
from ..record.autocast_keys import outside_autocast
from ..record.record import TensorMeta, math_bits
from ..runtime.compiler import CompileOptions, compile_host_free
from ..runtime.profile import CLOCK, ProfileAccess, Profiler
from .portable import PortableGraph, TestCase, default_dtype, to_graph, uses_storage_offsets
from .schema import byte_span, extent, may_overlap

_MISSING = object()  # an input the call did not give (None is a value given, and refused as not a tensor)


class LoadedGraph(ProfileAccess):
    """A graph from a dump file. Call it with the inputs positionally or by name; it returns the
    outputs as a tuple, or as a dict by output name when the graph was dumped with output_names."""

    def __init__(self, portable: PortableGraph, *, backend: str = "auto", profiling: bool = False,
                 opt_level: int = 2):
        self.portable = portable
        self.name = portable.name
        self._profiler = Profiler(portable.name) if profiling else None
        # what changes no number is on at the default opt_level, as for a trace (options.EXACT_OPT_LEVEL)
        options = CompileOptions(opt_level, resolve_backend(backend),
                                 fuse_dimshuffle=GraphOptimizationConfig().fuse_dimshuffle(opt_level))
        # factory ops stored without a dtype follow the default dtype the graph was traced with, in
        # compiling (constant folding) and in every call, whatever the caller's is
        self._default_dtype = portable.default_dtype
        with default_dtype(self._default_dtype):
            self.program, _ = compile_host_free(to_graph(portable), options, portable.name, self._profiler)
            self.graph: Graph = self.program.graph
            self._template = self._environment_template()
        self._scalars = [s for op in portable.ops for s in op.scalars]
        values = portable.values
        self._inputs = [(i.name, i.meta, None if i.value is None else values[i.value].handle) for i in portable.inputs]
        self._positions = {name: index for index, (name, _, _) in enumerate(self._inputs)}
        # a graph taking absolute storage offsets (`as_strided(x, size, stride, offset)`) addresses an
        # input's storage from the offset it was traced with: an input at another one runs as a copy there
        self._offsets = ([i.storage_offset for i in portable.inputs] if uses_storage_offsets(portable.ops)
                         else [None] * len(portable.inputs))
        # inputs whose memory an op writes: traced (dump() refuses anything else) with inputs of their
        # own, so a call passing one overlapping another input would compute something else
        written = {values[w].root for op in portable.ops for w in op.writes}
        self._written_inputs = [handle is not None and handle in written for _, _, handle in self._inputs]
        # inputs whose shape or strides an op changes in place (`x.t_()`, `x.squeeze_()`, `x.resize_()`):
        # the op that does, by input. Such an input runs only as the caller's own tensor: a copy in the
        # traced layout would take the change, which no copy hands back to the caller's tensor
        self._reshaping_ops: list[str | None] = []
        for item in portable.inputs:
            found = None
            if item.value is not None:
                handle = values[item.value].handle
                found = next((op.name for op in portable.ops for w in op.writes
                              if values[w].handle == handle and values[w].meta != item.meta), None)
            self._reshaping_ops.append(found)
        # An output that shares memory with what the graph keeps between calls (a weight, a view of
        # one: `w.t()`, `b[:2]`, hoisted or not) is handed out as a copy: eager returns fresh memory
        # for a constant made by the call, and a caller writing into its result must not change the
        # next call's (or the loaded weights). A fresh constant is this call's copy already.
        compiled = self.graph.values
        root_of = {value.handle: value.root for value in compiled}
        kept = {h for h in self.graph.constants if h not in self.graph.fresh}
        kept |= {root_of.get(h, h) for h in kept} | set(self.program.hoisted)
        self._outputs = [(compiled[v].handle, compiled[v].handle in kept or compiled[v].root in kept)
                         for v in self.graph.outputs]
        names = [o.name for o in portable.outputs]
        self._output_names = names if names and all(n is not None for n in names) else None
        self._lock = threading.Lock()

    def _environment_template(self) -> list:
        template: list = [None] * self.graph.num_handles
        for handle, tensor in self.graph.constants.items():
            template[handle] = tensor
        if self.program.hoisted:  # views of constants, computed once
            env = list(template)
            with torch.no_grad():
                self.program.init(env)
            for handle in self.program.hoisted:
                template[handle] = env[handle]
        return template

    # -- calling --------------------------------------------------------------------------------

    def __call__(self, /, *args: Any, **kwargs: Any) -> tuple | dict:  # an input may be named `self`
        tensors = self._bind(args, kwargs)
        start = CLOCK() if self._profiler is not None else 0.0
        env = list(self._template)
        for handle in self.graph.fresh:  # a constant the program writes: this call's copy
            env[handle] = env[handle].clone()
        for (_, _, handle), tensor in zip(self._inputs, tensors):
            if handle is not None:
                env[handle] = tensor
        previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # an inference graph builds no autograd history
        try:
            # a caller's autocast would cast the recorded ops again (record/autocast_keys.py)
            # calls from several threads take turns (the program reuses its buffers)
            with self._lock, outside_autocast(), default_dtype(self._default_dtype):
                self.program.run(env, self._scalars)
            self._write_back(args, kwargs, tensors)
        finally:
            torch._C._set_grad_enabled(previous)
            if self._profiler is not None:  # a call that raised counts too: its nodes' times are in the rows
                self._profiler.call_done(start, recorded=False)
        copies: dict[int, torch.Tensor] = {}  # one copy per handle: `return w, w` returns one tensor twice
        for handle, kept in self._outputs:
            if kept and handle not in copies:
                copies[handle] = env[handle].clone()
        outputs = tuple(copies.get(handle, env[handle]) for handle, _ in self._outputs)
        return dict(zip(self._output_names, outputs)) if self._output_names else outputs

    def _bind(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        if len(args) > len(self._inputs):
            raise TypeError(f"{self.name}() takes {len(self._inputs)} inputs ({', '.join(self.input_names)}), "
                            f"got {len(args)} positional arguments")
        given: list[Any] = list(args) + [_MISSING] * (len(self._inputs) - len(args))
        for name, value in kwargs.items():
            position = self._positions.get(name)
            if position is None:
                raise TypeError(f"{self.name}() has no input named {name!r}; inputs: {', '.join(self.input_names)}")
            if position < len(args):
                raise TypeError(f"{self.name}() got input {name!r} both positionally and by name")
            given[position] = value
        checked = [self._checked(name, meta, value, offset)
                   for (name, meta, _), value, offset in zip(self._inputs, given, self._offsets)]
        for (name, meta, _), value, ran, op in zip(self._inputs, given, checked, self._reshaping_ops):
            if op is not None and ran is not value:
                offset = f" at storage offset {value.storage_offset()}" if value.storage_offset() else ""
                raise ValueError(f"{self.name}(): input {name!r} comes with strides {list(value.stride())}{offset}, "
                                 f"not the traced {list(meta.stride)}, and the graph changes its shape or strides in "
                                 f"place ({op}), which a copy in the traced layout could not hand back to the "
                                 f"given tensor; pass it in the traced layout: torch.empty_strided("
                                 f"{list(meta.shape)}, {list(meta.stride)}).copy_({name})")
        if any(self._written_inputs):
            self._check_no_overlap(given)
        return checked

    def _write_back(self, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> None:
        """An input the graph writes that came in another layout ran as a copy in the traced one
        (`_checked`): the caller's tensor gets the written values, as eager's in-place op gives it."""
        if not any(self._written_inputs):
            return
        for i, ((name, _, _), written, ran) in enumerate(zip(self._inputs, self._written_inputs, tensors)):
            given = args[i] if i < len(args) else kwargs[name]
            if written and ran is not given:
                given.copy_(ran)

    def _check_no_overlap(self, tensors: list[torch.Tensor]) -> None:
        """An input the graph writes must share no memory with another input (`g(a, a)`): the graph
        was traced with separate tensors, and eager would read the other input after the write."""
        spans = [_memory_span(t) for t in tensors]
        for i, (written, span) in enumerate(zip(self._written_inputs, spans)):
            if not written or span is None:
                continue
            for j, other in enumerate(spans):
                if j != i and other is not None and span[0] == other[0] and span[1] < other[2] and other[1] < span[2]:
                    names = self.input_names
                    raise ValueError(f"{self.name}(): input {names[i]!r} shares memory with input {names[j]!r}; the "
                                     f"graph writes {names[i]!r} in place and was traced with inputs of their own "
                                     f"memory: pass separate tensors (a .clone())")

    def _checked(self, name: str, meta: TensorMeta, value: Any, offset: int | None = None) -> torch.Tensor:
        if value is _MISSING:
            raise TypeError(f"{self.name}() is missing input {name!r} ({meta})")
        if not isinstance(value, torch.Tensor):
            got = "None" if value is None else type(value).__name__
            raise TypeError(f"{self.name}(): input {name!r} must be a tensor ({meta}), got {got}")
        if value.layout != torch.strided or value.is_nested:  # their shape or strides alone raise deep in torch
            layout = "nested" if value.is_nested else str(value.layout).removeprefix("torch.").lstrip("_")
            hint = "" if value.is_nested else " (convert it with .to_dense())"
            raise ValueError(f"{self.name}(): input {name!r} must be a dense tensor of layout strided ({meta}), "
                             f"got a {layout} tensor{hint}")
        if tuple(value.shape) != meta.shape or value.dtype != meta.dtype or value.device != meta.device:
            got = f"{value.device.type} {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
            raise ValueError(f"{self.name}(): input {name!r} must be {meta} (the signature it was traced with), "
                             f"got {got}")
        # another layout of the same values, or a negative or conjugate view (whose memory a kernel
        # would read without the negation): copy into the traced layout, which applies the bits
        # (and, in a graph taking absolute storage offsets, an input at another storage offset)
        moved = offset is not None and value.storage_offset() != offset
        if tuple(value.stride()) != meta.stride or math_bits(value) or moved:
            if may_overlap(meta.shape, meta.stride):
                return self._into_overlapping(name, meta, value, offset or 0)
            if offset:  # the memory before it holds zeros, not another call's values
                storage = torch.zeros(offset + extent(meta.shape, meta.stride), dtype=meta.dtype, device=meta.device)
                return storage.as_strided(meta.shape, meta.stride, offset).copy_(value)
            value = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=meta.device).copy_(value)
        return value

    def _into_overlapping(self, name: str, meta: TensorMeta, value: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Another layout of an input traced with elements sharing memory (`torch.randn(3).expand(4, 3)`):
        representable only when the elements that share memory there hold equal values."""
        span = extent(meta.shape, meta.stride)
        where = torch.arange(span, device=meta.device).as_strided(meta.shape, meta.stride).reshape(-1)
        storage = torch.zeros(offset + span, dtype=meta.dtype, device=meta.device)
        value = value.resolve_conj().resolve_neg()
        storage[where + offset] = value.reshape(-1)
        result = storage.as_strided(meta.shape, meta.stride, offset)
        equal = result == value
        if meta.dtype.is_floating_point or meta.dtype.is_complex:
            equal |= result.isnan() & value.isnan()
        if not bool(equal.all()):
            expanded = [d for d, (size, step) in enumerate(zip(meta.shape, meta.stride)) if size > 1 and step == 0]
            along = f" (stride 0 along dim {', '.join(map(str, expanded))})" if expanded else ""
            raise ValueError(f"{self.name}(): input {name!r} was traced with a layout in which elements share "
                             f"memory{along}, strides {list(meta.stride)}, as an expanded tensor's; the given "
                             f"tensor holds different values in elements that would share it. Pass values that "
                             f"repeat along those dims (or a tensor expanded the same way)")
        return result

    # -- introspection --------------------------------------------------------------------------

    @property
    def input_names(self) -> list[str]:
        return [name for name, _, _ in self._inputs]

    @property
    def inputs(self) -> dict[str, TensorMeta]:
        """Input name -> the metadata (shape, stride, dtype, device) a call must match."""
        return {name: meta for name, meta, _ in self._inputs}

    @property
    def output_names(self) -> list[str] | None:
        return self._output_names

    @property
    def user_info(self) -> Any:
        return self.portable.user_info

    @property
    def metadata(self) -> dict | None:
        return self.portable.metadata

    @property
    def testcases(self) -> list[TestCase]:
        return self.portable.testcases

    def parameters(self) -> dict[str, torch.Tensor]:
        """The graph's constants (weights) by name: their parameter names with keep_param_name=True."""
        return {c.name or f"constant {i}": c.tensor for i, c in enumerate(self.portable.constants)}

    def __str__(self) -> str:
        return format_graph(to_graph(self.portable))

    def __repr__(self) -> str:
        ins = ", ".join(f"{name}: {meta}" for name, meta, _ in self._inputs)
        return f"<tracejit.LoadedGraph {self.name}({ins}), {len(self.portable.ops)} ops>"

    def _no_profile_message(self) -> str:
        return f"{self.name} was loaded without profiling; pass profiling=True to tracejit.load to collect a profile"


def _memory_span(tensor: torch.Tensor) -> tuple[torch.device, int, int] | None:
    """(device, first byte address, end byte address) of the memory a tensor's elements occupy;
    None for a tensor without elements. Addresses, not storages: two storages may share memory
    (two `torch.from_numpy` views of one array)."""
    span = byte_span(tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size())
    address = tensor.data_ptr()
    if span is None or address == 0:
        return None
    return tensor.device, address + span[0], address + span[1]
