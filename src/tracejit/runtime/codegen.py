"""Generated straight-line Python for a host-free graph: one call per node, nothing else.

`run(env, s)` takes the environment (a list indexed by handle, holding the inputs) and the
dynamic scalars, runs every node as a plain call of a bound callable, drops each local at its
last use so memory is released as early as in eager mode, and stores the returned and escaped
values back into the environment. Nodes marked `hoisted` (views of external tensors) go into a
separate `init(env)`, run once per binding. Planned values are computed into their slice of the
persistent arena through the op's `out=` overload.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..backends.reference import ReferenceKernel
from ..ir.graph import INPUT_OPS, Graph, Node, Op
from ..passes.plan_memory import out_overload
from ..record.callables import resolve_callable
from ..record.calls import depends_on_grad_mode
from ..record.record import TENSOR, KwargStatic, ScalarSlot, TensorMeta
from .profile import CLOCK, Profiler, Row

_INLINE_TYPES = (int, bool, str, type(None))


def callable_for(node: Node) -> Callable:
    function = resolve_callable(node.target, node.statics, node.input_metas, node.scalars)
    return with_recorded_grad_mode(node.target, function, node.grad_enabled)


def with_recorded_grad_mode(op: Callable, function: Callable, grad_enabled: bool | None) -> Callable:
    """`function`, run below autograd (no graph is built) in the grad mode `op` was recorded under
    when it is a kernel that behaves differently without gradients (record/calls.py
    GRAD_MODE_KERNELS); the program itself runs without them. The oneDNN LSTM layer recorded under
    no_grad ran its inference primitive, whose rounding differs from the training one's."""
    if not depends_on_grad_mode(op):
        return function
    enabled = True if grad_enabled is None else grad_enabled  # None: a graph loaded from a file

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.set_grad_enabled(enabled), torch._C._AutoDispatchBelowADInplaceOrView():
            return function(*args, **kwargs)

    run.__name__ = getattr(function, "__name__", str(op))
    return run


def out_callable(node: Node, out: TensorMeta) -> Callable:
    """The fastest verified callable of the node's `.out` overload, writing into a tensor of `out`."""
    statics = (*node.statics, KwargStatic("out", TENSOR))
    metas = (*node.input_metas, out)
    return resolve_callable(out_overload(node.target), statics, metas, node.scalars)


@dataclass
class GeneratedProgram:
    source: str
    run: Callable[[list, list], None]
    init: Callable[[list], None]
    hoisted: tuple[int, ...]  # handles init() computes
    arena: torch.Tensor | None


class _Emitter:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.namespace: dict[str, Any] = {}
        self.fixed: dict[int, Any] = {}  # handle -> the tensor it is on every call (arena buffers, static views)

    def constant(self, value: Any, prefix: str = "k") -> str:
        name = f"{prefix}{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def local(self, value_id: int) -> str:
        return f"h{self.graph.values[value_id].handle}"

    def static(self, value: Any, tensors: list[str], scalars: list[str]) -> str:
        if value is TENSOR:
            return tensors.pop(0)
        if isinstance(value, ScalarSlot):
            return scalars.pop(0)
        if isinstance(value, tuple):
            return "[" + ", ".join(self.static(v, tensors, scalars) for v in value) + "]"
        if type(value) in _INLINE_TYPES or (isinstance(value, float) and abs(value) < float("inf")):
            return repr(value)
        return self.constant(value)

    def arguments(self, node: Node) -> list[str]:
        tensors = [self.local(v) for v in node.inputs]
        base = node.scalar_base
        scalars = [f"s[{base + i}]" for i in range(len(node.scalars))]
        parts = []
        for item in node.statics:
            if isinstance(item, KwargStatic):
                parts.append(f"{item.name}={self.static(item.value, tensors, scalars)}")
            else:
                parts.append(self.static(item, tensors, scalars))
        return parts

    def targets(self, node: Node) -> str:
        kind = node.out_kind
        if kind == "tensor":
            return f"{self.local(node.outputs[0])} = "
        if kind in ("tuple", "list"):
            names = [self.local(v) if v is not None else "_" for v in node.outputs]
            return ", ".join(names) + ("," if len(names) == 1 else "") + " = "
        return ""

    def call(self, node: Node, arena: torch.Tensor | None) -> str:
        args = self.arguments(node)
        buffer = node.buffer
        if buffer is not None and arena is not None:
            offset, nbytes = buffer
            meta = self.graph.values[node.outputs[0]].meta
            out = arena[offset:offset + nbytes].view(meta.dtype).view(meta.shape)
            self.fixed[self.graph.values[node.outputs[0]].handle] = out
            args.append(f"out={self.constant(out, 'buf')}")
            function = self.constant(out_callable(node, meta), "f")
        else:
            function = self.constant(callable_for(node), "f")
        return f"{self.targets(node)}{function}({', '.join(args)})  # {node.name}"

    def static_view(self, node: Node) -> str:
        """A view of arena buffers (make_views_static): made now, bound on every call."""
        call = f"{self.constant(callable_for(node), 'f')}({', '.join(self.arguments(node))})"
        with torch.no_grad():  # the namespace and the fixed values as they are, not copied per view
            result = eval(call, self.namespace, _FixedValues(self.fixed))  # noqa: S307 - our own generated call
        values = [result] if node.out_kind == "tensor" else list(result)
        names = []
        for vid, value in zip(node.outputs, values):
            if vid is None:
                names.append("_")
                continue
            self.fixed[self.graph.values[vid].handle] = value
            names.append(self.local(vid))
        constants = [self.constant(v, "view") for v in values]
        return f"{', '.join(names)} = {', '.join(constants)}  # {node.name} (static view)"


class _FixedValues:
    """The locals `h<handle>` of the fixed values, for evaluating a generated call."""

    def __init__(self, fixed: dict[int, Any]):
        self.fixed = fixed

    def __getitem__(self, name: str) -> Any:
        if name[:1] == "h" and name[1:].isdigit() and int(name[1:]) in self.fixed:
            return self.fixed[int(name[1:])]
        raise KeyError(name)


def _profiled(emitter: _Emitter, profiler: Profiler | None, node: Node, line: str, program: str) -> list[str]:
    """The node's call line, timed into its own profile row when profiling."""
    if profiler is None:
        return [line]
    members = node.members or (node,)
    row = profiler.add_row(Row(
        node.name, tuple(m.name for m in members),
        tuple(str(m.source) for m in members if m.source is not None), program,
        cuda=any(v.meta.device.type == "cuda" for v in (emitter.graph.values[o] for o in node.outputs if o is not None)),
    ))
    label = emitter.constant(profiler.label(row), "label")
    for name, value in (("CLOCK", CLOCK), ("STOP", profiler.stop), ("PROFILER_ON", torch._C._autograd._profiler_enabled),
                        ("ENTER", torch.ops.profiler._record_function_enter_new), ("EXIT", torch.ops.profiler._record_function_exit)):
        emitter.namespace[name] = value
    return [
        "_t = CLOCK()",
        f"_rf = ENTER({label}) if PROFILER_ON() else None",  # shows the node inside torch.profiler
        line,
        "if _rf is not None: EXIT(_rf)",
        f"STOP({row}, _t)",
    ]


@dataclass(frozen=True)
class RunParts:
    """What `run` is made of, for callers that inline it: the without_host call binds the loaded
    handles to locals itself and writes the kept ones where they belong (see hostfree.py)."""

    loads: tuple[int, ...]  # handles `run` reads from env, in order
    body: tuple[str, ...]  # the node calls and dels, over the locals h<handle>
    stores: tuple[int, ...]  # handles `run` writes back to env: returned and escaped values
    origins: tuple[int, ...] = ()  # per line of `body`, the index of the graph node it belongs to


def generate_straight_line(graph: Graph, profiler: Profiler | None = None,
                           kernels: dict[int, Any] | None = None) -> GeneratedProgram:
    """`kernels` maps the index of every FUSED node to its kernel (see backends/kernels.py). The
    generated `run` carries its `RunParts` as the attribute `parts`."""
    emitter = _Emitter(graph)
    arena = _allocate_arena(graph)
    hoisted = [n for n in graph.nodes if n.op is Op.CALL and n.hoisted]
    hoisted_handles = tuple(graph.values[v].handle for n in hoisted for v in n.outputs if v is not None)
    last_use = _last_uses(graph)
    keep = {graph.values[v].handle for v in graph.outputs} | set(graph.escaped)
    visible = _visible_roots(graph)
    body, origins = [], []
    flipped = False  # inside a `with` block of the other inference mode (graph.inference_flipped)
    if graph.inference_flipped:
        emitter.namespace["INFERENCE_MODE"] = torch._C._InferenceMode
    for index, node in enumerate(graph.nodes):
        if node.op in INPUT_OPS or node.hoisted:
            continue
        lines = []
        if node.static_view and arena is not None:
            lines.append(emitter.static_view(node))
        else:
            if node.op is Op.FUSED:
                line = _fused_call(emitter, node, kernels[index], arena)
            else:
                line = emitter.call(node, arena)
            lines += _profiled(emitter, profiler, node, line, "without_host")
            if node.op is Op.FUSED and not isinstance(kernels[index], ReferenceKernel):
                lines += _version_bumps(emitter, node, visible)
        dead = sorted(h for h, last in last_use.items() if last == index and h not in keep)
        if dead:
            lines.append("del " + ", ".join(f"h{h}" for h in dead))
        # an op the function ran inside (or outside) torch.inference_mode() runs so: its results are
        # inference tensors where eager's are. Fused groups never span a switch (graph.barriers).
        if bool(node.positions) and max(node.positions) in graph.inference_flipped:
            if not flipped:
                body.append(f"with INFERENCE_MODE({not graph.inference_mode}):")
                origins.append(index)
                flipped = True
            body += [f"    {line}" for line in lines]
        else:
            flipped = False
            body += lines
        origins += [index] * len(lines)
    parts = RunParts(_loaded_handles(graph, hoisted_handles), tuple(body), tuple(sorted(keep)), tuple(origins))
    run_lines = [f"h{h} = env[{h}]" for h in parts.loads] + body + [f"env[{h}] = h{h}" for h in parts.stores]
    hoisted_inputs = _inputs_of(graph, hoisted)
    init_lines = [f"h{h} = env[{h}]" for h in _loaded_handles(graph, ()) if h in hoisted_inputs]
    init_lines += [emitter.call(n, None) for n in hoisted]
    init_lines += [f"env[{h}] = h{h}" for h in hoisted_handles]
    source = _function("run", "env, s", run_lines) + "\n" + _function("init", "env", init_lines)
    namespace = dict(emitter.namespace)
    exec(compile(source, f"<tracejit program {graph.function_name}>", "exec"), namespace)
    namespace["run"].parts = parts
    return GeneratedProgram(source, namespace["run"], namespace["init"], hoisted_handles, arena)


def _fused_call(emitter: _Emitter, node: Node, kernel_object: Any, arena: torch.Tensor | None = None) -> str:
    kernel = emitter.constant(kernel_object, "kernel")
    ins = ", ".join(emitter.local(v) for v in node.inputs)
    outs = [emitter.local(v) for v in node.outputs if v is not None]
    handed = ""
    if arena is not None and any(b is not None for b in node.buffers):
        # planned results (jit_fuse_dimshuffle): the kernel writes into its arena slices
        buffers = []
        for vid, buffer in zip(node.outputs, node.buffers):
            if buffer is None:
                buffers.append(None)
                continue
            meta = emitter.graph.values[vid].meta
            out = arena[buffer[0]:buffer[0] + buffer[1]].view(meta.dtype).view(meta.shape)
            emitter.fixed[emitter.graph.values[vid].handle] = out
            buffers.append(out)
        handed = f", {emitter.constant(tuple(buffers), 'bufs')}"
    call = f"{kernel}(({ins}{',' if len(node.inputs) == 1 else ''}), s{handed})  # {node.name}"
    return f"{', '.join(outs)}{',' if len(outs) == 1 else ''} = {call}" if outs else call


def _visible_roots(graph: Graph) -> frozenset[int]:
    """Handles of the storage the caller sees: the inputs, externals and captured constants (not
    a literal the program makes anew on every call)."""
    inputs = {graph.values[n.outputs[0]].handle for n in graph.nodes if n.op in INPUT_OPS}
    return frozenset(inputs - graph.fresh)


def _version_bumps(emitter: _Emitter, node: Node, visible: frozenset[int]) -> list[str]:
    """After a compiled kernel: one version bump per in-place member write into storage the caller
    sees, as eager's ADInplaceOrView makes for each op. A kernel writes through data pointers, so
    without them autograd's "modified by an inplace operation" check (a caller's graph that saved
    the tensor) and capture_as_const's check of captured tensors would miss the write. Aten ops of
    the program (and the reference kernel's members) are dispatched and bump themselves; in checked
    replay at the aten level each member is dispatched by the host (program._as_dispatched)."""
    values = emitter.graph.values
    written = []
    for member in node.members:
        handed = {values[v].handle for v in member.inputs}
        # `writes` holds a new version of every alias of the written storage: the op wrote the
        # tensors it was handed
        written += [emitter.local(w) for w in member.writes if values[w].handle in handed and values[w].root in visible]
    if not written:
        return []
    emitter.namespace["BUMP"] = torch._C._increment_version  # takes a tuple: one C call for all
    return [f"BUMP(({', '.join(written)},))"]


def _function(name: str, params: str, lines: list[str]) -> str:
    return f"def {name}({params}):\n" + "\n".join(f"    {line}" for line in lines or ["pass"]) + "\n"


def _loaded_handles(graph: Graph, extra_handles: tuple[int, ...]) -> tuple[int, ...]:
    handles = [graph.values[node.outputs[0]].handle for node in graph.nodes if node.op in INPUT_OPS]
    return tuple(dict.fromkeys([*handles, *extra_handles]))


def _inputs_of(graph: Graph, nodes: list[Node]) -> set[int]:
    return {graph.values[v].handle for n in nodes for v in n.inputs}


def _last_uses(graph: Graph) -> dict[int, int]:
    """handle -> index of the last node that reads or defines any of its versions."""
    last: dict[int, int] = {}
    for index, node in enumerate(graph.nodes):
        if node.op in INPUT_OPS or node.hoisted:
            continue
        for vid in (*node.inputs, *(v for v in node.outputs if v is not None)):
            last[graph.values[vid].handle] = index
    return last


def _allocate_arena(graph: Graph) -> torch.Tensor | None:
    if not graph.arena_bytes:
        return None
    devices = {graph.values[n.outputs[0]].meta.device for n in graph.nodes if n.buffer}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    # touched now, while the program is built: its pages are faulted in once here rather than by
    # the program's first run (which would pay for them inside a replayed call)
    return torch.zeros(graph.arena_bytes, dtype=torch.uint8, device=device)
