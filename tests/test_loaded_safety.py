"""Loaded graphs hand out fresh outputs, respect the aliasing of their inputs, and refuse files
whose handles, roots and inputs do not describe one consistent set of tensors."""


import io
import json
import zipfile

import pytest
import safetensors.torch
import torch
import torch.nn as nn
from dumping import tracejit_cli

import tracejit
from tracejit.serialize.container import pack


def _round_trip(traced, tmp_path, backend="auto", name="g.tjit", **options):
    path = tmp_path / name
    traced.dump(path, **options)
    return tracejit.load(path, backend=backend)


# -- outputs sharing memory with constants -----------------------------------------------------------


@pytest.mark.parametrize("backend", ["aten", "c"])
def test_returned_view_of_a_literal_is_fresh_on_every_call(tmp_path, backend):
    @tracejit.trace(capture_as_const=True)
    def f(x):
        return x + 1, torch.tensor([[1., 2.], [3., 4.]]).t()

    f(torch.randn(3))
    g = _round_trip(f, tmp_path, backend)
    first = g(torch.randn(3))[1]
    first.zero_()  # the caller owns its result
    expected = torch.tensor([[1., 2.], [3., 4.]]).t()
    assert torch.equal(g(torch.randn(3))[1], expected)
    assert torch.equal(g(torch.randn(3))[1], expected)


def test_returned_views_of_weights_do_not_expose_the_loaded_weights(tmp_path):
    lin = nn.Linear(3, 4).eval()
    W = torch.randn(5, 3)

    @tracejit.trace(capture_as_const=True)
    def f(x):
        with torch.no_grad():
            return lin(x), lin.weight.t(), lin.bias[:2], W[:2]

    x = torch.randn(2, 3)
    f(x)
    g = _round_trip(f, tmp_path)
    for out in g(x):
        out.fill_(7.0)  # writing every result must change nothing the graph keeps
    y, wt, b, w2 = g(x)
    with torch.no_grad():
        assert torch.allclose(y, lin(x))
    assert torch.equal(wt, lin.weight.detach().t())
    assert torch.equal(b, lin.bias.detach()[:2])
    assert torch.equal(w2, W[:2])
    assert all(not torch.equal(p, torch.full_like(p, 7.0)) for p in g.parameters().values())


def test_a_returned_captured_tensor_is_an_output_of_its_own(tmp_path):
    W = torch.randn(3)
    bn = nn.BatchNorm1d(3).eval()
    bn.running_mean.copy_(torch.randn(3))

    @tracejit.trace(capture_as_const=True)
    def f(x):
        return x + 1, W, bn.running_mean

    f(torch.randn(3))
    g = _round_trip(f, tmp_path)
    x = torch.randn(3)
    y, w, mean = g(x)
    assert torch.equal(y, x + 1) and torch.equal(w, W) and torch.equal(mean, bn.running_mean)
    w.zero_()
    assert torch.equal(g(x)[1], W)


# -- inputs that share memory ------------------------------------------------------------------------


def _doubles_x(x, y):
    x.mul_(2)
    return x + y


@pytest.mark.parametrize("backend", ["aten", "c"])
def test_a_graph_writing_an_input_refuses_inputs_sharing_its_memory(tmp_path, backend):
    f = tracejit.trace(capture_as_const=True)(_doubles_x)
    f(torch.randn(8), torch.randn(8))
    g = _round_trip(f, tmp_path, backend)
    a = torch.ones(8)
    with pytest.raises(ValueError, match="input 'x' shares memory with input 'y'"):
        g(a, a)
    t = torch.ones(16)
    with pytest.raises(ValueError, match="input 'x' shares memory with input 'y'"):
        g(t[:8], t[4:12])
    x, y = torch.ones(16), torch.ones(16)
    expected = _doubles_x(x[:8].clone(), y[8:].clone())
    assert torch.equal(g(x[:8], x[8:])[0], expected)  # disjoint parts of one storage are separate inputs
    assert torch.equal(x[:8], torch.full((8,), 2.0))


def test_a_graph_only_reading_its_inputs_takes_one_tensor_twice(tmp_path):
    f = tracejit.trace(capture_as_const=True)(lambda x, y: x * y + y)
    f(torch.randn(4), torch.randn(4))
    g = _round_trip(f, tmp_path)
    a = torch.randn(4)
    assert torch.allclose(g(a, a)[0], a * a + a)


@pytest.mark.parametrize("make, how", [(lambda t: (t, t), "were the same tensor"),
                                       (lambda t: (t[:6], t[2:]), "overlapped in memory")])
def test_dump_refuses_a_trace_of_overlapping_inputs(tmp_path, make, how):
    f = tracejit.trace(capture_as_const=True)(lambda x, y: x * 2 + y)
    f(*make(torch.randn(8)))
    with pytest.raises(ValueError, match=f"inputs 'x' and 'y' of the recorded call .* {how}"):
        f.dump(tmp_path / "g.tjit")


def test_dump_takes_disjoint_parts_of_one_tensor_as_inputs(tmp_path):
    f = tracejit.trace(capture_as_const=True)(_doubles_x)
    t = torch.randn(8)
    f(t[:4], t[4:])
    g = _round_trip(f, tmp_path)
    x, y = torch.randn(4), torch.randn(4)
    assert torch.equal(g(x.clone(), y)[0], _doubles_x(x.clone(), y))


# -- files whose handles do not describe one set of tensors ------------------------------------------


def _document(traced, tmp_path):
    path = tmp_path / "ok.tjit"
    traced.dump(path)
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read("graph.json")), safetensors.torch.load(archive.read("weights.safetensors"))


def _writes_then_reads(x, y):
    x.mul_(2).add_(1)
    return x.sin() + y.sum(), x.t()


def _crafted(tmp_path, mutate):
    f = tracejit.trace(capture_as_const=True)(_writes_then_reads)
    f(torch.randn(64, 32), torch.randn(4))
    document, tensors = _document(f, tmp_path)
    graph = document["graphs"][0]
    mutate(graph, {i["name"]: graph["values"][i["value"]]["handle"] for i in graph["inputs"]})
    return pack(json.dumps(document).encode(), tensors)


def _input_x_in_y_slot(graph, handles):
    for value in graph["values"]:  # x's values (and the root of its views) in y's slot
        if value["handle"] == handles["x"]:
            value["handle"] = handles["y"]
        if value["root"] == handles["x"]:
            value["root"] = handles["y"]


def _view_declared_own_storage(graph, handles):
    view = next(v for v in graph["values"] if v["root"] != v["handle"])
    view["root"] = view["handle"]


def _view_strides(graph, handles):
    view = next(v for v in graph["values"] if v["root"] != v["handle"])
    view["stride"] = [1000, 1]


def _write_into_y(graph, handles):
    op = next(op for op in graph["ops"] if op["op"] == "aten::mul_.Tensor")
    written = graph["values"][op["writes"][0]]
    written["handle"] = written["root"] = handles["y"]


def _input_is_a_view(graph, handles):
    value = next(v for v in graph["values"] if v["handle"] == handles["y"])
    value["root"] = handles["x"]


@pytest.mark.parametrize("mutate, message", [
    (_input_x_in_y_slot, r"inputs\[1\] 'y': value \d+ .* makes handle \d+ again; value \d+ \(inputs\[0\] 'x'\) made it"),
    (_view_declared_own_storage, r"is declared a tensor of its own, but the op returns a view of its input"),
    (_view_strides, r"aten.t.default: result 0 has strides \[1, 32\], the graph declares \[1000, 1\]"),
    (_write_into_y, r"aten.mul_.Tensor: writes value \d+ .* in storage t\d+, which it does not read"),
    (_input_is_a_view, r"inputs\[1\] 'y': value \d+ .* must be a tensor of its own \(root = handle, version 0\)"),
])
def test_inconsistent_handles_are_refused(tmp_path, mutate, message):
    with pytest.raises(tracejit.LoadError, match=message):
        tracejit.load(_crafted(tmp_path, mutate))


def test_the_unmutated_crafting_base_loads_and_runs(tmp_path):
    g = tracejit.load(_crafted(tmp_path, lambda graph, handles: None))
    x, y = torch.randn(64, 32), torch.randn(4)
    expected = _writes_then_reads(x.clone(), y)
    assert all(torch.allclose(a, b) for a, b in zip(g(x.clone(), y), expected))


# -- inputs traced with an expanded layout -----------------------------------------------------------


def _broadcast_rows(x):
    return x * 2 + 1, x.sum(0)


def test_an_input_traced_expanded_takes_values_that_repeat_as_it_did(tmp_path):
    f = tracejit.trace(capture_as_const=True)(_broadcast_rows)
    f(torch.randn(3).expand(4, 3))
    g = _round_trip(f, tmp_path, input_data="#rand(0,1)")
    case = g.testcases[0].inputs["x"]
    assert torch.equal(case, case[:1].expand(4, 3))  # #rand fills the traced layout's memory
    row = torch.randn(3)
    for x in (row.expand(4, 3), row.expand(4, 3).clone(), row.expand(4, 3).t().contiguous().t()):
        assert all(torch.allclose(a, b) for a, b in zip(g(x), _broadcast_rows(x)))
    with pytest.raises(ValueError, match=r"input 'x' was traced with a layout in which elements share memory "
                                         r"\(stride 0 along dim 0\), strides \[0, 1\]"):
        g(torch.randn(4, 3))


def test_tracejit_run_checks_a_file_with_an_expanded_input(tmp_path):
    f = tracejit.trace(capture_as_const=True)(_broadcast_rows)
    f(torch.randn(3).expand(4, 3))
    f.dump(tmp_path / "e.tjit", input_data="#rand(0,1)")
    done = tracejit_cli("run", "e.tjit", "--check", cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "1 of 1 test cases passed" in done.stdout
    f.dump(tmp_path / "plain.tjit")  # no test case: run makes #rand(0,1) inputs
    done = tracejit_cli("run", "plain.tjit", cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr


# -- complex test cases ------------------------------------------------------------------------------


def test_max_error_counts_the_imaginary_part():
    from tracejit.serialize.testcases import max_error

    assert max_error([torch.tensor([1 + 1j])], [torch.tensor([1 + 5j])]) == 4.0
    assert max_error([torch.tensor([1 + 1j]).conj()], [torch.tensor([1 - 1j])]) == 0.0


def _square_plus(z):
    return z * z + z


def test_random_complex_inputs_have_random_imaginary_parts_and_check_catches_them(tmp_path):
    f = tracejit.trace(capture_as_const=True)(_square_plus)
    f(torch.randn(64, dtype=torch.complex64))
    f.dump(tmp_path / "c.tjit", input_data="#rand(0,1)")
    z = tracejit.load(tmp_path / "c.tjit").testcases[0].inputs["z"]
    assert z.imag.min() >= 0 and z.imag.max() < 1 and z.imag.std() > 0.1
    with zipfile.ZipFile(tmp_path / "c.tjit") as archive:
        document = archive.read("graph.json")
        tensors = safetensors.torch.load(archive.read("weights.safetensors"))
    key = next(k for k in tensors if "/output/" in k)
    tensors[key] = tensors[key] + 100j  # a reference wrong in its imaginary part only
    (tmp_path / "bad.tjit").write_bytes(pack(document, tensors))
    done = tracejit_cli("run", "bad.tjit", "--check", cwd=str(tmp_path))
    assert done.returncode != 0
    assert "case 0: max error 100 > maxerr" in done.stdout


# -- keyword inputs ------------------------------------------------------------------------------------


def _scaled(x, *, a, b, scale=2.0):
    return x * a - b * scale


def test_keyword_inputs_are_in_name_order_whatever_the_call_order(tmp_path):
    f = tracejit.trace(capture_as_const=True)(_scaled)
    x, a, b = torch.randn(3), torch.randn(3), torch.randn(3)
    f(x, b=b, a=a, scale=3.0)
    g = _round_trip(f, tmp_path)
    assert g.input_names == ["x", "a", "b"]
    assert torch.allclose(g(x, a, b)[0], x * a - b * 3)
    g = _round_trip(f, tmp_path, arg_names=["x", "a", "b"], name="named.tjit")
    assert torch.allclose(g(x, a=a, b=b)[0], x * a - b * 3)


def test_arg_names_that_swap_keyword_inputs_are_refused(tmp_path):
    f = tracejit.trace(capture_as_const=True)(_scaled)
    f(torch.randn(3), b=torch.randn(3), a=torch.randn(3))
    with pytest.raises(ValueError, match=r"arg_names names the input of keyword argument 'a' 'b', the name of "
                                         r"another keyword argument; .* sorted by name: x, a, b"):
        f.dump(tmp_path / "g.tjit", arg_names=["x", "b", "a"])


# -- messages and profiles -----------------------------------------------------------------------------


def test_a_file_failing_the_metadata_check_prints_one_line(tmp_path):
    f = tracejit.trace(capture_as_const=True)(_doubles_x)
    f(torch.randn(4, 3), torch.randn(4, 3))
    document, tensors = _document(f, tmp_path)
    graph = document["graphs"][0]
    for item in graph["inputs"][1:]:  # y declared [5, 3]: x + y cannot broadcast
        item["shape"], graph["values"][item["value"]]["shape"] = [5, 3], [5, 3]
    (tmp_path / "bad.tjit").write_bytes(pack(json.dumps(document).encode(), tensors))
    done = tracejit_cli("show", "bad.tjit", cwd=str(tmp_path))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("tracejit: error: op #1 aten.add.Tensor: its arguments are invalid")


def _lookup(idx, x):
    return x * 2 + 1, torch.nn.functional.embedding(idx, torch.arange(40.0).reshape(10, 4))


def test_a_call_that_raises_counts_in_the_profile(tmp_path):
    f = tracejit.trace(capture_as_const=True)(_lookup)
    f(torch.randint(0, 10, (6,)), torch.randn(6, 4))
    f.dump(tmp_path / "p.tjit")
    g = tracejit.load(tmp_path / "p.tjit", profiling=True)
    g(torch.randint(0, 10, (6,)), torch.randn(6, 4))
    with pytest.raises(IndexError):
        g(torch.full((6,), 11), torch.randn(6, 4))
    profile = g.get_profile()
    assert profile["summary"]["calls"] == 2
    assert max(row["calls"] for row in profile["rows"]) == 2
    assert profile["summary"]["call_total_ms"] >= profile["summary"]["nodes_total_ms"]


def _plus_ones(x):
    return x + torch.ones(3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned memory needs a machine without CUDA to be refused")
def test_pinned_memory_without_cuda_is_refused_at_load(tmp_path):
    f = tracejit.trace(capture_as_const=True)(_plus_ones)
    f(torch.randn(3))
    f.dump(tmp_path / "ok.tjit", optimize_for_inference=False)
    with zipfile.ZipFile(tmp_path / "ok.tjit") as archive:
        document = json.loads(archive.read("graph.json"))
        tensors = safetensors.torch.load(archive.read("weights.safetensors"))
    ones = next(op for op in document["graphs"][0]["ops"] if op["op"] == "aten::ones.default")
    next(a for a in ones["args"] if isinstance(a, dict) and a.get("name") == "pin_memory")["value"] = True
    with pytest.raises(tracejit.LoadError, match=r"op #0 aten.ones.default: pin_memory=True needs a CUDA device"):
        tracejit.load(pack(json.dumps(document).encode(), tensors))


# -- minor interface errors ----------------------------------------------------------------------------


def test_an_empty_backend_variable_means_auto(tmp_path, monkeypatch):
    f = tracejit.trace(capture_as_const=True)(_plus_ones)
    f(torch.randn(3))
    f.dump(tmp_path / "g.tjit")
    monkeypatch.setenv("TRACEJIT_BACKEND", "")
    x = torch.randn(3)
    assert torch.allclose(tracejit.load(tmp_path / "g.tjit")(x)[0], x + 1)
    monkeypatch.setenv("TRACEJIT_BACKEND", "fast")
    with pytest.raises(tracejit.LoadError, match="the environment variable TRACEJIT_BACKEND must be one of auto"):
        tracejit.load(tmp_path / "g.tjit")


def _second(x):
    return x * 3


def test_tracejit_run_names_its_graph_option_for_a_file_of_several(tmp_path):
    for function in (_plus_ones, _second):
        traced = tracejit.trace(capture_as_const=True)(function)
        traced(torch.randn(3))
        traced.dump(tmp_path / "two.tjit", append=True)
    done = tracejit_cli("run", "two.tjit", cwd=str(tmp_path))
    assert done.returncode != 0
    assert done.stderr.strip().endswith("the file holds 2 graphs (_plus_ones, _second); pass --graph NAME to choose one")
    assert tracejit_cli("run", "two.tjit", "--graph", "_second", cwd=str(tmp_path)).returncode == 0


class _Endless:
    """A stream of zeros without end, counting what was read (`/dev/zero`)."""

    def __init__(self):
        self.given = 0

    def read(self, size=-1):
        self.given += size
        return bytes(size)


def test_a_stream_that_is_no_zip_archive_is_refused_after_its_first_bytes():
    stream = _Endless()
    with pytest.raises(tracejit.LoadError, match="it is not a zip archive"):
        tracejit.load(stream)
    assert stream.given == 4


def test_text_mode_files_are_refused_with_a_type_error(tmp_path):
    f = tracejit.trace(capture_as_const=True)(_plus_ones)
    f(torch.randn(3))
    with pytest.raises(TypeError, match=r"dump\(\): the file object must be opened in binary mode \('wb'\)"):
        f.dump(io.StringIO())
    f.dump(tmp_path / "g.tjit")
    with open(tmp_path / "g.tjit") as text, pytest.raises(TypeError, match=r"must be opened in binary mode \('rb'\)"):
        tracejit.load(text)
