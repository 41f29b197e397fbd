"""Loaded graphs hand out fresh outputs, respect the aliasing of their inputs, and refuse files
whose handles, roots and inputs do not describe one consistent set of tensors."""


import pytest
import torch
import torch.nn as nn

import tracejit


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
