"""Loaded graphs and their inputs: findings of a bug hunt on dump/load (default dtype, storage
offsets, memory shared across storages, odd input names and layouts, test-case specs, in-place
metadata changes, arg_names, short reads). Expected values come from eager on this machine."""

import contextlib
import io
import json
import re
import zipfile

import numpy as np
import pytest
import torch
from dumping import tracejit_cli

import tracejit
from tracejit.errors import LoadError


def roundtrip(fn, *example, backend="auto", **dump_options):
    """`fn` traced with capture_as_const on `example`, dumped to bytes and loaded; (loaded, bytes)."""
    traced = tracejit.trace(fn, capture_as_const=True)
    traced(*[e.clone() for e in example])
    buf = io.BytesIO()
    traced.dump(buf, **dump_options)
    return tracejit.load(buf.getvalue(), backend=backend), buf.getvalue()


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


@pytest.mark.parametrize("backend", ["c", "aten"])
@pytest.mark.parametrize("caller_default", [torch.float64, torch.float16])
def test_a_call_under_another_default_dtype_runs_as_traced(caller_default, backend):
    g, data = roundtrip(full_exp, torch.randn(4), backend=backend)  # c: the fused kernel reads float32
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
        g = tracejit.load(data, backend="c")
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


# -- 2: storage offsets ------------------------------------------------------------------------


def strided_read(x):
    return x.as_strided((2, 2), (4, 1), x.storage_offset() + 1) * 1


def strided_write(x):
    x.as_strided((2,), (1,), x.storage_offset() + 1).zero_()
    return x * 1


def test_an_input_at_another_storage_offset_reads_inside_itself():
    g, data = roundtrip(strided_read, torch.arange(12.).reshape(3, 4))
    assert "storage_offset" not in graph_document(data)["graphs"][0]["inputs"][0]  # traced at offset 0
    big = torch.arange(100., 120.).reshape(5, 4)
    x = big[2:]
    torch.testing.assert_close(g(x)[0], strided_read(x))
    assert torch.equal(big, torch.arange(100., 120.).reshape(5, 4))


def test_an_input_at_another_storage_offset_writes_inside_itself():
    g, _ = roundtrip(strided_write, torch.arange(12.).reshape(3, 4) + 1)
    big_eager, big_loaded = torch.arange(100., 120.).reshape(5, 4), torch.arange(100., 120.).reshape(5, 4)
    expected = strided_write(big_eager[2:])
    out = g(big_loaded[2:])[0]
    torch.testing.assert_close(out, expected)
    assert torch.equal(big_loaded, big_eager)


def test_a_graph_traced_on_a_view_records_its_storage_offset():
    big = torch.arange(100., 120.).reshape(5, 4)
    traced = tracejit.trace(strided_read, capture_as_const=True)
    traced(big[2:])
    buf = io.BytesIO()
    traced.dump(buf)
    assert graph_document(buf.getvalue())["graphs"][0]["inputs"][0]["storage_offset"] == 8
    g = tracejit.load(buf.getvalue())
    fresh = torch.arange(12.).reshape(3, 4) * 3
    torch.testing.assert_close(g(fresh)[0], strided_read(fresh))  # copied to offset 8: reads fresh[0, 1:3]
    other = torch.arange(200., 220.).reshape(5, 4)[2:]  # at the traced offset: runs in place
    torch.testing.assert_close(g(other)[0], strided_read(other))


def test_a_graph_without_absolute_offsets_stores_none():
    g, data = roundtrip(lambda x: x[1:] * 2, torch.arange(12.).reshape(3, 4))
    assert all("storage_offset" not in i for i in graph_document(data)["graphs"][0]["inputs"])
    x = torch.arange(100., 120.).reshape(5, 4)[2:]
    torch.testing.assert_close(g(x)[0], x[1:] * 2)


# -- 3: inputs sharing memory through different storages -----------------------------------------


def scale_then_add(x, y):
    x.mul_(2)
    return x + y


def test_inputs_sharing_memory_through_two_storages_are_refused():
    g, _ = roundtrip(scale_then_add, torch.randn(4), torch.randn(4))
    a = np.arange(1, 6, dtype=np.float32)
    x, y = torch.from_numpy(a[:4]), torch.from_numpy(a[1:])
    assert x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="input 'x' shares memory with input 'y'"):
        g(x, y)
    assert a.tolist() == [1, 2, 3, 4, 5]  # refused before anything ran


def test_disjoint_views_of_one_array_through_two_storages_run():
    g, _ = roundtrip(scale_then_add, torch.randn(2), torch.randn(2))
    a, b = np.arange(1, 5, dtype=np.float32), np.arange(1, 5, dtype=np.float32)
    out = g(torch.from_numpy(a[:2]), torch.from_numpy(a[2:]))[0]
    expected = scale_then_add(torch.from_numpy(b[:2]), torch.from_numpy(b[2:]))
    torch.testing.assert_close(out, expected)
    assert a.tolist() == b.tolist()


# -- 4: an input named `self` --------------------------------------------------------------------


def scale(self, factor):  # a Tensor-method-style function
    return self * factor


def test_an_input_named_self(tmp_path):
    traced = tracejit.trace(scale, capture_as_const=True)
    traced(torch.randn(3), torch.randn(3))
    info = traced.dump(str(tmp_path / "self.tjit"), input_data="#rand(0,1)")  # runs its own round trip
    assert info.max_errors == [0.0]
    g = tracejit.load(str(tmp_path / "self.tjit"))
    assert g.input_names == ["self", "factor"]
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 3.0, 4.0])
    torch.testing.assert_close(g(self=a, factor=b)[0], scale(a, b))
    torch.testing.assert_close(g(a, factor=b)[0], scale(a, b))
    done = tracejit_cli("run", "self.tjit", "--iters", "1", "--check", "--input", "self=#rand(0,1)",
                        cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "check: 1 of 1 test cases passed" in done.stdout


# -- 5: inputs of another layout -----------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "mkldnn", "nested"])
def test_an_input_of_another_layout_is_refused_naming_it(layout):
    g, _ = roundtrip(lambda x: x * 2 + 1, torch.randn(3, 4))
    dense = torch.randn(3, 4)
    x = {"sparse_coo": dense.to_sparse, "sparse_csr": dense.to_sparse_csr, "mkldnn": dense.to_mkldnn,
         "nested": lambda: torch.nested.nested_tensor([dense[0], dense[1]])}[layout]()
    with pytest.raises(ValueError, match=f"input 'x' must be a dense tensor of layout strided .*got a {layout} tensor"):
        g(x)


# -- 6: integer #rand specs randint rejects ------------------------------------------------------


def ids_plus_bytes(ids, u8):
    return ids * 2 + u8


@pytest.fixture(scope="module")
def integer_file(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ints")
    traced = tracejit.trace(ids_plus_bytes, capture_as_const=True)
    traced(torch.randint(0, 9, (3,)), torch.randint(0, 255, (3,), dtype=torch.uint8))
    traced.dump(str(directory / "ints.tjit"))
    return traced, directory


@pytest.mark.parametrize("spec, message", [
    ("u8=#rand(-5,5)", r"input 'u8': #rand\(-5,5\) reaches outside the values of the uint8 input \(0 to 255\)"),
    ("ids=#rand(0.2,0.7)", r"input 'ids': #rand\(0.2,0.7\) holds no integer for the int64 input"),
    ("u8=#rand(0,300)", r"input 'u8': #rand\(0,300\) reaches outside"),
    ("ids=#rand(0,inf)", r"input 'ids': #rand\(0,inf\) needs finite bounds"),
])
def test_an_integer_rand_spec_randint_rejects_is_one_line(integer_file, spec, message):
    traced, directory = integer_file
    done = tracejit_cli("run", "ints.tjit", "--iters", "1", "--input", spec, cwd=str(directory))
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert re.search(message, done.stderr.strip().splitlines()[-1]), done.stderr
    name, _, rand = spec.partition("=")
    other = "u8" if name == "ids" else "ids"
    with pytest.raises(ValueError, match=r"dump\(\): input_data: " + message):
        traced.dump(io.BytesIO(), input_data=f"{name}:{rand};{other}:#rand(0,9)")


# -- 7: 0-d inputs from 0-d arrays ---------------------------------------------------------------


def times(x, s):
    return x * s


@pytest.mark.parametrize("scalar", [np.array(3.0, dtype=np.float32), np.float32(3.0)])
def test_a_0d_input_from_a_0d_array(tmp_path, scalar):
    traced = tracejit.trace(times, capture_as_const=True)
    traced(torch.randn(3), torch.tensor(2.0))
    path = str(tmp_path / "scale.tjit")
    info = traced.dump(path, input_data={"x": np.ones(3, np.float32), "s": scalar})
    assert info.max_errors == [0.0]
    g = tracejit.load(path)
    case = g.testcases[0]
    assert case.inputs["s"].shape == () and case.inputs["s"].item() == 3.0
    torch.testing.assert_close(g(**case.inputs)[0], times(torch.ones(3), torch.tensor(3.0)))
    np.save(tmp_path / "s0d.npy", np.float32(4.0))
    done = tracejit_cli("run", "scale.tjit", "--iters", "1", "--input", "s=s0d.npy", cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "output 0: cpu float32[3], min 4, max 4, mean 4" in done.stdout


# -- 8: in-place metadata changes of an input ----------------------------------------------------


def transpose_in_place(x):
    return x.t_().mul_(2)


def squeeze_in_place(x):
    return x.squeeze_() + 1


def unsqueeze_in_place(x):
    return x.unsqueeze_(0) * 3


def resize_in_place(x):
    x.resize_(2, 6)
    return x + 1


def as_strided_in_place(x):
    return x.as_strided_((2, 2), (1, 2)) * 1


CHANGES = [(transpose_in_place, (3, 4)), (squeeze_in_place, (1, 4)), (unsqueeze_in_place, (3, 4)),
           (resize_in_place, (3, 4)), (as_strided_in_place, (3, 4))]


@pytest.mark.parametrize("fn, shape", CHANGES, ids=[fn.__name__ for fn, _ in CHANGES])
def test_an_input_changed_in_place_in_the_traced_layout_changes_as_in_eager(fn, shape):
    g, _ = roundtrip(fn, torch.randn(shape))
    x_eager = torch.randn(shape)
    x_loaded = x_eager.clone()
    expected = fn(x_eager)
    out = g(x_loaded)[0]
    torch.testing.assert_close(out, expected)
    assert (x_loaded.shape, x_loaded.stride()) == (x_eager.shape, x_eager.stride())
    torch.testing.assert_close(x_loaded, x_eager)


@pytest.mark.parametrize("fn, shape", CHANGES, ids=[fn.__name__ for fn, _ in CHANGES])
def test_an_input_changed_in_place_in_another_layout_is_refused_before_running(fn, shape):
    g, _ = roundtrip(fn, torch.randn(shape))
    x = torch.randn(tuple(reversed(shape))).t()  # the traced shape, another layout
    before = x.clone()
    with pytest.raises(ValueError, match=r"input 'x' comes with strides .* and the graph changes its shape or "
                                         r"strides in place \(aten\."):
        g(x)
    assert x.shape == before.shape and torch.equal(x, before)


# -- 9: arg_names that would swap inputs ---------------------------------------------------------


def minus_twice(x, *, y):
    return x - 2 * y


def two_positional(a, b):
    return a - 2 * b


@pytest.mark.parametrize("fn, arg_names, message", [
    (minus_twice, ["y", "x"], "positional argument 'x' 'y', the name of a keyword argument"),
    (minus_twice, ["y", "z"], "positional argument 'x' 'y', the name of a keyword argument"),
    (minus_twice, ["z", "x"], "keyword argument 'y' 'x', the name of a positional argument"),
    (two_positional, ["b", "a"], "positional argument 'a' 'b', the name of another positional argument"),
])
def test_arg_names_giving_an_input_another_inputs_name_are_refused(fn, arg_names, message):
    traced = tracejit.trace(fn, capture_as_const=True)
    if fn is minus_twice:
        traced(torch.ones(1), y=torch.ones(1))
    else:
        traced(torch.ones(1), torch.ones(1))
    with pytest.raises(ValueError, match=r"dump\(\): arg_names names the input of " + re.escape(message)
                       + r"; that would swap them"):
        traced.dump(io.BytesIO(), arg_names=arg_names)


def test_arg_names_renaming_inputs_to_new_names_still_work():
    traced = tracejit.trace(minus_twice, capture_as_const=True)
    traced(torch.ones(1), y=torch.ones(1))
    buf = io.BytesIO()
    traced.dump(buf, arg_names=["x", "y2"])
    g = tracejit.load(buf.getvalue())
    a, b = torch.tensor([1.0]), torch.tensor([10.0])
    torch.testing.assert_close(g(x=a, y2=b)[0], minus_twice(a, y=b))


# -- 10: streams with short reads, and a stream at its end ---------------------------------------


class ShortReads(io.RawIOBase):
    """A raw binary stream (a pipe, a socket) that hands out at most `step` bytes per read."""

    def __init__(self, data, step):
        self.data, self.pos, self.step, self.given = data, 0, step, 0

    def readable(self):
        return True

    def readinto(self, b):
        n = min(len(b), self.step, len(self.data) - self.pos)
        b[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n


def plus_one_twice(x):
    return x * 2 + 1


@pytest.mark.parametrize("step", [1, 2, 3, 1000])
def test_a_stream_with_short_reads_loads(step):
    _, data = roundtrip(plus_one_twice, torch.randn(3))
    g = tracejit.load(ShortReads(data, step))
    x = torch.tensor([1.0, -2.0, 0.5])
    torch.testing.assert_close(g(x)[0], plus_one_twice(x))


def test_a_short_read_stream_that_is_no_zip_is_refused_after_its_first_bytes():
    stream = ShortReads(b"\x00" * 1000, 1)
    with pytest.raises(LoadError, match="it is not a zip archive"):
        tracejit.load(stream)
    assert stream.pos == 4


def test_loading_a_stream_at_its_end_says_so(tmp_path):
    traced = tracejit.trace(plus_one_twice, capture_as_const=True)
    traced(torch.randn(3))
    buf = io.BytesIO()
    traced.dump(buf)
    with pytest.raises(LoadError, match=r"read 0 bytes from the file object: it is at its end \(position "
                                        rf"{len(buf.getvalue())}\) .*seek\(0\)"):
        tracejit.load(buf)
    buf.seek(0)
    assert tracejit.load(buf).input_names == ["x"]
    (tmp_path / "empty.tjit").write_bytes(b"")
    with pytest.raises(LoadError, match=r"empty.tjit' is empty \(0 bytes\)"):
        tracejit.load(str(tmp_path / "empty.tjit"))
