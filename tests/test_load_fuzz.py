"""tracejit.load on damaged and hostile files: every failure is a LoadError with a specific
message; nothing crashes, hangs, allocates what a file merely declares, or executes file content."""

import copy
import io
import json
import math
import zipfile

import pytest
import safetensors.torch
import torch
import torch.nn as nn
from dumping import traced_inference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracejit
from tracejit.serialize.container import pack

CANARY = "tracejit_fuzz_canary"  # text that would run code if a loader ever evaluated it
HOSTILE_TEXT = f"__import__('builtins').setattr(__import__('builtins'), {CANARY!r}, 1)"


@pytest.fixture(scope="module")
def valid():
    """(file bytes, graph.json document, tensors) of a small dumped model with a test case."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    buffer = io.BytesIO()
    traced_inference(model, torch.randn(2, 4)).dump(buffer, input_data="#rand(-1,1)", keep_param_name=True)
    data = buffer.getvalue()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        document = json.loads(archive.read("graph.json"))
        tensors = safetensors.torch.load(archive.read("weights.safetensors"))
    return data, document, tensors


def repack(document, tensors) -> bytes:
    return pack(json.dumps(document).encode(), tensors)


def load_or_refuse(data: bytes):
    """Load and, when the file is accepted, run it once on valid inputs. Only LoadError may come
    out of load; a graph that loads runs or raises an ordinary exception."""
    try:
        graph = tracejit.load(data)
    except tracejit.LoadError as error:
        assert str(error)
        return None
    if any(math.prod(meta.shape) > 1 << 20 for meta in graph.inputs.values()):
        return graph  # accepted with an input too large to make here (an unused input may be any size)
    inputs = {name: torch.zeros(meta.shape, dtype=meta.dtype) for name, meta in graph.inputs.items()}
    try:
        graph(**inputs)
    except (RuntimeError, ValueError, TypeError, IndexError):
        pass
    return graph


def assert_no_code_ran():
    import builtins

    assert not hasattr(builtins, CANARY)


def test_the_valid_file_loads(valid):
    data, _, _ = valid
    graph = tracejit.load(data)
    case = graph.testcases[0]
    assert torch.allclose(graph(**case.inputs)[0], case.outputs[0])


FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(cut=st.integers(min_value=0, max_value=10**6))
def test_truncated_files_are_refused(valid, cut):
    data, _, _ = valid
    with pytest.raises(tracejit.LoadError):
        tracejit.load(data[:cut % len(data)])


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 7)), min_size=1, max_size=8))
def test_bit_flips_never_crash(valid, flips):
    data = bytearray(valid[0])
    for position, bit in flips:
        data[position % len(data)] ^= 1 << bit
    load_or_refuse(bytes(data))


json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70), st.floats(allow_nan=False),
    st.text(max_size=20), st.just(HOSTILE_TEXT), st.just("aten::from_file.default"), st.just("aten::nosuch.default"),
    st.just({"$": "tensor"}), st.just({"$": "kwarg", "name": HOSTILE_TEXT, "value": 1}),
    st.just({"$": "dtype", "name": "object"}), st.just([2**40, 2**40]), st.just([-1]),
)
json_values = st.recursive(json_leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                           max_leaves=6)


@FUZZ
@given(data=st.data())
def test_mutated_documents_are_refused_or_run(valid, data):
    _, document, tensors = valid
    document = copy.deepcopy(document)
    node, parent, key = document, None, None
    for _ in range(data.draw(st.integers(1, 8))):  # walk down to a random field
        children = list(node.keys()) if isinstance(node, dict) else list(range(len(node)))
        if not children:
            break
        parent, key = node, data.draw(st.sampled_from(children))
        if not isinstance(node[key], (dict, list)) or data.draw(st.booleans()):
            break
        node = node[key]
    if parent is not None:
        if isinstance(parent, dict) and data.draw(st.booleans()):
            del parent[key]
        else:
            parent[key] = data.draw(json_values)
    load_or_refuse(repack(document, tensors))
    assert_no_code_ran()


@FUZZ
@given(data=st.data())
def test_mutated_tensors_are_refused(valid, data):
    _, document, tensors = valid
    tensors = dict(tensors)
    key = data.draw(st.sampled_from(sorted(tensors)))
    change = data.draw(st.sampled_from(["drop", "dtype", "shape", "extra"]))
    if change == "drop":
        del tensors[key]
    elif change == "dtype":
        tensors[key] = tensors[key].double()
    elif change == "shape":
        tensors[key] = torch.zeros(tensors[key].numel() + 1)
    else:
        tensors["unreferenced"] = torch.zeros(1)
    with pytest.raises(tracejit.LoadError):
        tracejit.load(repack(document, tensors))


def _op(document, name):
    return next(op for op in document["graphs"][0]["ops"] if op["op"] == name)


def _relu_result(document):
    return document["graphs"][0]["values"][_op(document, "aten::relu.default")["outputs"][0]]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=2), "format version 2 is newer than this tracejit reads"),
    (lambda d: d.update(magic="other"), "not a tracejit graph document"),
    (lambda d: _op(d, "aten::relu.default").update(op="aten::nosuch.default"), "does not exist in torch"),
    (lambda d: _op(d, "aten::relu.default").update(op="aten::from_file.default"), "is not allowed in a loaded graph"),
    (lambda d: _op(d, "aten::relu.default").update(op="os::system.default"), "is not an aten op"),
    (lambda d: _op(d, "aten::relu.default").update(op="aten::__class__.default"), "not of the form"),
    (lambda d: _op(d, "aten::relu.default")["args"].append({"$": "kwarg", "name": HOSTILE_TEXT, "value": 1}),
     "the op has no argument named"),
    (lambda d: d["graphs"][0]["values"][0].update(shape=[2**20, 2**20]), r"has 1099511627776 elements, more than the limit"),
    (lambda d: d["graphs"][0]["values"][0].update(shape=[-2, 4]), r"shape\[0\]: expected an int"),
    (lambda d: _relu_result(d).update(shape=[2, 5], stride=[5, 1]), r"the graph declares cpu float32\[2, 5\]"),
    (lambda d: _relu_result(d).update(dtype="float64"), "result 0 is cpu torch.float32"),
    (lambda d: d["graphs"][0]["values"][-1].update(device="cuda:7"), "which this machine does not have"),
    (lambda d: d["graphs"][0]["ops"][0].update(inputs=[99]), r"inputs: expected an int from 0 to"),
    (lambda d: d["graphs"][0]["ops"].reverse(), "before it is defined"),
    (lambda d: d["graphs"][0]["constants"][0].update(tensor="missing"), "tensor 'missing' is not in"),
    (lambda d: d["graphs"][0]["values"][1].update(shape=[3, 5], stride=[5, 1]),
     r"in weights.safetensors, graph.json declares torch.float32 \[3, 5\]"),
])
def test_specific_load_errors(valid, mutate, message):
    _, document, tensors = valid
    document = copy.deepcopy(document)
    mutate(document)
    with pytest.raises(tracejit.LoadError, match=message):
        tracejit.load(repack(document, tensors))
    assert_no_code_ran()


def _zip(members: dict[str, bytes], compression=zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, payload in members.items():
            archive.writestr(name, payload)
    return buffer.getvalue()


def test_container_errors(valid):
    data = valid[0]
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    cases = {
        b"not a zip at all": "it is not a zip archive",
        _zip({**members, "data.pkl": b"\x80\x04."}): "must hold exactly graph.json and weights.safetensors",
        _zip({"graph.json": members["graph.json"]}): "must hold exactly",
        _zip({**members, "graph.json": b"{not json"}): "graph.json is not valid JSON",
        _zip({**members, "weights.safetensors": b"\x00" * 16}): "weights.safetensors is not a valid safetensors file",
        # a zip bomb: 64 MiB of zeros deflate to a few KiB
        _zip({**members, "weights.safetensors": bytes(64 << 20)}): "refused as a possible zip bomb",
    }
    for payload, message in cases.items():
        with pytest.raises(tracejit.LoadError, match=message):
            tracejit.load(payload)


def _patch_sizes(data: bytes, member: bytes, size: int) -> bytes:
    """Rewrite the uncompressed size a member declares, in its local header and the central directory."""
    patched = bytearray(data)
    for signature, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        start = 0
        while (start := patched.find(signature, start)) >= 0:
            name_at = start + (30 if signature == b"PK\x03\x04" else 46)
            if patched[name_at:name_at + len(member)] == member:
                patched[start + offset:start + offset + 4] = size.to_bytes(4, "little")
            start += 4
    return bytes(patched)


@pytest.mark.parametrize("size, message", [
    (10, "declares 10 bytes but holds more|Bad CRC"),
    (2**32 - 1, "holds \\d+|Bad CRC|damaged archive|more than the limit"),
])
def test_declared_sizes_must_match(valid, size, message):
    data, _, _ = valid
    with pytest.raises(tracejit.LoadError, match=message):
        tracejit.load(_patch_sizes(data, b"graph.json", size))
