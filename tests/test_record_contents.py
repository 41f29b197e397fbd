"""What a record holds: tensor kinds, host-read and escape flags, a source line per op, no profiler ops."""

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tracejit.record import Flag, Kind


def line_of(function, text: str) -> int:
    """The line number of the first line of `function` containing `text`."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def handle_of(record, op_name: str, occurrence: int = 0) -> int:
    return [op.outputs[0] for op in record.ops if op.name == op_name][occurrence]


def test_every_kind_of_tensor(trace):
    weight = torch.randn(3)

    @trace
    def f(x, *, bias, scale):
        return x * weight + bias + torch.tensor([1.0, 2.0, 3.0]) * scale

    x, bias = torch.randn(3), torch.randn(3)
    for _ in range(2):
        assert torch.equal(f(x, bias=bias, scale=0.5), x * weight + bias + torch.tensor([1.0, 2.0, 3.0]) * 0.5)
    record = f.records[0]
    kinds = {info.name: info.kind for info in record.tensors if info.kind is not Kind.INTERNAL}
    assert kinds == {"x": Kind.ARG, "bias": Kind.KWARG, "weight": Kind.EXTERNAL, "literal": Kind.CONST}
    assert record.arg_handles == (0,) and record.kwarg_handles == {"bias": 1}
    literal = next(info for info in record.tensors if info.kind is Kind.CONST)
    assert literal.literal and torch.equal(record.constants[literal.handle], torch.tensor([1.0, 2.0, 3.0]))
    for info in record.tensors:
        if info.kind is Kind.INTERNAL:  # every internal tensor names the op that produced it
            assert info.handle in record.ops[info.producer].outputs


def test_capture_as_const_makes_externals_constants(trace):
    weight = torch.randn(3)

    @trace(capture_as_const=True)
    def f(x):
        return x * weight

    x = torch.randn(3)
    assert torch.equal(f(x), x * weight)
    record = f.records[0]
    const = next(info for info in record.tensors if info.name == "weight")
    assert const.kind is Kind.CONST and not const.literal
    assert record.constants[const.handle] is weight and record.constant_versions[const.handle] == weight._version


@pytest.mark.skip_mode("symbolic", reason="reads computed values on the host (test_symbolic.py checks the refusal)")
def test_host_read_flags_and_positions(trace):
    seen = []

    @trace
    def f(x):
        a = x * 2
        seen.append(a.tolist())  # data read
        b = a + 1
        seen.append(bool(b.sum() > 0))  # value read
        c = b.exp()
        rows = c.shape[0]  # shape read
        return c * rows

    x = torch.arange(3.0)
    assert torch.equal(f(x), (x * 2 + 1).exp() * 3)
    assert seen == [[0.0, 2.0, 4.0], True]
    record = f.records[0]
    a, b, c = (handle_of(record, name) for name in ("aten.mul.Tensor", "aten.add.Tensor", "aten.exp.default"))
    gt = handle_of(record, "aten.gt.Scalar")
    assert record.tensors[a].flags & Flag.DATA_READ and not record.tensors[a].flags & Flag.VALUE_READ
    assert record.tensors[gt].flags & Flag.VALUE_READ
    assert record.tensors[c].flags & Flag.SHAPE_READ and not record.tensors[c].flags & (Flag.DATA_READ | Flag.VALUE_READ)
    assert not record.tensors[b].flags & (Flag.DATA_READ | Flag.VALUE_READ | Flag.SHAPE_READ)
    # each read remembers how many ops ran before it and where it happened
    reads = [(r.what, r.handle, r.position, r.source.line) for r in record.host_reads]
    assert reads == [("tolist()", a, 1, line_of(f.__wrapped__, "a.tolist()")),
                     ("bool()", gt, 4, line_of(f.__wrapped__, "bool(b.sum() > 0)"))]
    x = torch.arange(3.0) - 5  # the replay reads the new values
    assert torch.equal(f(x), (x * 2 + 1).exp() * 3)
    assert seen[2:] == [[-10.0, -8.0, -6.0], False]


def test_shape_reads_are_flagged_in_both_constructions(trace):
    @trace
    def f(x):
        y = x.t()
        z = y @ x
        return z.reshape(y.size(0) * len(z))

    x = torch.randn(4, 3)
    assert torch.equal(f(x), (x.t() @ x).reshape(9))
    record = f.records[0]
    t, mm = handle_of(record, "aten.t.default"), handle_of(record, "aten.mm.default")
    assert record.tensors[t].flags & Flag.SHAPE_READ and record.tensors[mm].flags & Flag.SHAPE_READ
    assert not record.tensors[0].flags & Flag.SHAPE_READ  # x's shape was read by nobody but torch


def test_escaped_returned_and_mutated_flags(trace):
    kept = []
    counter = torch.zeros(())

    @trace
    def f(x):
        a = x.sin()
        kept.append(a)  # alive after the call in Python state
        b = x.cos()  # dies inside the call
        counter.add_(1)
        return a + b

    x = torch.randn(3)
    assert torch.equal(f(x), x.sin() + x.cos())
    record = f.records[0]
    a, b = handle_of(record, "aten.sin.default"), handle_of(record, "aten.cos.default")
    result = record.output.handle
    assert record.tensors[a].flags & Flag.ESCAPED and not record.tensors[a].flags & Flag.RETURNED
    assert not record.tensors[b].flags & Flag.ESCAPED
    assert record.tensors[result].flags & Flag.RETURNED and record.tensors[result].flags & Flag.ESCAPED
    counter_handle = next(info.handle for info in record.tensors if info.name == "counter")
    assert record.tensors[counter_handle].flags & Flag.MUTATED
    assert record.created_state  # `kept` holds a tensor of the call
    assert torch.equal(kept[0], x.sin()) and counter.item() == 1


def test_grad_and_optimizer_state_escape(trace):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    @trace
    def step(x, *, model, opt):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    step(torch.randn(3, 4), model=model, opt=opt)
    record = step.records[0]
    escaped = {info.handle for info in record.tensors if info.flags & Flag.ESCAPED and info.kind is Kind.INTERNAL}
    live = {id(t) for t in [p.grad for p in model.parameters()] + [s["momentum_buffer"] for s in opt.state.values()]}
    # every .grad and momentum buffer the call left behind is an escaped internal tensor of the record
    assert len(live) == 4 and len(escaped) >= 4 and record.created_state


def test_every_op_has_the_user_source_line(trace):
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x, y, *, model, opt):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    traced = trace(step)
    traced(torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]), model=model, opt=opt)
    record = traced.records[0]
    lines = {text: line_of(step, text) for text in ("model(x)", "F.cross_entropy", "loss.backward()", "opt.step()")}
    assert all(op.source.filename == __file__ and op.source.function == "step" for op in record.ops)
    by_line = {}
    for op in record.ops:
        by_line.setdefault(op.source.line, []).append(op)
    assert set(by_line) == set(lines.values())  # zero_grad(set_to_none=True) dispatches nothing
    assert all(op.backward_of is None for op in by_line[lines["model(x)"]] + by_line[lines["F.cross_entropy"]])
    backward = by_line[lines["loss.backward()"]]
    assert backward[0].name == "aten.ones_like.default"  # the seed gradient, made before autograd runs
    assert all(op.backward_of is not None for op in backward[1:])
    assert {op.index for op in record.ops if op.backward_of is not None} == {op.index for op in backward[1:]}
    assert any(op.name == "aten.addmm.default" for op in by_line[lines["model(x)"]])
    assert all(any(r.startswith("Optimizer.step#SGD.step") for r in op.regions) for op in by_line[lines["opt.step()"]])
    assert f"test_record_contents.py:{lines['opt.step()']} in step" in traced.listing()


def test_profiler_ranges_are_not_ops_and_may_come_and_go(trace):
    ranges = {"on": True}

    def f(x):
        if ranges["on"]:
            with torch.profiler.record_function("scaled block"):
                y = x * 3
        else:
            y = x * 3
        return y.relu()

    traced = trace(f)
    x = torch.randn(6)
    assert torch.equal(traced(x), f(x))
    record = traced.records[0]
    assert [op.name for op in record.ops] == ["aten.mul.Tensor", "aten.relu.default"]
    assert record.ops[0].regions == ("scaled block",) and record.ops[1].regions == ()
    ranges["on"] = False  # no range now: not a mismatch
    assert torch.equal(traced(x), f(x))
    ranges["on"] = True
    with torch.profiler.profile() as profiler:  # replay under a running profiler
        assert torch.equal(traced(x), f(x))
    assert any(event.name == "scaled block" for event in profiler.events())
    assert len(traced.records) == 1 and len(traced.records[0].ops) == 2
