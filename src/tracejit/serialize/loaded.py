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
from ..record.record import TensorMeta, math_bits
from ..runtime.compiler import CompileOptions, compile_host_free
from ..runtime.profile import CLOCK, ProfileAccess, Profiler
from .portable import PortableGraph, TestCase, to_graph

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
        self.program, _ = compile_host_free(to_graph(portable), options, portable.name, self._profiler)
        self.graph: Graph = self.program.graph
        self._template = self._environment_template()
        self._scalars = [s for op in portable.ops for s in op.scalars]
        values = portable.values
        self._inputs = [(i.name, i.meta, None if i.value is None else values[i.value].handle) for i in portable.inputs]
        self._positions = {name: index for index, (name, _, _) in enumerate(self._inputs)}
        # An output that shares memory with what the graph keeps between calls (a weight, a view of
        # one: `w.t()`, `b[:2]`, hoisted or not) is handed out as a copy: eager returns fresh memory
        # for a constant made by the call, and a caller writing into its result must not change the
        # next call's (or the loaded weights). A fresh constant is this call's copy already.
        kept = set(self.graph.constants) - set(self.graph.fresh)
        compiled = self.graph.values
        self._outputs = [(compiled[v].handle, compiled[v].root in kept or compiled[v].handle in self.program.hoisted)
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

    def __call__(self, *args: Any, **kwargs: Any) -> tuple | dict:
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
            with self._lock:  # calls from several threads take turns: the program reuses its buffers
                self.program.run(env, self._scalars)
        finally:
            torch._C._set_grad_enabled(previous)
        copies: dict[int, torch.Tensor] = {}  # one copy per handle: `return w, w` returns one tensor twice
        for handle, kept in self._outputs:
            if kept and handle not in copies:
                copies[handle] = env[handle].clone()
        outputs = tuple(copies.get(handle, env[handle]) for handle, _ in self._outputs)
        if self._profiler is not None:
            self._profiler.call_done(start, recorded=False)
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
        return [self._checked(name, meta, value) for (name, meta, _), value in zip(self._inputs, given)]

    def _checked(self, name: str, meta: TensorMeta, value: Any) -> torch.Tensor:
        if value is _MISSING:
            raise TypeError(f"{self.name}() is missing input {name!r} ({meta})")
        if not isinstance(value, torch.Tensor):
            got = "None" if value is None else type(value).__name__
            raise TypeError(f"{self.name}(): input {name!r} must be a tensor ({meta}), got {got}")
        if tuple(value.shape) != meta.shape or value.dtype != meta.dtype or value.device != meta.device:
            got = f"{value.device.type} {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
            raise ValueError(f"{self.name}(): input {name!r} must be {meta} (the signature it was traced with), "
                             f"got {got}")
        # another layout of the same values, or a negative or conjugate view (whose memory a kernel
        # would read without the negation): copy into the traced layout, which applies the bits
        if tuple(value.stride()) != meta.stride or math_bits(value):
            value = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=meta.device).copy_(value)
        return value

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

