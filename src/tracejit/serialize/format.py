"""graph.json: the versioned document describing each graph of a file, and its tensor keys.

`encode` turns portable graphs into the JSON document plus the tensors for
weights.safetensors; `decode` checks a document field by field against the tensors it
references and rebuilds the portable graphs. docs/format.md is the reference for both.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from ..errors import LoadError
from ..ir.graph import Value
from ..record.record import CONJ_BIT, NEG_BIT, TensorMeta
from ..record.source import SourceLocation
from . import schema
from .limits import MAX_GRAPHS, MAX_NUMEL, MAX_OPS, MAX_TESTCASES, MAX_VALUES
from .portable import (
    DEFAULT_DTYPES,
    PortableConstant,
    PortableGraph,
    PortableInput,
    PortableOp,
    PortableOutput,
    TestCase,
)
from .tagged import (
    TaggedValueError,
    decode_number,
    decode_statics,
    dtype_name,
    encode_number,
    encode_statics,
    parse_dtype,
)
from .validate import resolve_op

MAGIC = "tracejit-graph"
VERSION = 1
GRAPH_MEMBER = "graph.json"
WEIGHTS_MEMBER = "weights.safetensors"
_DEVICE = re.compile(r"(cpu|cuda)(:[0-9]{1,2})?\Z")


# -- encoding -----------------------------------------------------------------------------------


def encode(graphs: list[PortableGraph]) -> tuple[bytes, dict[str, torch.Tensor]]:
    """The graph.json bytes and the tensors of weights.safetensors, by key."""
    tensors: dict[str, torch.Tensor] = {}
    document = {"magic": MAGIC, "version": VERSION, "graphs": [_encode_graph(g, tensors) for g in graphs]}
    return json.dumps(document, separators=(",", ":"), allow_nan=False).encode(), tensors


def _meta_form(meta: TensorMeta) -> dict:
    form = {"shape": list(meta.shape), "stride": list(meta.stride), "dtype": dtype_name(meta.dtype),
            "device": str(meta.device)}
    if meta.math_bits:  # only where set: a value no kernel may read through its memory
        form["math_bits"] = meta.math_bits
    return form


def _input_form(item: PortableInput) -> dict:
    form = {"name": item.name, "value": item.value, **_meta_form(item.meta)}
    if item.storage_offset:  # only where the graph takes absolute storage offsets and it is not 0
        form["storage_offset"] = item.storage_offset
    return form


def _encode_graph(graph: PortableGraph, tensors: dict[str, torch.Tensor]) -> dict:
    values = []
    for value in graph.values:
        form = {"handle": value.handle, "version": value.version, "root": value.root, **_meta_form(value.meta)}
        if value.id in graph.value_names:
            form["name"] = graph.value_names[value.id]
        values.append(form)
    constants = []
    for index, constant in enumerate(graph.constants):
        key = f"{graph.name}/param/{constant.name if constant.name else index}"
        tensors[key] = storage_form(constant.tensor, graph.values[constant.value].meta)
        constants.append({"value": constant.value, "tensor": key, "name": constant.name})
    form = {
        "name": graph.name,
        "inputs": [_input_form(i) for i in graph.inputs],
        "outputs": [{"name": o.name, "value": o.value} for o in graph.outputs],
        "values": values,
        "constants": constants,
        "ops": [_encode_op(op) for op in graph.ops],
        "testcases": [_encode_testcase(graph.name, i, case, tensors) for i, case in enumerate(graph.testcases)],
        "user_info": graph.user_info,
        "metadata": graph.metadata,
    }
    if graph.default_dtype != torch.float32:  # only where it is not torch's own default: older files lack it
        form["default_dtype"] = dtype_name(graph.default_dtype)
    return form


def _encode_op(op: PortableOp) -> dict:
    schema_name = op.target._schema.name
    overload = op.target._overloadname
    form = {"op": f"{schema_name}.{overload}", "inputs": list(op.inputs), "outputs": list(op.outputs),
            "writes": list(op.writes), "args": encode_statics(op.statics),
            "scalars": [encode_number(s) for s in op.scalars], "returns": op.out_kind}
    if op.source is not None:
        form["source"] = {"file": op.source.filename, "line": op.source.line, "function": op.source.function}
    return form


def _encode_testcase(graph: str, index: int, case: TestCase, tensors: dict[str, torch.Tensor]) -> dict:
    inputs = {}
    for name, tensor in case.inputs.items():
        inputs[name] = key = f"{graph}/test/{index}/input/{name}"
        tensors[key] = tensor.detach().contiguous().clone()
    outputs = None
    if case.outputs is not None:
        outputs = []
        for position, tensor in enumerate(case.outputs):
            outputs.append(key := f"{graph}/test/{index}/output/{position}")
            tensors[key] = tensor.detach().contiguous().clone()
    return {"inputs": inputs, "outputs": outputs, "maxerr": case.maxerr}


def storage_form(tensor: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """What weights.safetensors holds for a constant: the tensor itself when its strides are the
    contiguous ones, else the 1-d span of storage its strides reach (views and expanded tensors
    keep their layout)."""
    tensor = tensor.detach()
    if meta.stride == contiguous_strides(meta.shape):
        return tensor.contiguous().clone()
    if tuple(tensor.stride()) != meta.stride:
        raise ValueError(f"dump(): a constant has strides {list(tensor.stride())}, its graph value {list(meta.stride)}")
    span = schema.extent(meta.shape, meta.stride)
    return tensor.as_strided((span,), (1,), tensor.storage_offset()).clone()


# -- decoding -----------------------------------------------------------------------------------


def parse_document(raw: bytes) -> dict:
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise LoadError(f"{GRAPH_MEMBER} is not valid JSON: {str(error)[:200]}") from None
    if not isinstance(document, dict) or document.get("magic") != MAGIC:
        raise LoadError(f"{GRAPH_MEMBER} is not a tracejit graph document (its magic is not {MAGIC!r})")
    version = document.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise LoadError(f"{GRAPH_MEMBER}: unknown format version {schema.describe(version)}")
    if version > VERSION:
        raise LoadError(f"{GRAPH_MEMBER}: format version {version} is newer than this tracejit reads "
                        f"(version {VERSION}); upgrade tracejit")
    return schema.mapping(document, GRAPH_MEMBER, {"magic", "version", "graphs"})


def decode(raw: bytes, tensors: dict[str, torch.Tensor]) -> list[PortableGraph]:
    """The graphs of a graph.json document, checked against the tensors of weights.safetensors."""
    document = parse_document(raw)
    used: set[str] = set()
    graphs = []
    for index, form in enumerate(schema.array(document["graphs"], "graphs", MAX_GRAPHS)):
        try:
            graphs.append(_GraphReader(form, tensors, used).read())
        except TaggedValueError as error:
            raise LoadError(f"graphs[{index}]: {error}") from None
    names = [g.name for g in graphs]
    if not graphs or len(set(names)) != len(names):
        raise LoadError(f"{GRAPH_MEMBER}: expected one or more graphs with distinct names, got {names}")
    unused = sorted(set(tensors) - used)
    if unused:
        raise LoadError(f"{WEIGHTS_MEMBER} holds tensor {unused[0]!r}, which {GRAPH_MEMBER} does not reference")
    return graphs


class _GraphReader:
    _FIELDS = frozenset({"name", "inputs", "outputs", "values", "constants", "ops", "testcases", "user_info", "metadata"})
    _OPTIONAL = frozenset({"default_dtype"})

    def __init__(self, form: Any, tensors: dict[str, torch.Tensor], used: set[str]):
        self.form = schema.mapping(form, "graph", self._FIELDS, self._OPTIONAL)
        self.where = f"graph {schema.describe(form.get('name'))}"
        self.tensors = tensors
        self.used = used
        self.values: list[Value] = []

    def read(self) -> PortableGraph:
        form = self.form
        name = schema.name(form["name"], f"{self.where}.name")
        names: dict[int, str] = {}
        self.values = [self._value(i, v, names) for i, v in enumerate(schema.array(form["values"], "values", MAX_VALUES))]
        inputs = [self._input(i, f) for i, f in enumerate(schema.array(form["inputs"], "inputs", MAX_VALUES))]
        outputs = [self._output(i, f) for i, f in enumerate(schema.array(form["outputs"], "outputs", MAX_VALUES))]
        if len({i.name for i in inputs}) != len(inputs) or len({i.value for i in inputs if i.value is not None}) != len(
                [i for i in inputs if i.value is not None]):
            raise LoadError(f"{self.where}: input names and input values must be distinct")
        constants = [self._constant(i, f) for i, f in enumerate(schema.array(form["constants"], "constants", MAX_VALUES))]
        ops = [self._op(i, f) for i, f in enumerate(schema.array(form["ops"], "ops", MAX_OPS))]
        graph = PortableGraph(name, self.values, inputs, outputs, constants, ops, names,
                              user_info=form["user_info"], metadata=self._metadata(form["metadata"]),
                              default_dtype=self._default_dtype(form.get("default_dtype", "float32")))
        graph.testcases = [self._testcase(i, f, graph)
                           for i, f in enumerate(schema.array(form["testcases"], "testcases", MAX_TESTCASES))]
        return graph

    def _meta(self, form: dict, where: str) -> TensorMeta:
        shape = schema.shape(form["shape"], f"{where}.shape")
        stride = schema.strides(form["stride"], f"{where}.stride", shape)
        device = form["device"]
        if not isinstance(device, str) or not _DEVICE.match(device):
            raise LoadError(f"{where}.device: expected 'cpu', 'cuda' or 'cuda:N', got {schema.describe(device)}")
        try:
            dtype = parse_dtype(form["dtype"])
        except TaggedValueError as error:
            raise LoadError(f"{where}.dtype: {error}") from None
        bits = schema.integer(form.get("math_bits", 0), f"{where}.math_bits", 0, NEG_BIT | CONJ_BIT)
        return TensorMeta(shape, stride, dtype, torch.device(device), bits)

    def _value(self, index: int, form: Any, names: dict[int, str]) -> Value:
        where = f"{self.where}.values[{index}]"
        schema.mapping(form, where, {"handle", "version", "root", "shape", "stride", "dtype", "device"},
                       {"name", "math_bits"})
        handle = schema.integer(form["handle"], f"{where}.handle", 0, MAX_VALUES)
        version = schema.integer(form["version"], f"{where}.version", 0, MAX_VALUES)
        root = schema.integer(form["root"], f"{where}.root", 0, MAX_VALUES)
        if "name" in form:
            names[index] = schema.name(form["name"], f"{where}.name")
        return Value(index, handle, version, self._meta(form, where), root)

    def _value_id(self, value: Any, where: str) -> int:
        return schema.integer(value, where, 0, len(self.values) - 1)

    def _input(self, index: int, form: Any) -> PortableInput:
        where = f"{self.where}.inputs[{index}]"
        schema.mapping(form, where, {"name", "value", "shape", "stride", "dtype", "device"},
                       {"math_bits", "storage_offset"})
        value = None if form["value"] is None else self._value_id(form["value"], f"{where}.value")
        meta = self._meta(form, where)
        if value is not None and self.values[value].meta != meta:
            raise LoadError(f"{where}: its metadata differs from the metadata of value {value}")
        offset = schema.integer(form.get("storage_offset", 0), f"{where}.storage_offset", 0, MAX_NUMEL)
        if offset + schema.extent(meta.shape, meta.stride) > MAX_NUMEL:
            raise LoadError(f"{where}.storage_offset: {offset} plus the input's span is more than {MAX_NUMEL} elements")
        return PortableInput(schema.name(form["name"], f"{where}.name"), meta, value, offset)

    def _output(self, index: int, form: Any) -> PortableOutput:
        where = f"{self.where}.outputs[{index}]"
        schema.mapping(form, where, {"name", "value"})
        return PortableOutput(schema.optional_name(form["name"], f"{where}.name"), self._value_id(form["value"], where))

    def _tensor(self, key: Any, where: str, meta: TensorMeta, stored_shape: tuple[int, ...]) -> torch.Tensor:
        key = schema.name(key, where)
        if key not in self.tensors:
            raise LoadError(f"{where}: tensor {key!r} is not in {WEIGHTS_MEMBER}")
        if key in self.used:
            raise LoadError(f"{where}: tensor {key!r} is referenced twice")
        self.used.add(key)
        tensor = self.tensors[key]
        if tensor.dtype != meta.dtype or tuple(tensor.shape) != stored_shape:
            raise LoadError(f"{where}: tensor {key!r} is {tensor.dtype} {list(tensor.shape)} in {WEIGHTS_MEMBER}, "
                            f"{GRAPH_MEMBER} declares {meta.dtype} {list(stored_shape)}")
        return tensor

    def _constant(self, index: int, form: Any) -> PortableConstant:
        where = f"{self.where}.constants[{index}]"
        schema.mapping(form, where, {"value", "tensor", "name"})
        value = self._value_id(form["value"], f"{where}.value")
        meta = self.values[value].meta
        contiguous = meta.stride == contiguous_strides(meta.shape)
        stored = meta.shape if contiguous else (schema.extent(meta.shape, meta.stride),)
        tensor = self._tensor(form["tensor"], f"{where}.tensor", meta, stored)
        if not contiguous:
            tensor = tensor.as_strided(meta.shape, meta.stride)
        return PortableConstant(value, tensor, schema.optional_name(form["name"], f"{where}.name"))

    def _op(self, index: int, form: Any) -> PortableOp:
        where = f"{self.where}.ops[{index}]"
        schema.mapping(form, where, {"op", "inputs", "outputs", "writes", "args", "scalars", "returns"}, {"source"})
        target = resolve_op(form["op"])
        ids = {key: schema.array(form[key], f"{where}.{key}", MAX_VALUES) for key in ("inputs", "outputs", "writes")}
        inputs = tuple(self._value_id(v, f"{where}.inputs") for v in ids["inputs"])
        outputs = tuple(None if v is None else self._value_id(v, f"{where}.outputs") for v in ids["outputs"])
        writes = tuple(self._value_id(v, f"{where}.writes") for v in ids["writes"])
        statics = decode_statics(form["args"])
        scalars = tuple(decode_number(s) for s in schema.array(form["scalars"], f"{where}.scalars", MAX_VALUES))
        if not isinstance(form["returns"], str):
            raise LoadError(f"{where}.returns: expected a string, got {schema.describe(form['returns'])}")
        return PortableOp(target, inputs, outputs, writes, statics, scalars, form["returns"],
                          self._source(form.get("source"), f"{where}.source"))

    def _source(self, form: Any, where: str) -> SourceLocation | None:
        if form is None:
            return None
        schema.mapping(form, where, {"file", "line", "function"})
        return SourceLocation(schema.name(form["file"], f"{where}.file"),
                              schema.integer(form["line"], f"{where}.line", 0, 1 << 30),
                              schema.name(form["function"], f"{where}.function"))

    def _testcase(self, index: int, form: Any, graph: PortableGraph) -> TestCase:
        where = f"{self.where}.testcases[{index}]"
        schema.mapping(form, where, {"inputs", "outputs", "maxerr"})
        if not isinstance(form["inputs"], dict) or set(form["inputs"]) != {i.name for i in graph.inputs}:
            raise LoadError(f"{where}.inputs: expected one tensor for each input "
                            f"({', '.join(i.name for i in graph.inputs)})")
        inputs = {i.name: self._tensor(form["inputs"][i.name], f"{where}.inputs.{i.name}", i.meta, i.meta.shape)
                  for i in graph.inputs}
        outputs = None
        if form["outputs"] is not None:
            keys = schema.array(form["outputs"], f"{where}.outputs", len(graph.outputs))
            if len(keys) != len(graph.outputs):
                raise LoadError(f"{where}.outputs: expected {len(graph.outputs)} reference outputs, got {len(keys)}")
            outputs = []
            for position, (key, output) in enumerate(zip(keys, graph.outputs)):
                meta = self.values[output.value].meta
                outputs.append(self._tensor(key, f"{where}.outputs[{position}]", meta, meta.shape))
        maxerr = form["maxerr"]
        if not isinstance(maxerr, (int, float)) or isinstance(maxerr, bool) or not 0 <= maxerr < float("inf"):
            raise LoadError(f"{where}.maxerr: expected a number >= 0, got {schema.describe(maxerr)}")
        return TestCase(inputs, outputs, float(maxerr))

    def _default_dtype(self, form: Any) -> torch.dtype:
        try:
            dtype = parse_dtype(form)
        except TaggedValueError as error:
            raise LoadError(f"{self.where}.default_dtype: {error}") from None
        if dtype not in DEFAULT_DTYPES:
            raise LoadError(f"{self.where}.default_dtype: {dtype_name(dtype)} cannot be torch's default dtype "
                            f"(one of {', '.join(dtype_name(d) for d in DEFAULT_DTYPES)})")
        return dtype

    def _metadata(self, form: Any) -> dict | None:
        if form is not None and not isinstance(form, dict):
            raise LoadError(f"{self.where}.metadata: expected an object or null")
        return form


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))
