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

from ..ir.graph import INPUT_OPS, Graph, Node, Op
from ..passes.plan_memory import out_overload
from ..record.record import TENSOR, KwargStatic, ScalarSlot
from ..record.callables import resolve_callable
from .profile import CLOCK, Profiler, Row

_INLINE_TYPES = (int, bool, str, type(None))


def callable_for(node: Node) -> Callable:
    metas = node.attr("input_metas") or ()
    return resolve_callable(node.target, node.attr("statics", ()), tuple(metas), node.attr("scalars", ()))


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
        base = node.attr("scalar_base", 0)
        scalars = [f"s[{base + i}]" for i in range(len(node.attr("scalars", ())))]
        parts = []
        for item in node.attr("statics", ()):
            if isinstance(item, KwargStatic):
                parts.append(f"{item.name}={self.static(item.value, tensors, scalars)}")
            else:
                parts.append(self.static(item, tensors, scalars))
        return parts

    def targets(self, node: Node) -> str:
        kind = node.attr("out_kind")
        if kind == "tensor":
            return f"{self.local(node.outputs[0])} = "
        if kind in ("tuple", "list"):
            names = [self.local(v) if v is not None else "_" for v in node.outputs]
            return ", ".join(names) + ("," if len(names) == 1 else "") + " = "
        return ""

    def call(self, node: Node, arena: torch.Tensor | None) -> str:
        args = self.arguments(node)
        buffer = node.attr("buffer")
        if buffer is not None and arena is not None:
            offset, nbytes = buffer
            meta = self.graph.values[node.outputs[0]].meta
            out = arena[offset:offset + nbytes].view(meta.dtype).view(meta.shape)
            args.append(f"out={self.constant(out, 'buf')}")
            function = self.constant(out_overload(node.target)._op, "f")
        else:
            function = self.constant(callable_for(node), "f")
        return f"{self.targets(node)}{function}({', '.join(args)})  # {node.name}"


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


def generate_straight_line(graph: Graph, profiler: Profiler | None = None,
                           kernels: dict[int, Any] | None = None) -> GeneratedProgram:
    """`kernels` maps the index of every FUSED node to its kernel (see runtime/fused.py)."""
    emitter = _Emitter(graph)
    arena = _allocate_arena(graph)
    hoisted = [n for n in graph.nodes if n.op is Op.CALL and n.attr("hoisted")]
    hoisted_handles = tuple(graph.values[v].handle for n in hoisted for v in n.outputs if v is not None)
    run_lines = _load_lines(graph, hoisted_handles)
    last_use = _last_uses(graph)
    keep = {graph.values[v].handle for v in graph.outputs} | set(graph.escaped)
    for index, node in enumerate(graph.nodes):
        if node.op in INPUT_OPS or node.attr("hoisted"):
            continue
        line = _fused_call(emitter, node, kernels[index]) if node.op is Op.FUSED else emitter.call(node, arena)
        run_lines += _profiled(emitter, profiler, node, line, "without_host")
        dead = sorted(h for h, last in last_use.items() if last == index and h not in keep)
        if dead:
            run_lines.append("del " + ", ".join(f"h{h}" for h in dead))
    run_lines += [f"env[{h}] = h{h}" for h in sorted(keep)]
    init_lines = _load_lines(graph, ())
    init_lines = [line for line in init_lines if _loaded_handle(line) in _inputs_of(graph, hoisted)]
    init_lines += [emitter.call(n, None) for n in hoisted]
    init_lines += [f"env[{h}] = h{h}" for h in hoisted_handles]
    source = _function("run", "env, s", run_lines) + "\n" + _function("init", "env", init_lines)
    namespace = dict(emitter.namespace)
    exec(compile(source, f"<tracejit program {graph.function_name}>", "exec"), namespace)
    return GeneratedProgram(source, namespace["run"], namespace["init"], hoisted_handles, arena)


def _fused_call(emitter: _Emitter, node: Node, kernel_object: Any) -> str:
    kernel = emitter.constant(kernel_object, "kernel")
    ins = ", ".join(emitter.local(v) for v in node.inputs)
    outs = [emitter.local(v) for v in node.outputs if v is not None]
    call = f"{kernel}(({ins}{',' if len(node.inputs) == 1 else ''}), s)  # {node.name}"
    return f"{', '.join(outs)}{',' if len(outs) == 1 else ''} = {call}" if outs else call


def _function(name: str, params: str, lines: list[str]) -> str:
    return f"def {name}({params}):\n" + "\n".join(f"    {line}" for line in lines or ["pass"]) + "\n"


def _load_lines(graph: Graph, extra_handles: tuple[int, ...]) -> list[str]:
    handles = []
    for node in graph.nodes:
        if node.op in INPUT_OPS:
            handles.append(graph.values[node.outputs[0]].handle)
    handles += extra_handles
    return [f"h{h} = env[{h}]" for h in dict.fromkeys(handles)]


def _loaded_handle(line: str) -> int:
    return int(line.split(" = ")[0][1:])


def _inputs_of(graph: Graph, nodes: list[Node]) -> set[int]:
    return {graph.values[v].handle for n in nodes for v in n.inputs}


def _last_uses(graph: Graph) -> dict[int, int]:
    """handle -> index of the last node that reads or defines any of its versions."""
    last: dict[int, int] = {}
    for index, node in enumerate(graph.nodes):
        if node.op in INPUT_OPS or node.attr("hoisted"):
            continue
        for vid in (*node.inputs, *(v for v in node.outputs if v is not None)):
            last[graph.values[vid].handle] = index
    return last


def _allocate_arena(graph: Graph) -> torch.Tensor | None:
    if not graph.arena_bytes:
        return None
    devices = {graph.values[n.outputs[0]].meta.device for n in graph.nodes if n.attr("buffer")}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    return torch.empty(graph.arena_bytes, dtype=torch.uint8, device=device)
