"""A function that sets the random number generator's state around its random ops:
`torch.utils.checkpoint` saves the state in forward and restores it in backward to recompute
dropout with the same mask. A program run apart from the function draws every random number in
one stream, so the recomputed mask differed and the gradients were silently wrong under
without_host and symbolic recording. Checked calls run the function around every random op and
stay exact; the other modes refuse, naming the call (record/rng.py)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import tracejit


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.block = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.GELU())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


def step(x, y, *, model, opt):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def twins(reentrant: bool):
    torch.manual_seed(0)
    model_a = Checkpointed(reentrant)
    model_b = copy.deepcopy(model_a)
    return [(m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) for m in (model_a, model_b)]


def batch(i: int, reentrant: bool):
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, 8, generator=g, requires_grad=reentrant), torch.randint(0, 3, (6,), generator=g)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_dropout_in_checked_replay_is_bitwise_eager(reentrant):
    (model_a, opt_a), (model_b, opt_b) = twins(reentrant)
    traced = tracejit.trace(step, backend="aten")
    with pytest.warns(tracejit.ReplayLevelWarning):
        for i in range(5):
            x, y = batch(i, reentrant)
            torch.manual_seed(i)
            want = step(x, y, model=model_a, opt=opt_a)
            torch.manual_seed(i)
            assert torch.equal(traced(x, y, model=model_b, opt=opt_b), want), i
            for p, q in zip(model_a.parameters(), model_b.parameters()):
                assert torch.equal(p, q), i
    stats = traced.stats
    assert stats.checked_replays + stats.rerecords == 4 and stats.records == 1


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_without_host_refuses_and_names_the_rng_call(reentrant):
    (model, opt), _ = twins(reentrant)
    traced = tracejit.trace(step, without_host=True, backend="aten")
    for i in range(2):  # the record, and the re-record of SGD's lazy momentum buffers
        traced(*batch(i, reentrant), model=model, opt=opt)
    with pytest.raises(tracejit.HostDependencyError, match=r"random number generator's state \(torch\.set_rng_state\(\)"):
        traced(*batch(2, reentrant), model=model, opt=opt)


def test_symbolic_recording_refuses_and_names_the_rng_call():
    (model, opt), _ = twins(False)
    traced = tracejit.trace(step, symbolic=True, backend="aten")
    with pytest.raises(tracejit.SymbolicTraceError, match="random number generator's state"):
        traced(*batch(0, False), model=model, opt=opt)


def test_checkpoint_without_random_ops_still_runs_without_host():
    # the state is read and restored, but nothing draws: the program is exact
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 16), nn.GELU())
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            return self.head(checkpoint(self.block, x, use_reentrant=False))

    torch.manual_seed(0)
    model_a = Plain()
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model_a, model_b))
    traced = tracejit.trace(step, without_host=True, backend="aten")
    for i in range(5):
        x, y = batch(i, False)
        assert torch.equal(traced(x, y, model=model_b, opt=opt_b), step(x, y, model=model_a, opt=opt_a))
    assert traced.stats.host_free_calls >= 3


def test_without_host_refuses_a_seed_set_before_the_random_ops():
    # skipping the function skips the seed: the program would draw from wherever the stream is
    def f(x, *, seed):
        torch.manual_seed(seed)
        return F.dropout(x, 0.5)

    traced = tracejit.trace(f, without_host=True)
    traced(torch.ones(8), seed=0)
    with pytest.raises(tracejit.HostDependencyError, match=r"torch\.manual_seed\(\)"):
        traced(torch.ones(8), seed=1)


def test_checked_replay_follows_a_seed_set_before_the_random_ops():
    def f(x, *, seed):
        torch.manual_seed(seed)
        return F.dropout(x, 0.5) + torch.rand_like(x)

    traced = tracejit.trace(f)
    for seed in (0, 1, 1, 2, 0):
        assert torch.equal(traced(torch.ones(8), seed=seed), f(torch.ones(8), seed=seed)), seed


# -- ways of moving the generator that no patched torch function sees (found by review) ------------

def same_mask_twice(x):
    """The same dropout mask twice, by restoring the generator through its own methods."""
    state = torch.default_generator.get_state()
    a = F.dropout(x, 0.5)
    torch.default_generator.set_state(state)
    return a, F.dropout(x, 0.5)


def reseeded_midway(x):
    a = F.dropout(x, 0.5)
    torch.default_generator.manual_seed(7)
    return a, torch.rand(3)


def drawn_from(x, *, gen):
    return F.dropout(x, 0.5) + torch.rand(x.shape, generator=gen)


def test_checked_replay_follows_a_state_restored_by_the_generators_own_methods():
    traced = tracejit.trace(same_mask_twice)
    x = torch.ones(32)
    for seed in range(6):
        torch.manual_seed(seed)
        expected, after = same_mask_twice(x), torch.get_rng_state()
        torch.manual_seed(seed)
        got = traced(x)
        assert torch.equal(got[0], got[1]) and all(map(torch.equal, got, expected)), seed
        assert torch.equal(torch.get_rng_state(), after), seed
    assert traced.stats.checked_replays >= 4


@pytest.mark.parametrize("function", [same_mask_twice, reseeded_midway], ids=["set_state", "manual_seed"])
def test_without_host_refuses_a_generator_moved_by_its_own_methods(function):
    traced = tracejit.trace(function, without_host=True)
    x = torch.ones(32)
    with pytest.raises(tracejit.HostDependencyError, match="the generator's state set before aten"):
        for _ in range(3):
            traced(x)


def test_without_host_checks_the_generator_given_by_keyword():
    """One generator for every call is drawn on without the host; a new one per call made the
    program keep drawing from the recorded one. Now that call runs the function, whose checked
    replay names the other generator, as a checked call does."""
    traced = tracejit.trace(drawn_from, without_host=True)
    x = torch.ones(8)
    shared, twin = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for i in range(4):
        torch.manual_seed(i)
        expected = drawn_from(x, gen=twin)
        torch.manual_seed(i)
        assert torch.equal(traced(x, gen=shared), expected), i
    assert traced.stats.host_free_calls >= 2
    with pytest.raises(tracejit.TraceMismatchError, match="generator: <torch._C.Generator object"):
        traced(x, gen=torch.Generator().manual_seed(100))


def reseeds_its_generator(x, *, gen):
    a = torch.rand(x.shape, generator=gen)
    gen.manual_seed(7)
    return a + torch.rand(x.shape, generator=gen)


def test_without_host_refuses_a_generator_reseeded_between_its_draws():
    traced = tracejit.trace(reseeds_its_generator, without_host=True)
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(tracejit.HostDependencyError, match="the state of a torch.Generator set before aten"):
        for _ in range(3):
            traced(torch.ones(4), gen=gen)
