"""Returned structures (hunt I f1, f2, f3): empty tuples, container subclasses (namedtuple,
OrderedDict, torch.return_types, plain subclasses) and dict keys without a literal form come back
from every call as eager returns them, in checked calls (C and aten backends) and without the host."""

import collections
import enum

import pytest
import torch
import torch.nn as nn

import tracejit
from tracejit.errors import HostDependencyError

# checked calls of a function returning a container subclass or non-string dict keys stay at the aten level
pytestmark = pytest.mark.filterwarnings("ignore::tracejit.ReplayLevelWarning")

Out = collections.namedtuple("Out", "loss logits")


class Split(enum.Enum):
    TRAIN = 1
    EVAL = 2


class TensorList(list):
    pass


class TensorDict(dict):
    pass


class Pair(tuple):
    pass


class Tagged(dict):
    def __init__(self, *args, tag=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = tag


MODES = {"checked": {}, "aten": {"backend": "aten"}, "without_host": {"without_host": True}}

CASES = {
    "empty_tuple": lambda x: (x * 2, ()),
    "empty_nested": lambda x: [x + 1, ((),), {"a": ()}, []],
    "only_empty": lambda x: (),
    "namedtuple": lambda x: Out(x.sum(), x * 2),
    "nested_namedtuple": lambda x: {"out": Out(x.mean(), [x * 3]), "n": (Out(x, x + 1),)},
    "ordered_dict": lambda x: collections.OrderedDict(b=x * 2, a=x + 1),
    "return_types": lambda x: torch.max(x * 2, 0),
    "list_subclass": lambda x: TensorList([x * 2, x - 1]),
    "dict_subclass": lambda x: TensorDict(a=x * 2),
    "tuple_subclass": lambda x: Pair((x * 2, ())),
    "dtype_key": lambda x: {torch.float32: x * 2},
    "enum_key": lambda x: {Split.TRAIN: x * 2, Split.EVAL: x + 1},
    "class_key": lambda x: {int: x * 2, (1, "a"): x - 1, None: x * 3},
    "keys_in_ordered_dict": lambda x: collections.OrderedDict([(Split.EVAL, x), (torch.int64, x * 2)]),
}


def assert_same(got, expected, path="output"):
    assert type(got) is type(expected), f"{path}: {type(got).__name__}, eager {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected, msg=path)
    elif isinstance(expected, dict):
        assert list(got) == list(expected), path
        for key in expected:
            assert_same(got[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (tuple, list)):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, f"{path}[{i}]")
    else:
        assert got == expected, path


def jit_ran(traced, mode):
    stats = traced.stats
    if mode == "without_host":
        return stats.host_free_calls > 0
    return stats.api_replays + stats.checked_replays > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_returned_structure_matches_eager(case, mode):
    fn = CASES[case]
    traced = tracejit.trace(fn, **MODES[mode])
    for call in range(4):
        x = torch.randn(3)
        assert_same(traced(x), fn(x), f"call {call}: output")
    assert jit_ran(traced, mode), traced.stats


@pytest.mark.parametrize("mode", MODES)
def test_training_step_returning_namedtuple(mode):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    twin = nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin))

    def step(x, y, model, opt):
        opt.zero_grad()
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        return Out(loss.detach(), collections.OrderedDict(logits=logits.detach(), by_split={Split.TRAIN: loss.detach()}))

    traced = tracejit.trace(step, **MODES[mode])
    for call in range(4):
        x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
        got = traced(x, y, model=model, opt=opt)
        expected = step(x, y, twin, twin_opt)
        assert_same(got, expected, f"call {call}: output")
        assert got.loss.shape == ()
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p, q)
    assert jit_ran(traced, mode), traced.stats


@pytest.mark.parametrize("make", [lambda x: collections.defaultdict(list, a=x * 2),
                                  lambda x: Tagged(a=x * 2, tag="t")], ids=["defaultdict", "own_init"])
def test_container_that_cannot_be_rebuilt(make):
    """Checked calls run the function and return its container; without the host, a class with a
    constructor of its own (or an object with attributes) is refused, never returned as a dict."""
    for mode in ("checked", "aten"):
        traced = tracejit.trace(make, **MODES[mode])
        for _ in range(3):
            x = torch.randn(3)
            assert_same(traced(x), make(x))
        assert jit_ran(traced, mode)
    traced = tracejit.trace(make, without_host=True)
    with pytest.raises(HostDependencyError, match=r"returns a (defaultdict|Tagged), which a call without the "
                                                  r"function cannot make again"):
        for _ in range(3):
            result = traced(torch.randn(3))
            assert type(result) is type(make(torch.randn(3)))


@pytest.mark.parametrize("case", ["namedtuple", "ordered_dict", "enum_key", "empty_tuple"])
def test_dump_returns_outputs_flat(case, tmp_path):
    """A dumped graph returns its output tensors as a tuple, whatever container held them."""
    fn = CASES[case]
    traced = tracejit.trace(fn, capture_as_const=True)
    x = torch.randn(3)
    traced(x)
    traced.dump(str(tmp_path / "g.tjit"))
    loaded = tracejit.load(str(tmp_path / "g.tjit"))
    expected = fn(x)
    flat = list(expected.values()) if isinstance(expected, dict) else [v for v in expected if isinstance(v, torch.Tensor)]
    got = loaded(x)
    assert type(got) is tuple and len(got) == len(flat)
    for g, e in zip(got, flat):
        torch.testing.assert_close(g, e)
