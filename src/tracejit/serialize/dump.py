"""`traced.dump()`: write the host-free graph of a `capture_as_const` trace for inference.

The graph is the one `without_host` would run, built from the trace's record, without Python
state (a dumped graph only has outputs), optimized by the inference pipeline, checked op by op
as a loader will check it, and written with its weights and test cases. See docs/format.md.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import LoadError
from ..ir import build_graph
from ..ir.graph import Graph
from ..passes import run_pipeline
from ..passes.inference import INFERENCE_PIPELINE
from ..record.record import Kind, Record, TensorMeta
from ..record.symbolic import sorted_kwargs
from .container import pack, write
from .format import VERSION, encode
from .load import read_graphs, select
from .loaded import LoadedGraph
from .options import DumpOptions
from .portable import PortableGraph, TestCase, default_dtype, from_graph
from .precision import to_half_compute, to_half_storage
from .schema import byte_span
from .tagged import WEIGHT_DTYPES, TaggedValueError, encode_statics
from .testcases import fresh_inputs, max_error, parse_case
from .validate import check_graph, resolve_op


@dataclass
class DumpInfo:
    """What `dump()` wrote."""

    graph: str
    inputs: dict[str, TensorMeta]
    outputs: list[tuple[str | None, TensorMeta]]
    ops: int
    op_counts: dict[str, int]
    params: int  # constant tensors (weights)
    param_numel: int
    file_size: int  # bytes of the whole file
    testcases: int = 0
    max_errors: list[float] = field(default_factory=list)  # per test case: this graph loaded here vs reference
    passes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        ins = ", ".join(f"{name}: {meta}" for name, meta in self.inputs.items())
        outs = ", ".join(f"{name or i}: {meta}" for i, (name, meta) in enumerate(self.outputs))
        lines = [f"{self.graph}({ins}) -> ({outs})",
                 f"  {self.ops} ops, {self.params} parameters ({self.param_numel} values), file {self.file_size} bytes"]
        if self.testcases:
            errors = ", ".join(f"{e:.3g}" for e in self.max_errors) or "no reference outputs"
            lines.append(f"  {self.testcases} test cases, max error {errors}")
        return "\n".join(lines)


def dump_trace(traced: Any, file: Any, **options: Any) -> DumpInfo:
    """See `tracejit.trace.dump`."""
    _check_option_names(options)
    opts = DumpOptions(**options)
    record = _the_record(traced)
    _check_distinct_inputs(traced, record)
    if opts.append and not isinstance(file, (str, os.PathLike)):
        raise ValueError("dump(): append=True adds a graph to an existing file, so file must be a path")
    reference = replace(build_graph(record, host_visible=False, capture_as_const=True), escaped=frozenset())
    graph, passes = reference, []
    dtype = traced_default_dtype(traced)
    if opts.optimize_for_inference:
        with default_dtype(dtype):  # the passes fold and check ops as the trace ran them
            result = run_pipeline(reference, 0, check=True, passes=INFERENCE_PIPELINE)
        graph, passes = result.graph, [name for name, _, _ in result.history[1:]]
    externals = _returned_externals(traced, record)
    portable = _portable(graph, record, opts, externals, dtype)
    portable.user_info = opts.user_info
    portable.metadata = _metadata(traced, opts, passes) if opts.enable_metadata else None
    if opts.input_data is not None:
        portable.testcases = _testcases(_portable(reference, record, DumpOptions(), externals, dtype), portable, opts)
    graphs = _existing(file, portable.name) if opts.append else []
    data = pack(*encode(graphs + [portable]))
    info = _info(portable, len(data), passes)
    if any(case.outputs is not None for case in portable.testcases):
        info.max_errors = _round_trip_errors(data, portable.name)
        _warn_failing_cases(info.max_errors, portable.testcases)
    write(file, data)
    return info


# Options of MegEngine's dump that have no meaning for a PyTorch graph, and why.
_NOT_APPLICABLE = {
    "keep_opr_priority": "aten ops have no execution priorities",
    "strip_info_file": "the file format has no separate info file; see the returned DumpInfo",
    "dump_format": "there is one format, documented in docs/format.md",
    "model_version": "the format is versioned by tracejit itself",
    "resize_input": "a dumped graph has the static shapes it was traced with",
    "input_transform": "transform inputs before tracing, inside the traced function",
    "silent": "dump() prints nothing",
}


def _check_option_names(options: dict) -> None:
    for name in options:
        if name in _NOT_APPLICABLE:
            raise TypeError(f"dump(): option {name!r} is not accepted: {_NOT_APPLICABLE[name]}")
        if name.startswith(("enable_nc", "enable_fuse", "enable_chw")):
            raise TypeError(f"dump(): option {name!r} is not accepted: layout and fusion choices are made at load "
                            f"time by the local backend")
        if name not in DumpOptions.__dataclass_fields__:
            raise TypeError(f"dump(): unknown option {name!r}; options: {', '.join(DumpOptions.__dataclass_fields__)}")


def _the_record(traced: Any) -> Record:
    name = traced.__name__
    if not traced.options.capture_as_const:
        raise ValueError(f"dump(): {name}() was traced without capture_as_const=True, so its weights are not part "
                         f"of the trace; trace it with tracejit.trace(..., capture_as_const=True), call it once, "
                         f"then dump")
    records = traced.records
    if not records:
        raise RuntimeError(f"dump(): {name}() has not been called yet, so there is no graph to dump; call it once "
                           f"with example inputs, then dump")
    if len(records) > 1:
        raise ValueError(f"dump(): {name}() has {len(records)} traces (one per input signature, input size "
                         f"or gradient state); a file holds one graph per dump: trace a fresh function, call it with the "
                         f"signature to dump, then dump")
    record = records[0]
    if not record.output.handles():
        returned = "nothing" if record.output.kind == "none" else f"no tensor ({record.output.describe()})"
        raise ValueError(f"dump(): {name}() returns {returned}, so the dumped graph would have no outputs; "
                         f"return the tensors the graph computes")
    if record.host_reads:
        read = record.host_reads[0]
        raise ValueError(f"dump(): {name}() reads tensor values on the host ({read.what} of t{read.handle} at "
                         f"{read.source}); a dumped graph would freeze the value read. Return the tensor instead")
    if record.hidden_reads:
        read = record.hidden_reads[0]
        raise ValueError(f"dump(): in {name}(), {read.describe()} and chooses its ops from those values; a dumped "
                         f"graph would keep the recorded ops for any values. Pass them as Python ints instead")
    return record


def input_handles(record: Record) -> list[int]:
    """The handles of a dumped graph's inputs, in order: the positional tensor arguments, then the
    tensor keyword arguments sorted by name (as the trace's signature orders them), whatever order
    the recorded call passed them in."""
    return list(record.arg_handles) + sorted_kwargs(record.kwarg_handles)


def _check_distinct_inputs(traced: Any, record: Record) -> None:
    """A dumped graph binds every input to memory of its own: a trace of a call that passed one
    tensor twice, or views of one storage, has no faithful portable form."""
    entry = traced._entries()[0]
    handles = input_handles(record)
    names = [record.tensors[h].name for h in record.arg_handles] + sorted(record.kwarg_handles)
    repeated = [(i, j) for i, j in enumerate(entry.key[3]) if i != j]
    shared = [(i, j) for i, j, offset in entry.key[4] if _overlap(record, handles[i], handles[j], offset)]
    for (i, j), how in [(p, "were the same tensor") for p in repeated] + [(p, "overlapped in memory") for p in shared]:
        raise ValueError(f"dump(): inputs {names[j]!r} and {names[i]!r} of the recorded call of "
                         f"{record.function_name}() {how}; a dumped graph binds every input to memory of its "
                         f"own, so it could not compute what this trace computed. Trace it with separate tensors "
                         f"(pass a .clone())")


def _overlap(record: Record, first: int, second: int, offset: int) -> bool:
    """Whether inputs `first` and `second`, `offset` bytes apart in one storage, share an element's
    memory (views of disjoint parts of one tensor, `f(x[0], x[1])`, do not)."""
    spans = []
    for handle, start in ((first, offset), (second, 0)):
        meta = record.tensors[handle].meta
        span = byte_span(meta.shape, meta.stride, torch.empty((), dtype=meta.dtype).element_size())
        if span is None:
            return False
        spans.append((start + span[0], start + span[1]))
    return spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]


def _returned_externals(traced: Any, record: Record) -> dict[int, torch.Tensor]:
    """Tensors the function returned without any op reading them (`return x + 1, W`): no op
    captured them as constants, so the dump takes them from the last call that ran the function."""
    entry = traced._entries()[0]
    live = entry.handles.live() if entry.handles is not None else {}
    return {h: live[h].detach() for h in record.output.handles()
            if record.tensors[h].kind is Kind.EXTERNAL and h in live}


def traced_default_dtype(traced: Any) -> torch.dtype:
    """torch's default dtype when the dumped trace was recorded (part of its call context,
    signature.call_context_key), whatever the default is when dump() runs."""
    dtype = traced._entries()[0].key[-1][5]
    return dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()


def _portable(graph: Graph, record: Record, opts: DumpOptions,
              externals: dict[int, torch.Tensor] | None = None,
              default_dtype: torch.dtype = torch.float32) -> PortableGraph:
    handles = input_handles(record)
    recorded = [record.tensors[h].name for h in handles]
    input_names = list(opts.arg_names) if opts.arg_names is not None else recorded
    if len(input_names) != len(handles):
        raise ValueError(f"dump(): arg_names has {len(input_names)} names, {record.function_name}() has "
                         f"{len(handles)} tensor inputs ({', '.join(recorded)})")
    positional = len(record.arg_handles)
    for index, (given, own) in enumerate(zip(input_names, recorded)):
        # `a` given where the recorded `b` goes: calling the graph by the function's names swaps them
        if given != own and given in recorded:
            kind = "positional argument" if index < positional else "keyword argument"
            other = "positional argument" if recorded.index(given) < positional else "keyword argument"
            raise ValueError(f"dump(): arg_names names the input of {kind} {own!r} {given!r}, the name of "
                             f"{'another' if kind == other else 'a'} {other}; that would swap them (tensor keyword "
                             f"arguments come after the positional ones, sorted by name: {', '.join(recorded)})")
    output_names = list(opts.output_names) if opts.output_names is not None else [None] * len(graph.outputs)
    if len(output_names) != len(graph.outputs):
        raise ValueError(f"dump(): output_names has {len(output_names)} names, {record.function_name}() returns "
                         f"{len(graph.outputs)} tensors")
    portable = from_graph(graph, record, handles, input_names, output_names, opts.keep_opr_name,
                          opts.keep_param_name, opts.keep_var_name, externals or {})
    if opts.enable_ioc16:
        portable = to_half_compute(portable)
    elif opts.enable_io16xc32:
        portable = to_half_storage(portable)
    portable.default_dtype = default_dtype
    _check_storable(portable)
    return portable


def _check_storable(portable: PortableGraph) -> None:
    """Every op is one a loader accepts and its arguments have a portable form; say which is not."""
    for index, op in enumerate(portable.ops):
        where = f"op #{index} {op.name}" + (f" at {op.source}" if op.source else "")
        try:
            resolve_op(f"{op.target._schema.name}.{op.target._overloadname}")
            encode_statics(op.statics)
        except (LoadError, TaggedValueError) as error:
            raise ValueError(f"dump(): cannot store {where}: {error}") from None
    for constant in portable.constants:
        if constant.tensor.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"dump(): cannot store the weight {constant.name or f'v{constant.value}'} of dtype "
                             f"{constant.tensor.dtype}: safetensors has no such type (weights may be "
                             f"{', '.join(sorted(str(d).removeprefix('torch.') for d in WEIGHT_DTYPES))})")
    try:
        check_graph(portable)
    except LoadError as error:
        raise ValueError(f"dump(): the graph would not load: {error}") from None
    names = [c.name for c in portable.constants if c.name is not None]
    seen: dict[str, int] = {}
    for index, constant in enumerate(portable.constants):
        if constant.name is not None and names.count(constant.name) > 1:
            seen[constant.name] = seen.get(constant.name, 0) + 1
            portable.constants[index] = replace(constant, name=f"{constant.name}#{seen[constant.name]}")


def _metadata(traced: Any, opts: DumpOptions, passes: list[str]) -> dict:
    from .. import __version__

    return {
        "format_version": VERSION, "tracejit": __version__, "torch": torch.__version__,
        "function": getattr(traced, "__qualname__", traced.__name__), "inference_passes": passes,
        "precision": "io16xc32" if opts.enable_io16xc32 else ("ioc16" if opts.enable_ioc16 else "as traced"),
        "default_dtype": str(traced_default_dtype(traced)).removeprefix("torch."),
    }


def _testcases(reference: PortableGraph, portable: PortableGraph, opts: DumpOptions) -> list[TestCase]:
    """Inputs from input_data and the outputs of the unoptimized graph on them (the reference)."""
    cases = opts.input_data if isinstance(opts.input_data, list) else [opts.input_data]
    metas = {i.name: i.meta for i in portable.inputs}
    references = LoadedGraph(reference, backend="aten", opt_level=0)
    found = []
    for index, case in enumerate(cases):
        try:
            inputs = parse_case(case, metas, opts.repeat)
        except (ValueError, TypeError) as error:
            raise type(error)(f"dump(): input_data{f' case {index}' if len(cases) > 1 else ''}: {error}") from None
        outputs = None
        if not opts.no_assert:
            traced_inputs = [inputs[name].to(i.meta.dtype, copy=True) for name, i in zip(metas, reference.inputs)]
            outputs = [out.to(o_meta.dtype) for out, o_meta in
                       zip(references(*traced_inputs), (portable.values[o.value].meta for o in portable.outputs))]
        maxerr = opts.maxerr if opts.maxerr is not None else opts.default_maxerr(outputs)
        found.append(TestCase(inputs, outputs, float(maxerr)))
    return found


def _existing(file: Any, name: str) -> list[PortableGraph]:
    if not os.path.exists(file):
        return []
    try:
        graphs = read_graphs(file)
    except LoadError as error:
        raise ValueError(f"dump(): append=True, but {os.fspath(file)!r} is not a readable tracejit file: "
                         f"{error}") from None
    if any(g.name == name for g in graphs):
        raise ValueError(f"dump(): {os.fspath(file)!r} already holds a graph named {name!r}; graphs of one file "
                         f"are told apart by the traced function's name")
    return graphs


def _round_trip_errors(data: bytes, name: str) -> list[float]:
    """Load the bytes just made, compile for this machine, run each test case against its reference."""
    graph = select(read_graphs(data), name)
    loaded = LoadedGraph(graph)
    errors = []
    for case in graph.testcases:
        outputs = loaded(**fresh_inputs(case.inputs))
        outputs = list(outputs.values()) if isinstance(outputs, dict) else list(outputs)
        errors.append(max_error(outputs, case.outputs))
    return errors


def _warn_failing_cases(errors: list[float], cases: list[TestCase]) -> None:
    """A file whose own test case fails `tracejit run --check` is worth a word at dump time."""
    for index, (error, case) in enumerate(zip(errors, cases)):
        if error > case.maxerr:
            warnings.warn(f"dump(): test case {index} of the file fails its own check: loaded here, the graph is off "
                          f"its reference outputs by {error:.3g} > maxerr {case.maxerr:.3g}, so `tracejit run --check` "
                          f"will fail it; pass a larger maxerr if that error is expected", stacklevel=4)


def _info(portable: PortableGraph, size: int, passes: list[str]) -> DumpInfo:
    outputs = [(o.name, portable.values[o.value].meta) for o in portable.outputs]
    return DumpInfo(portable.name, {i.name: i.meta for i in portable.inputs}, outputs, len(portable.ops),
                    portable.op_counts(), len(portable.constants), portable.parameter_numel(), size,
                    len(portable.testcases), passes=passes)

