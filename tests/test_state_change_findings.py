"""State changed between calls, or inside a call, that a guard or a stand-in did not see (hunts O
and P): each returned the recorded behaviour instead of the new one. Every test runs an eager
copy beside the traced one, changes both alike, and wants eager's numbers bit for bit
(`backend="aten"`) or a TraceMismatchError."""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import tracejit

pytestmark = pytest.mark.filterwarnings("ignore::tracejit.ReplayLevelWarning",
                                        "ignore::tracejit.HostFreeMissWarning")


def step(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def train(make_opt, function, change=None, after_step=None, calls=6) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = make_opt(model)
    schedule = after_step(opt) if after_step is not None else None
    g = torch.Generator().manual_seed(1)
    for i in range(calls):
        if change is not None and i >= 3:
            change(opt.param_groups[0], i)
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        function(x, y, model=model, opt=opt)
        if schedule is not None:
            schedule.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("case", ["new list", "list changed in place", "fused betas as a list"])
def test_a_param_group_setting_held_in_a_list_is_compared_without_the_host(case):
    """`Rprop(etas=[...])`'s etas and fused Adam's betas set as a list: a list was not guarded."""
    if case == "fused betas as a list":
        def make(m):
            return torch.optim.Adam(m.parameters(), lr=0.01, betas=[0.9, 0.999], fused=True)

        def change(group, i):
            group["betas"] = [0.9 - 0.1 * (i - 2), 0.999]
    else:
        def make(m):
            return torch.optim.Rprop(m.parameters(), lr=0.01, etas=[0.5, 1.2])

        def change(group, i):
            if case == "new list":
                group["etas"] = [0.3, 1.5]
            else:
                group["etas"][1] = 1.5

    traced = tracejit.trace(step, without_host=True, backend="aten")
    for got, want in zip(train(make, traced, change), train(make, step, change)):
        assert torch.equal(got, want)
    assert traced.stats.host_free_calls >= 1


@pytest.mark.parametrize("make", [lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                  lambda m: torch.optim.Adam(m.parameters(), lr=0.01, fused=True)],
                         ids=["sgd", "fused-adam"])
def test_a_numpy_learning_rate_from_a_schedule_is_followed_without_the_host(make):
    """LambdaLR with factors from a float32 numpy array leaves np.float32 learning rates, which
    were neither bound nor guarded: the recorded rate stayed."""
    factors = np.linspace(1.0, 0.1, 10, dtype=np.float32)

    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: factors[epoch])

    traced = tracejit.trace(step, without_host=True, backend="aten")
    for got, want in zip(train(make, traced, after_step=schedule, calls=8), train(make, step, after_step=schedule, calls=8)):
        assert torch.equal(got, want)
    assert traced.stats.host_free_calls + traced.stats.checked_replays >= 6  # replayed, not eager


class Mode(enum.Enum):
    SUM = 1
    MEAN = 2


class Settings(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 4)
        self.out_dtype = torch.float32
        self.mode = Mode.SUM
        self.keep = slice(0, 2)
        self.dims = range(1, 2)
        self.unflatten = nn.Unflatten(1, torch.Size([2, 1]))

    def forward(self, x):
        y = self.lin(x)[:, self.keep].to(self.out_dtype)
        r = tuple(self.dims)
        y = y.sum(r, keepdim=True) if self.mode is Mode.SUM else y.mean(r, keepdim=True)
        return self.unflatten(y.expand(-1, 2))


@pytest.mark.parametrize("without_host", [False, True])
@pytest.mark.parametrize("change", ["out_dtype", "mode", "keep", "dims", "unflatten"])
def test_module_settings_of_every_immutable_kind_are_compared(change, without_host):
    """A dtype, an enum member, a slice, a range or a torch.Size held by a module (nn.Unflatten's
    size) was not compared without the host: the recorded program's dtype, shape or values came back."""
    new = {"out_dtype": torch.float64, "mode": Mode.MEAN, "keep": slice(1, 3), "dims": range(0, 1),
           "unflatten": torch.Size([1, 2])}[change]

    torch.manual_seed(0)
    model = Settings()
    traced = tracejit.trace(infer, without_host=without_host, backend="aten")

    def apply():
        if change == "unflatten":
            model.unflatten.unflattened_size = new
        else:
            setattr(model, change, new)

    infer_around_a_change(traced, torch.randn(4, 5), model, apply, calls=5, same_layout=True)
    assert traced.stats.host_free_calls if without_host else traced.stats.api_replays


def test_a_method_shadowed_on_a_torch_module_instance_is_seen_by_checked_calls():
    """`conv._conv_forward = ...` (a LoRA-style patch) after recording: the module stand-in
    answered the recorded convolution."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU())

    traced = tracejit.trace(infer, backend="aten")
    x = torch.randn(1, 2, 6, 6)
    for _ in range(3):
        assert torch.equal(traced(x, model=model), infer(x, model=model))
    assert traced.stats.module_stand_ins >= 1
    model[0]._conv_forward = lambda inp, w, b: F.conv2d(inp, w * 2, b)
    for _ in range(2):
        try:
            got = traced(x, model=model)
        except tracejit.TraceMismatchError:
            continue
        assert torch.equal(got, infer(x, model=model))


USE_MATH = [False]


def attend(q, k, v):
    if USE_MATH[0]:
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v)


def test_attention_kernels_switched_inside_the_function_are_seen():
    """`sdpa_kernel(SDPBackend.MATH)` entered inside the function on later calls: the checked call
    kept the recorded flash kernel's op."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 64, 32).bfloat16() * 3 for _ in range(3))
    traced = tracejit.trace(attend, backend="aten")
    USE_MATH[0] = False
    try:
        for i in range(6):
            USE_MATH[0] = i >= 3
            try:
                got = traced(q, k, v)
            except tracejit.TraceMismatchError:
                continue
            assert torch.equal(got, attend(q, k, v)), i
    finally:
        USE_MATH[0] = False
    assert traced.stats.checked_replays >= 2


HIGH_PRECISION = [False]


def factory(x):
    if HIGH_PRECISION[0]:
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return x + torch.full((4,), 16777217.0)
        finally:
            torch.set_default_dtype(before)
    return x + torch.full((4,), 16777217.0)


def promoted(x):
    if HIGH_PRECISION[0]:
        before = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return x * 0.1 + 1
        finally:
            torch.set_default_dtype(before)
    return x * 0.1 + 1


SWITCHED_DEFAULT_DTYPE = {
    # `torch.full` kept the recorded float32 result (16777216 for 16777217)
    "a factory": (factory, torch.zeros(4, dtype=torch.float64)),
    # hunt W F2: `int_tensor * 0.1` got float32 values (16777216.2 as 1677721.625) without a word
    "an integer promoted": (promoted, torch.arange(16777210, 16777214)),
}


@pytest.mark.parametrize("backend", ["aten", "c"])
@pytest.mark.parametrize("case", list(SWITCHED_DEFAULT_DTYPE))
@pytest.mark.parametrize("without_host", [False, True])
def test_the_default_dtype_switched_inside_the_function_is_a_mismatch(without_host, case, backend):
    """`torch.set_default_dtype(torch.float64)` inside the call on later calls, before an op whose
    dtype the default dtype decides."""
    function, x = SWITCHED_DEFAULT_DTYPE[case]
    traced = tracejit.trace(function, without_host=without_host, backend=backend)
    raised = 0
    try:
        for i in range(6):
            HIGH_PRECISION[0] = i >= 3
            try:
                got = traced(x)
            except tracejit.TraceMismatchError as error:
                assert "default dtype" in str(error) and "x.double()" in str(error)
                raised += 1
                continue
            assert torch.equal(got, function(x)), i
    finally:
        HIGH_PRECISION[0] = False
    assert raised >= 1


def decay_by_hand(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    lr = opt.param_groups[0]["lr"]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 - lr * 0.5)
    opt.step()
    opt.zero_grad()
    return loss


def loss_scaled_by_lr(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y) * (opt.param_groups[0]["lr"] / 0.1)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("function", [decay_by_hand, loss_scaled_by_lr])
@pytest.mark.parametrize("make", [lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                  lambda m: torch.optim.Adam(m.parameters(), lr=0.1, fused=True)],
                         ids=["sgd", "fused-adam"])
def test_a_learning_rate_the_function_reads_itself_follows_the_schedule_without_the_host(function, make):
    """The learning rate is bound into `opt.step()`'s ops; the function's own use of it (its decay,
    a loss scaled by it) kept the recorded number while a scheduler changed it."""
    def run(step):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        opt = make(model)
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.6)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(6):
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
            losses.append(step(x, y, model=model, opt=opt))
            schedule.step()
        return [*model.parameters(), *losses]

    traced = tracejit.trace(function, without_host=True, backend="aten")
    for got, want in zip(run(traced), run(function)):
        assert torch.equal(got.detach(), want.detach())
    assert traced.stats.host_free_calls + traced.stats.checked_replays >= 4


def accumulate(x, y, *, model, opt, do_step):
    group = opt.param_groups[0]
    penalty = sum((p ** 2).sum() for p in model.parameters())
    loss = F.cross_entropy(model(x), y) + group["l2"] * penalty
    (loss / 2).backward()
    if do_step:
        opt.step()
        opt.zero_grad()
    return loss


def test_settings_an_accumulating_call_reads_are_compared_without_the_host():
    """The trace of the calls that do not step compared no param-group value: an `l2` coefficient
    kept in the group and read by the function stayed the recorded one."""
    def run(step):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        losses = []
        for i in range(10):
            opt.param_groups[0]["l2"] = 0.01 * (i + 1)
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
            losses.append(step(x, y, model=model, opt=opt, do_step=i % 2 == 1))
        return [*model.parameters(), *losses]

    traced = tracejit.trace(accumulate, without_host=True, backend="aten")
    for got, want in zip(run(traced), run(accumulate)):
        assert torch.equal(got.detach(), want.detach())
    assert traced.stats.host_free_calls + traced.stats.checked_replays >= 6


def infer(x, *, model):
    with torch.no_grad():
        return model(x)


def infer_around_a_change(traced, x, model, change, calls, at=3, same_layout=False):
    """Call `traced` `calls` times, `change()` before call `at`, comparing with eager after each call
    that does not diverge loudly (a TraceMismatchError is the check that caught the change)."""
    for i in range(calls):
        if i == at:
            change()
        try:
            got = traced(x, model=model)
        except tracejit.TraceMismatchError:
            continue
        want = infer(x, model=model)
        if same_layout:
            assert got.dtype == want.dtype and got.shape == want.shape, i
        assert torch.equal(got, want), i


def test_a_parameterless_module_swapped_for_a_hooked_one_of_its_type_is_seen_without_the_host():
    """`model[1] = tanh_with_a_hook`, the hook registered before tracing: a parameterless child is
    compared by type, and its empty hook dicts only when a hook was registered since binding."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    model.load_state_dict(eager.state_dict())
    hooked = [nn.Tanh(), nn.Tanh()]
    for module in hooked:
        module.register_forward_hook(lambda m, i, o: o * 0 + 5)
    traced = tracejit.trace(infer, without_host=True, backend="aten")
    x = torch.randn(4, 5)
    for i in range(5):
        if i == 3:
            eager[1], model[1] = hooked
        try:
            got = traced(x, model=model)
        except tracejit.TraceMismatchError:
            continue
        assert torch.equal(got, infer(x, model=eager)), i
    assert traced.stats.host_free_calls >= 2


BASE = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
ACTIVATIONS = {"tanh": nn.Tanh(), "sigmoid": nn.Sigmoid()}
ACT = ACTIVATIONS["tanh"]


class Tempered(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 6), nn.Tanh())
        self.head = nn.Linear(6, 3)
        self.temperature = 1.0


TEMPERED = Tempered()


def through_global(x):
    with torch.no_grad():
        return ACT(BASE(x)) / TEMPERED.temperature + TEMPERED.head(TEMPERED.body(x))


class Trainer:
    pass


def through_object(x, *, trainer):
    with torch.no_grad():
        return trainer.model(x)


@pytest.mark.parametrize("change", ["global activation", "global module setting", "object's model"])
def test_modules_of_globals_and_of_objects_are_the_same_and_unchanged_without_the_host(change):
    """A global rebound to another live module (`ACT = ACTIVATIONS["sigmoid"]`), a plain setting
    of a global module whose forward the function does not call (`TEMPERED.temperature`), and
    `trainer.model` rebound to another Sequential over the same layers: the program of the old
    ones ran."""
    global ACT
    x = torch.randn(4, 5)
    trainer = Trainer()
    trainer.model = BASE
    if change == "object's model":
        traced = tracejit.trace(through_object, without_host=True, backend="aten")
        call, eager = (lambda: traced(x, trainer=trainer)), (lambda: through_object(x, trainer=trainer))
    else:
        traced = tracejit.trace(through_global, without_host=True, backend="aten")
        call, eager = (lambda: traced(x)), (lambda: through_global(x))
    try:
        for i in range(5):
            if i == 3:
                if change == "global activation":
                    ACT = ACTIVATIONS["sigmoid"]
                elif change == "global module setting":
                    TEMPERED.temperature = 2.0
                else:
                    trainer.model = nn.Sequential(*BASE, nn.Softmax(-1))
            try:
                got = call()
            except tracejit.TraceMismatchError:
                continue
            assert torch.equal(got, eager()), i
    finally:
        ACT, TEMPERED.temperature = ACTIVATIONS["tanh"], 1.0
    assert traced.stats.host_free_calls >= 2


@pytest.mark.parametrize("patched", ["gelu", "relu"])
def test_a_torch_function_patched_under_a_module_stand_in_is_followed(patched, monkeypatch):
    """`F.gelu = mine` between calls: nn.GELU's stand-in answered the recorded gelu."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU() if patched == "gelu" else nn.ReLU())
    traced = tracejit.trace(infer, backend="aten")
    x = torch.randn(3, 4)
    for _ in range(3):
        assert torch.equal(traced(x, model=model), infer(x, model=model))
    assert traced.stats.module_stand_ins >= 1
    monkeypatch.setattr(F, patched, lambda t, *a, **k: torch.tanh(t))
    for _ in range(2):
        try:
            got = traced(x, model=model)
        except tracejit.TraceMismatchError:
            continue
        assert torch.equal(got, infer(x, model=model))


def in_float64(x):
    torch.set_default_dtype(torch.float64)
    try:
        return x.double() * torch.full((4,), 0.1)
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("without_host", [False, True])
def test_a_factory_under_a_default_dtype_the_function_sets_makes_that_dtype(without_host):
    """The function sets float64 as the default on every call: the program, run after it restored
    float32, made `torch.full((4,), 0.1)` in float32 (0.1 off by 1.5e-9)."""
    traced = tracejit.trace(in_float64, backend="aten", without_host=without_host)
    x = torch.randn(4)
    for _ in range(5):
        assert torch.equal(traced(x), in_float64(x))
    assert traced.stats.host_free_calls if without_host else traced.stats.api_replays


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.temperature = 1.0


HEAD = Head()
HEAD_LINEAR = HEAD.lin


def scaled(logits):
    return logits / HEAD.temperature


def through_helper(x):
    with torch.no_grad():
        return scaled(HEAD_LINEAR(x)).softmax(-1)


def test_a_global_module_a_helper_of_the_function_reads_is_guarded_without_the_host():
    traced = tracejit.trace(through_helper, without_host=True, backend="aten")
    x = torch.randn(2, 4)
    try:
        for i in range(6):
            if i == 3:
                HEAD.temperature = 2.0
            assert torch.equal(traced(x), through_helper(x)), i
    finally:
        HEAD.temperature = 1.0
    assert traced.stats.host_free_calls >= 3


class Pick(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.keep = [0, 2]
        self.cfg = {"scale": 2.0}

    def forward(self, x):
        return self.lin(x)[:, self.keep] * self.cfg["scale"]


@pytest.mark.parametrize("change", ["rebind list", "list in place", "dict in place"])
def test_list_and_dict_settings_of_a_module_are_compared_by_value_without_the_host(change):
    torch.manual_seed(0)
    model = Pick()
    traced = tracejit.trace(infer, without_host=True, backend="aten")

    def apply():
        if change == "rebind list":
            model.keep = [1, 3]
        elif change == "list in place":
            model.keep[0] = 3
        else:
            model.cfg["scale"] = 5.0

    infer_around_a_change(traced, torch.randn(2, 4), model, apply, calls=6)
    assert traced.stats.host_free_calls >= 2


def test_a_method_patched_on_a_torch_module_class_is_seen_by_checked_calls():
    """`nn.Conv2d._conv_forward = ...` after recording: the stand-in answered the recorded conv."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(18, 4))
    traced = tracejit.trace(infer, backend="aten")
    x = torch.randn(1, 1, 5, 5)
    original = nn.Conv2d._conv_forward
    try:
        for i in range(6):
            if i == 3:
                nn.Conv2d._conv_forward = lambda self, x, w, b: original(self, x, w * 2, b)
            try:
                got = traced(x, model=model)
            except tracejit.TraceMismatchError:
                continue
            assert torch.equal(got, infer(x, model=model)), i
    finally:
        nn.Conv2d._conv_forward = original
    assert traced.stats.module_stand_ins >= 1


def scaled_step(x, *, model, opt):
    loss = model(x).square().mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], 1.0)
    opt.step()
    opt.zero_grad()
    return loss


class Tagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.device = x.device  # made anew by every forward, equal
        self.last_shape = x.shape
        return self.lin(x)


def test_unchanged_programs_keep_their_fast_paths():
    """What the checks above must not catch: `param_groups` read only for its parameters (with a
    per-step schedule), a tag set on a module (`torch.compile(model)` sets one), and a device or
    shape a forward sets to an equal new object."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 20)
    traced = tracejit.trace(scaled_step, without_host=True, backend="aten")
    for _ in range(6):
        traced(torch.randn(4, 8), model=model, opt=opt)
        schedule.step()
    assert traced.stats.host_free_calls >= 4 and traced.stats.host_free_misses == 0

    checked = tracejit.trace(scaled_step, backend="aten")
    for i in range(6):
        if i == 2:
            model.extra_tag = "encoder"
        checked(torch.randn(4, 8), model=model, opt=opt)
    assert checked.stats.module_stand_ins >= 4

    tagged = Tagged()
    opt = torch.optim.SGD(tagged.parameters(), lr=0.1)
    traced = tracejit.trace(scaled_step, without_host=True, backend="aten")
    for _ in range(6):
        traced(torch.randn(3, 4), model=tagged, opt=opt)
        with torch.no_grad():
            tagged(torch.randn(3, 4))
    assert traced.stats.host_free_calls >= 4


def promoted_in_float64(x):
    torch.set_default_dtype(torch.float64)
    try:
        return x * 0.1 + 1, x / 3
    finally:
        torch.set_default_dtype(torch.float32)


def test_an_integer_promoted_under_a_default_dtype_the_function_sets_is_refused_by_name():
    """The function sets float64 on every call: the program, run after it, computed the promotion
    in the caller's float32 (every backend, aten's too). Refused when recorded, naming the op."""
    traced = tracejit.trace(promoted_in_float64)
    with pytest.raises(NotImplementedError, match=r"op #0 aten.mul.Tensor .* promotes an integer tensor to the default "
                                                  r"dtype, torch.float64, which the traced function set itself"):
        traced(torch.arange(4))
    assert torch.get_default_dtype() is torch.float32
