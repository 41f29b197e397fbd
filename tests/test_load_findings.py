"""Loaded graphs and their inputs: findings of a bug hunt on dump/load (default dtype, storage
offsets, memory shared across storages, odd input names and layouts, test-case specs, in-place
metadata changes, arg_names, short reads). Expected values come from eager on this machine."""

import contextlib
import io
import json
import zipfile

import pytest
import torch

import tracejit
from tracejit.errors import LoadError


def roundtrip(fn, *example, **dump_options):
    """`fn` traced with capture_as_const on `example`, dumped to bytes and loaded; (loaded, bytes)."""
    traced = tracejit.trace(fn, capture_as_const=True)
    traced(*[e.clone() for e in example])
    buf = io.BytesIO()
    traced.dump(buf, **dump_options)
    return tracejit.load(buf.getvalue()), buf.getvalue()


def graph_document(data: bytes) -> dict:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return json.loads(archive.read("graph.json"))


@contextlib.contextmanager
def default_dtype(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# -- 1: the default dtype the graph was traced under ---------------------------------------------


def full_exp(x):
    return (x + torch.full((4,), 0.5)).exp()


@pytest.mark.parametrize("caller_default", [torch.float64, torch.float16])
def test_a_call_under_another_default_dtype_runs_as_traced(caller_default):
    g, data = roundtrip(full_exp, torch.randn(4))
    assert "default_dtype" not in graph_document(data)["graphs"][0]  # a float32 file reads as before
    x = torch.tensor([0.0, 1.0, -1.0, 2.0])
    expected = full_exp(x)  # eager under the float32 default the graph was traced with
    with default_dtype(caller_default):
        out = g(x)[0]
        assert torch.get_default_dtype() == caller_default  # restored after the call
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)


def test_loading_under_another_default_dtype():
    _, data = roundtrip(full_exp, torch.randn(4))
    x = torch.tensor([0.0, 1.0, -1.0, 2.0])
    with default_dtype(torch.float64):
        g = tracejit.load(data)
        assert torch.get_default_dtype() == torch.float64
    torch.testing.assert_close(g(x)[0], full_exp(x))


def test_a_file_traced_under_float64_default_records_it():
    with default_dtype(torch.float64):
        traced = tracejit.trace(full_exp, capture_as_const=True)
        traced(torch.randn(4))
        x = torch.tensor([0.0, 1.0, -1.0, 2.0])
        expected = full_exp(x)
    buf = io.BytesIO()
    traced.dump(buf, input_data="#rand(-1,1)")  # dumped (and its test case checked) under float32
    data = buf.getvalue()
    assert graph_document(data)["graphs"][0]["default_dtype"] == "float64"
    g = tracejit.load(data)
    assert g.metadata["default_dtype"] == "float64"
    out = g(x)[0]
    assert out.dtype == torch.float64 and expected.dtype == torch.float64
    torch.testing.assert_close(out, expected)
    assert torch.get_default_dtype() == torch.float32


def test_a_default_dtype_torch_refuses_is_a_load_error():
    _, data = roundtrip(full_exp, torch.randn(4))
    document = graph_document(data)
    document["graphs"][0]["default_dtype"] = "int64"
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        weights = archive.read("weights.safetensors")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("graph.json", json.dumps(document), compress_type=zipfile.ZIP_DEFLATED)
        archive.writestr("weights.safetensors", weights)
    with pytest.raises(LoadError, match="default_dtype: int64 cannot be torch's default dtype"):
        tracejit.load(out.getvalue())
