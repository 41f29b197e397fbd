"""The mismatch catalogue, message by message: each error names the op index, the recorded op with its
source line and code, and what came instead with its own source line."""

import inspect
import os
import re

import pytest
import torch

from tracejit import TraceMismatchError

FILE = os.path.basename(__file__)


def where(function, text: str) -> str:
    """`file:line in name: code` of the first line of `function` containing `text`, as messages print it."""
    lines, first = inspect.getsourcelines(function)
    index = next(i for i, line in enumerate(lines) if text in line)
    return f"{FILE}:{first + index} in {function.__name__}: {lines[index].strip()}"


def raised(traced, *args, **kwargs) -> str:
    with pytest.raises(TraceMismatchError) as info:
        traced(*args, **kwargs)
    return str(info.value)


def test_different_op(trace):
    switch = {"sub": False}

    def f(x):
        y = x + 1
        if switch["sub"]:
            return y - 2
        return y * 2

    traced = trace(f)
    x = torch.randn(4)
    assert torch.equal(traced(x), (x + 1) * 2)
    switch["sub"] = True
    message = raised(traced, x)
    assert message.startswith("f() diverged from its trace at op #1: a different op ran "
                              "(aten.sub.Tensor instead of aten.mul.Tensor)")
    assert re.search(r"recorded: #1 t\d+ = aten.mul.Tensor\(t\d+, 2\)\n +at " + re.escape(where(f, "y * 2")), message)
    assert re.search(r"got: +aten.sub.Tensor\(t\d+, 2\)\n +at " + re.escape(where(f, "y - 2")), message)


def test_extra_op(trace):
    switch = {"more": False}

    def f(x):
        y = x.sin()
        if switch["more"]:
            y = y.cos()
        return y

    traced = trace(f)
    x = torch.randn(3)
    traced(x)
    switch["more"] = True
    message = raised(traced, x)
    assert message.startswith("f() diverged from its trace at op #1: more ops than recorded (the trace has 1)")
    assert "the trace ended after #0 t1 = aten.sin.default(t0)\n" in message
    assert "at " + where(f, "x.sin()") in message
    assert re.search(r"got: +aten.cos.default\(t1\)\n +at " + re.escape(where(f, "y.cos()")), message)


def test_premature_end(trace):
    switch = {"less": False}

    def f(x):
        y = x.sin()
        if not switch["less"]:
            y = y.cos()
        return y

    traced = trace(f)
    x = torch.randn(3)
    traced(x)
    switch["less"] = True
    message = raised(traced, x)
    assert message.startswith("f() diverged from its trace at op #1: premature end: "
                              "the function returned after 1 of 2 recorded ops")
    assert re.search(r"recorded: #1 t2 = aten.cos.default\(t1\)\n +at " + re.escape(where(f, "y.cos()")), message)
    assert "got:      the function returned instead (traced call at " + where(raised, "traced(*args") in message


def test_rewired_input(trace):
    switch = {"swap": False}

    def f(x, y):
        a = x.exp()
        b = y.exp()
        return a + (a if switch["swap"] else b)

    traced = trace(f)
    x, y = torch.randn(3), torch.randn(3)
    traced(x, y)
    switch["swap"] = True
    message = raised(traced, x, y)
    assert message.startswith("f() diverged from its trace at op #2: tensor input 1 of aten.add.Tensor "
                              "comes from a different producer")
    assert f"expected: t3 (output of op #1 aten.exp.default at {where(f, 'y.exp()').split(':')[0]}" in message
    assert re.search(r"got: +t2 \(output of op #0 aten.exp.default at " + FILE, message)
    assert "recorded: #2 t4 = aten.add.Tensor(t2, t3)" in message
    assert "replayed at " + where(f, "return a +") in message


@pytest.mark.parametrize("direction", ["external_for_internal", "internal_for_external"])
def test_external_internal_swap(trace, direction):
    weight = torch.randn(3)
    switch = {"on": False}

    def f(x):
        h = x * 2
        recorded, swapped = (h, weight) if direction == "external_for_internal" else (weight, h)
        return h + (swapped if switch["on"] else recorded)

    traced = trace(f)
    x = torch.randn(3)
    traced(x)
    switch["on"] = True
    message = raised(traced, x)
    expected_reason = {"external_for_internal": "is an external tensor where an internal one was recorded",
                       "internal_for_external": "is an internal tensor where an external one was recorded"}[direction]
    assert message.startswith(f"f() diverged from its trace at op #1: tensor input 1 of aten.add.Tensor {expected_reason}")
    mul = f"output of op #0 aten.mul.Tensor at {where(f, 'h = x * 2').split(': ')[0]}, cpu float32[3]"
    if direction == "external_for_internal":
        assert f"expected: t1 ({mul})\n  got:      an external tensor, cpu float32[3]\n" in message
        assert "recorded: #1 t2 = aten.add.Tensor(t1, t1)" in message
    else:
        assert f"expected: t2 (external weight, cpu float32[3])\n  got:      t1 ({mul})\n" in message
        assert "recorded: #1 t3 = aten.add.Tensor(t1, t2)" in message
    assert "replayed at " + where(f, "return h +") in message


def test_keyword_switching_between_tensor_and_non_tensor(trace):
    @trace
    def f(x, *, scale):
        return x * scale

    x = torch.randn(3)
    f(x, scale=torch.tensor(2.0))
    # no op is involved: the call is refused before the function runs, naming the keyword
    message = raised(f, x, scale=2.0)
    assert message.startswith("f(): keyword argument 'scale' was a tensor when traced and is float now.")


@pytest.mark.parametrize("change, detail", [
    ("arity", "output has 1 elements, recorded 2"),
    ("container", "output is list, recorded a tuple"),
    ("swapped", "output[0] is t2 (output of op #1 aten.cos.default"),
    ("untraced", None),
])
def test_different_outputs(trace, change, detail):
    switch = {"on": False}

    def f(x):
        a, b = x.sin(), x.cos()
        if not switch["on"]:
            return (a, b)
        if change == "untraced":
            return (a, torch.ones(3))
        return {"arity": (a,), "container": [a, b], "swapped": (b, a)}[change]

    traced = trace(f)
    x = torch.randn(3)
    traced(x)
    switch["on"] = True
    if change == "untraced":  # torch.ones is an op the trace does not have: the ops diverge first
        with pytest.raises(TraceMismatchError, match=r"op #2: more ops than recorded"):
            traced(x)
        return
    message = raised(traced, x)
    assert message.startswith(f"f() returned a different output than recorded: {detail}")
    assert "recorded output: (t1, t2,)" in message
    line = where(f, "x.sin(), x.cos()").split(": ")[0]
    assert f"t1 (output of op #0 aten.sin.default at {line}" in message
    assert f"t2 (output of op #1 aten.cos.default at {line}" in message
    assert "traced call at " + where(raised, "traced(*args") in message


def test_returned_input_instead_of_internal(trace):
    switch = {"on": False}

    def f(x):
        y = x * 2
        return x if switch["on"] else y

    traced = trace(f)
    x = torch.randn(3)
    traced(x)
    switch["on"] = True
    message = raised(traced, x)
    assert message.startswith("f() returned a different output than recorded: output is t0 (arg x, cpu float32[3]), "
                              "not the recorded t1 (output of op #0 aten.mul.Tensor")


def test_const_capture_violations(trace):
    holder = {"w": torch.randn(3)}

    def f(x):
        return x * holder["w"]

    traced = trace(f, capture_as_const=True)
    x = torch.randn(3)
    traced(x)
    holder["w"].mul_(2)
    message = raised(traced, x)
    assert message.startswith("f() diverged from its trace at op #0: captured constant t1 (holder['w']) was modified")
    assert "was modified in place since it was captured (version 0 -> 1)" in message
    assert "recorded: #0 t2 = aten.mul.Tensor(t0, t1)" in message and "at " + where(f, "x * holder") in message
    traced2 = trace(f, capture_as_const=True)
    traced2(x)
    holder["w"] = torch.randn(3)  # same shape, another object: still a violation, values are not compared
    assert "is a different tensor object now (cpu float32[3])" in raised(traced2, x)


def test_structural_argument_and_scalar_type(trace):
    config = {"dim": 0, "scale": 2}

    def f(x):
        return x.sum(config["dim"]) * config["scale"]

    traced = trace(f)
    x = torch.arange(6).reshape(2, 3)
    assert torch.equal(traced(x), x.sum(0) * 2)
    config["scale"] = 5  # a dynamic scalar of the same type: re-bound, not a mismatch
    assert torch.equal(traced(x), x.sum(0) * 5)
    config["dim"] = 1
    message = raised(traced, x)
    assert message.startswith("f() diverged from its trace at op #0: aten.sum.dim_IntList got different non-tensor "
                              "arguments (argument 1: (1,) instead of (0,))")
    assert re.search(r"got: +aten.sum.dim_IntList\(t0, \[1\]\)\n +at " + re.escape(where(f, "x.sum(")), message)
    config.update(dim=0, scale=2.5)
    message = raised(traced, x)
    assert "op #1: aten.mul.Tensor got different non-tensor arguments (argument 1: a scalar of another type" in message


def test_python_data_of_another_type_names_the_literal(trace):
    config = {"offset": 2}

    def f(x):
        return x + torch.tensor(config["offset"])

    traced = trace(f)
    x = torch.arange(3)
    traced(x)
    config["offset"] = 3  # another value of the same type: followed, not a mismatch
    assert torch.equal(traced(x), x + 3)
    config["offset"] = 2.5
    message = raised(traced, x)
    assert message.startswith("f() diverged from its trace at op #0: tensor input 0 of aten.lift_fresh.default is "
                              "created from Python data of another dtype or shape than recorded (cpu int64[]); the "
                              "program was compiled for the recorded one")
    assert "expected: t1 (a tensor created from Python data, cpu int64[])\n" in message
    assert "got:      a tensor created from Python data, cpu float32[]\n" in message
    assert "replayed at " + where(f, "torch.tensor(config") in message


def test_positional_non_tensor_names_the_index(trace):
    @trace
    def f(x, lengths):
        return x

    with pytest.raises(TypeError) as info:
        f(torch.randn(2), [3, 4])
    assert str(info.value).startswith("tracejit: positional argument 1 (lengths) of f() must be a torch.Tensor, "
                                      "got list.")
    assert f.records == []
