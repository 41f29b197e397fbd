"""What the record learns about memory the host keeps or reads."""

import torch

import tracejit
from tracejit.record import Flag


def test_host_value_op_flags_every_tensor_it_reads():
    @tracejit.trace
    def f(x, y):
        a, b = x * 2, y * 3
        same = torch.equal(a, b)
        return a + b if same else a - b

    x, y = torch.ones(3) * 3, torch.ones(3) * 2
    assert torch.equal(f(x, y), x * 2 + y * 3)
    record = f.records[0]
    read = {r.handle for r in record.host_reads}
    mul_outputs = {op.outputs[0] for op in record.ops if str(op.op) == "aten.mul.Tensor"}
    assert read == mul_outputs
    assert all(record.tensors[h].flags & Flag.VALUE_READ for h in mul_outputs)
    assert torch.equal(f(x, y), x * 2 + y * 3)


def test_memory_kept_through_a_data_alias_escapes():
    kept = []

    @tracejit.trace
    def f(x):
        y = x.exp()
        kept.append(y.data)  # a new tensor object over y's memory, made without an op
        return y.sin()

    f(torch.randn(3))
    record = f.records[0]
    exp_output = next(op.outputs[0] for op in record.ops if str(op.op) == "aten.exp.default")
    assert record.tensors[exp_output].flags & Flag.ESCAPED
    assert record.created_state


def test_memory_of_a_returned_view_is_not_new_state():
    @tracejit.trace
    def f(x):
        return x.exp().view(-1)

    f(torch.randn(3, 2))
    record = f.records[0]
    assert all(info.flags & Flag.ESCAPED for info in record.tensors[1:])
    assert not record.created_state
