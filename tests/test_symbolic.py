"""symbolic=True: the first call is recorded without computing anything, then its program runs for real.

The core behaviour in symbolic mode (outputs, training, mismatches, exclude_from_trace, exceptions)
is covered by the other test files through the `trace` fixture; this file checks what only
symbolic recording does.
"""

import re
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from models import assert_same_state, batch, make_model, make_optimizer, train_step
from torch.utils._python_dispatch import _disable_current_modes

import tracejit
from tracejit import SymbolicTraceError

KERNEL_RUNS = {"count": 0}


@torch.library.custom_op("tracejit_tests::counted_double", mutates_args=())
def counted_double(x: torch.Tensor) -> torch.Tensor:
    KERNEL_RUNS["count"] += 1
    return x * 2


@counted_double.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("tracejit_tests::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@torch.library.custom_op("tracejit_tests::row_major_copy", mutates_args=())
def row_major_copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


@row_major_copy.register_fake
def _(x):  # wrong on purpose: predicts column-major strides
    return torch.empty_strided(x.shape, (1, x.shape[0]), dtype=x.dtype)


@torch.library.custom_op("tracejit_tests::grows", mutates_args=())
def grows(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x])


@grows.register_fake
def _(x):  # wrong on purpose: predicts the input's shape
    return torch.empty_like(x)


def peek(tensor):
    """A copy of the tensor's memory right now, taken outside every mode of the traced call."""
    with _disable_current_modes(), torch.no_grad():
        return torch.ops.aten.clone.default(tensor)


def identical_pair(kind, opt_name):
    """Two models and optimizers built the same way (same values, same version counters)."""
    pairs = []
    for _ in range(2):
        model = make_model(kind)
        pairs.append((model, make_optimizer(opt_name, model.parameters())))
    return pairs


# -- nothing runs while recording ---------------------------------------------------------------


def test_no_kernel_runs_while_recording():
    runs_during_call = []

    @tracejit.trace(symbolic=True)
    def f(x):
        y = counted_double(x) + 1
        runs_during_call.append(KERNEL_RUNS["count"])
        return y

    KERNEL_RUNS["count"] = 0
    x = torch.randn(5)
    assert torch.equal(f(x), x * 2 + 1)
    assert runs_during_call == [0]  # the custom op's kernel did not run during the recording...
    assert KERNEL_RUNS["count"] == 1  # ...but once, by the program, before the call returned
    assert torch.equal(f(x), x * 2 + 1)
    # checked replay: the program runs the op when the call reaches it, as in non-symbolic traces
    assert runs_during_call == [0, 2] and KERNEL_RUNS["count"] == 2


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw_fused"])
def test_recording_leaves_parameters_buffers_state_and_generator_untouched(opt_name):
    (model_a, opt_a), (model_b, opt_b) = identical_pair("cnn", opt_name)  # BatchNorm and Dropout
    x, y = batch("cnn", 0)
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):  # one eager step: optimizer state exists
        torch.manual_seed(1)
        train_step(x, y, model=model, opt=opt)
    before = [peek(t) for t in _state_tensors(model_b, opt_b)]
    seen = {}

    def step(x, y, *, model, opt):
        loss = train_step(x, y, model=model, opt=opt)
        seen["state"] = [peek(t) for t in _state_tensors(model, opt)]
        seen["generator"] = torch.get_rng_state()
        return loss

    x, y = batch("cnn", 1)
    torch.manual_seed(2)
    expected = step(x, y, model=model_a, opt=opt_a)
    torch.manual_seed(2)
    generator_at_entry = torch.get_rng_state()
    got = tracejit.trace(step, symbolic=True)(x, y, model=model_b, opt=opt_b)
    assert all(torch.equal(a, b) for a, b in zip(before, seen["state"]))
    assert torch.equal(seen["generator"], generator_at_entry)  # dropout drew nothing while recording
    assert torch.equal(got, expected)
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)


def _state_tensors(model, opt):
    tensors = list(model.state_dict().values())
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


# -- after the first call, every tensor the host holds is real -----------------------------------


def test_every_tensor_the_host_holds_is_real_after_the_first_call():
    def step(x, y, *, model, opt, holder):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        holder.detached = logits.detach()  # stored on a Python object
        holder.view = logits.t()  # a view, still part of the autograd graph
        holder.alias = logits.data  # an alias that never passes through the recorder
        loss.backward()
        opt.step()
        return {"loss": loss, "logits": logits, "scaled": (logits * 2)[:, :3]}

    (model_a, opt_a), (model_b, opt_b) = identical_pair("cnn", "sgd_momentum")
    holder_a, holder_b = types.SimpleNamespace(), types.SimpleNamespace()
    x, y = batch("cnn", 0)
    torch.manual_seed(3)
    expected = step(x, y, model=model_a, opt=opt_a, holder=holder_a)
    torch.manual_seed(3)
    got = tracejit.trace(step, symbolic=True)(x, y, model=model_b, opt=opt_b, holder=holder_b)
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    for name in ("detached", "view", "alias"):
        assert torch.equal(getattr(holder_b, name), getattr(holder_a, name)), name
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)  # .grad, momentum buffers, BN buffers
    # version counters too, so autograd's checks and capture_as_const see what they see after eager code
    assert [t._version for t in model_a.state_dict().values()] == [t._version for t in model_b.state_dict().values()]


def test_autograd_graph_that_outlives_the_call_holds_real_values():
    def forward(x, *, model):
        return F.cross_entropy(model(x).exp().sigmoid(), torch.arange(8) % 10)

    (model_a, _), (model_b, _) = identical_pair("mlp", "sgd")
    x, _ = batch("mlp", 0)
    expected = forward(x, model=model_a)
    got = tracejit.trace(forward, symbolic=True)(x, model=model_b)
    assert torch.equal(got, expected)
    expected.backward()
    got.backward()  # eager backward over the tensors autograd saved while recording
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("opt_name", ["sgd", "sgd_momentum", "adam_fused", "adamw_fused"])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_first_call_and_every_step_after_it_match_eager_bitwise(kind, opt_name):
    # test_training covers these runs too; here the whole state is compared after every call,
    # starting with the symbolically recorded one (and with lazily created optimizer state).
    (model_a, opt_a), (model_b, opt_b) = identical_pair(kind, opt_name)
    traced = tracejit.trace(train_step, symbolic=True)
    for i in range(5):
        x, y = batch(kind, i)
        torch.manual_seed(10 + i)
        expected = train_step(x, y, model=model_a, opt=opt_a)
        generator_after_eager = torch.get_rng_state()
        torch.manual_seed(10 + i)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), expected), f"step {i}"
        assert torch.equal(torch.get_rng_state(), generator_after_eager), f"step {i}: dropout drew differently"
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    assert len(traced.records) == 1


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused"])
@pytest.mark.parametrize("kind", ["cnn", "transformer"])
def test_symbolic_record_equals_the_eager_record(kind, opt_name):
    # Later calls replay against the record, so "behave exactly as non-symbolic" means this.
    (model_a, opt_a), (model_b, opt_b) = identical_pair(kind, opt_name)
    eager_traced, symbolic_traced = tracejit.trace(train_step), tracejit.trace(train_step, symbolic=True)
    for i in range(3):  # the first replay re-records once (lazy optimizer state)
        x, y = batch(kind, i)
        eager_traced(x, y, model=model_a, opt=opt_a)
        symbolic_traced(x, y, model=model_b, opt=opt_b)
        a, b = eager_traced.records[0], symbolic_traced.records[0]
        assert a.listing() == b.listing()
        assert [t.flags for t in a.tensors] == [t.flags for t in b.tensors]
        assert (a.created_state, a.rerecorded) == (b.created_state, b.rerecorded)


# -- host reads -----------------------------------------------------------------------------------


READS = {
    "item": lambda y: y.item(),
    "tolist": lambda y: y.tolist(),
    "bool": lambda y: bool(y > 0),
    "float": lambda y: float(y),
    "int": lambda y: int(y),
    "repr": lambda y: repr(y),
    "format": lambda y: f"{y:.3f}",
    "print": lambda y: print(y),
    "numpy": lambda y: y.numpy(),
    "asarray": lambda y: np.asarray(y),
    "equal": lambda y: torch.equal(y, y),
    "allclose": lambda y: torch.allclose(y, y),
    "if": lambda y: 1 if y > 0 else 2,
}


@pytest.mark.parametrize("read", list(READS))
def test_reading_a_value_that_is_not_computed_yet_is_refused(read):
    @tracejit.trace(symbolic=True)
    def f(x):
        y = x.sum()
        READS[read](y)
        return y

    with pytest.raises(SymbolicTraceError) as info:
        f(torch.randn(4))
    message = str(info.value)
    assert "f() reads the value of a tensor on the host" in message
    assert "while its first call is recorded with symbolic=True" in message
    assert re.search(r"is not computed yet: it is the output of op #\d+ aten\.", message)
    assert f'"{read}": lambda y:' in message  # the line of the read
    assert "exclude_from_trace()" in message and "symbolic=False" in message
    assert f.records == [] and not tracejit.is_tracing()


def test_reading_an_external_after_an_in_place_write_is_refused():
    counter = torch.zeros(())

    @tracejit.trace(symbolic=True)
    def f(x):
        counter.add_(1)
        if counter.item() > 3:  # eager would read 1.0: the add_ has not run yet
            return x
        return x * 2

    with pytest.raises(SymbolicTraceError, match=r"written in place by op #0 aten.add_.Tensor .*which has not run yet"):
        f(torch.randn(2))
    assert counter.item() == 1  # the recorded add_ ran after all, as in an eager call that raised there


def test_reading_values_that_exist_already_is_allowed():
    scale = torch.tensor(3.0)
    seen = []

    @tracejit.trace(symbolic=True)
    def f(x):
        seen.append((x.tolist(), scale.item()))  # an argument and an untouched external are real data
        return x * scale.item()

    x = torch.tensor([1.0, 2.0])
    assert torch.equal(f(x), x * 3)
    assert seen == [([1.0, 2.0], 3.0)]


def test_shape_reads_work_while_recording():
    @tracejit.trace(symbolic=True)
    def f(x):
        y = x.t() @ x
        assert y.shape == (3, 3) and y.size(1) == 3 and y.numel() == 9 and y.dim() == 2 and len(y) == 3
        assert y.stride() == (3, 1) and y.is_contiguous() and y.dtype == torch.float32
        return y.reshape(y.shape[0] * y.shape[1]) if y.shape[0] > 2 else y

    x = torch.randn(4, 3)
    assert torch.equal(f(x), (x.t() @ x).reshape(9))


@pytest.mark.parametrize("opt_name", ["adam", "adam_foreach", "adamw", "adamw_foreach", "adam_loop"])
def test_optimizers_that_read_step_on_the_host_are_refused_with_advice(opt_name):
    (model_a, _), (model_b, opt_b) = identical_pair("mlp", opt_name)
    x, y = batch("mlp", 0)
    traced = tracejit.trace(train_step, symbolic=True)
    with pytest.raises(SymbolicTraceError) as info:
        traced(x, y, model=model_b, opt=opt_b)
    message = str(info.value)
    assert f"torch.optim.{type(opt_b).__name__}.step" in message
    assert "construct the optimizer with fused=True" in message and "symbolic=False" in message
    assert "opt.step()" in message  # the user's line, not torch's
    # The call stopped at the read, with the side effects an eager call has up to there: the gradients.
    F.cross_entropy(model_a(x), y).backward()
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a.grad, b.grad)


# -- exclude_from_trace, exceptions, randomness ---------------------------------------------------


def test_exclude_block_sees_real_values_and_its_writes_count():
    log = []

    def f(x):
        x += 1
        with tracejit.exclude_from_trace():
            log.append(x.item())  # eager code on real values
            x *= 2  # not commutative with the recorded add_: order must be kept
        return x + 1

    traced = tracejit.trace(f, symbolic=True)
    for value in (1.0, 5.0):
        assert traced(torch.tensor([value])).item() == (value + 1) * 2 + 1
    assert log == [2.0, 6.0]


def test_exclude_block_drawing_random_numbers_keeps_the_eager_order():
    def f(x):
        a = F.dropout(x, 0.5)
        with tracejit.exclude_from_trace():
            noise = torch.rand(3)
        b = F.dropout(x, 0.5)
        return a, b + noise.sum()

    traced = tracejit.trace(f, symbolic=True)
    x = torch.ones(16)
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected = f(x)
        torch.manual_seed(seed)
        got = traced(x)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam_fused"])
def test_exception_after_the_step_leaves_the_side_effects_of_eager_execution(opt_name):
    def step(x, y, *, model, opt, fail):
        loss = train_step(x, y, model=model, opt=opt)
        if fail:
            raise ValueError("after the step")
        return loss

    (model_a, opt_a), (model_b, opt_b) = identical_pair("cnn", opt_name)
    traced = tracejit.trace(step, symbolic=True)
    for i, fail in enumerate([True, False, False, True, False]):
        x, y = batch("cnn", i)
        results = []
        for function, model, opt in ((step, model_a, opt_a), (traced, model_b, opt_b)):
            torch.manual_seed(i)
            try:
                results.append(function(x, y, model=model, opt=opt, fail=fail))
            except ValueError:
                results.append(None)
        assert (results[0] is None) == fail and (results[1] is None) == fail
        if not fail:
            assert torch.equal(results[0], results[1])
        assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)
    assert len(traced.records) == 1


def test_reseeding_between_random_ops_is_refused():
    def f(x):
        a = F.dropout(x, 0.5)
        torch.manual_seed(5)  # eager: b draws from seed 5; symbolic: both would draw after the call
        return a + F.dropout(x, 0.5)

    with pytest.raises(SymbolicTraceError, match="changed the state of torch's default random generator"):
        tracejit.trace(f, symbolic=True)(torch.ones(8))


def test_seeding_before_the_first_random_op_is_fine():
    def f(x):
        torch.manual_seed(5)
        return F.dropout(x, 0.5) + torch.rand_like(x)

    x = torch.ones(8)
    assert torch.equal(tracejit.trace(f, symbolic=True)(x), f(x))


# -- what symbolic recording cannot do ------------------------------------------------------------


def test_data_dependent_output_shape_is_refused():
    @tracejit.trace(symbolic=True)
    def f(x):
        return x[x > 0].sum()

    with pytest.raises(SymbolicTraceError, match="the shape of its output depends on the values of its inputs"):
        f(torch.randn(5))


def test_op_without_fake_implementation_is_refused():
    @tracejit.trace(symbolic=True)
    def f(x):
        return no_fake(x) * 2

    with pytest.raises(SymbolicTraceError, match="no fake .meta. implementation.*register_fake"):
        f(torch.randn(3))


def test_changing_the_shape_of_an_input_in_place_is_refused():
    @tracejit.trace(symbolic=True)
    def f(x):
        x.unsqueeze_(0)
        return x * 2

    with pytest.raises(SymbolicTraceError, match="changes the shape or strides of x in place"):
        f(torch.randn(3))


def test_changing_the_shape_of_an_internal_tensor_in_place_works():
    @tracejit.trace(symbolic=True)
    def f(x):
        y = x * 2
        y.unsqueeze_(0).t_()
        return y + 1

    x = torch.randn(3)
    for _ in range(2):
        assert torch.equal(f(x), (x * 2).unsqueeze(0).t() + 1)


def test_mispredicted_strides_are_reported_after_a_correct_run():
    kept = []

    @tracejit.trace(symbolic=True)
    def f(x):
        y = row_major_copy(x) + 1
        kept.append(y)
        return y

    x = torch.randn(3, 4)
    with pytest.raises(SymbolicTraceError, match=r"predicted strides \(1, 3\), the kernel produced \(4, 1\)"):
        f(x)
    assert f.records == []  # the record is not kept...
    assert torch.equal(kept[0], x + 1)  # ...but the values are right (copied across layouts)


def test_outputs_sharing_memory_with_other_values_are_copied_correctly():
    kept = []

    @tracejit.trace(symbolic=True)
    def f(x):
        flat = x.t().reshape(-1)  # clone, then _unsafe_view: the output shares the clone's memory
        kept.append(flat)
        return flat * 2, flat

    x = torch.randn(3, 4)
    doubled, flat = f(x)
    assert torch.equal(flat, x.t().reshape(-1)) and torch.equal(kept[0], flat)
    assert torch.equal(doubled, x.t().reshape(-1) * 2)


def test_mispredicted_shape_stops_the_run():
    @tracejit.trace(symbolic=True)
    def f(x):
        return grows(x) * 2

    with pytest.raises(SymbolicTraceError, match=r"produced cpu float32\[6\], but symbolic recording predicted cpu float32\[3\]"):
        f(torch.randn(3))
