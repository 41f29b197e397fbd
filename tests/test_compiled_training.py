"""Traced training at every opt_level, checked and without_host, against eager."""

import pytest
import torch
from models import assert_same_state, batch, make_model, train_side_by_side
from side_by_side import assert_replayed

import tracejit


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
@pytest.mark.parametrize("opt_level", [0, 1, 2, 3])
@pytest.mark.parametrize("kind, opt_name", [("mlp", "adam_fused"), ("cnn", "sgd_momentum"),
                                            ("transformer", "adamw_fused")])
def test_training_at_every_opt_level(kind, opt_name, opt_level, without_host):
    (model_a, opt_a), (model_b, opt_b), _ = train_side_by_side(kind, opt_name, opt_level=opt_level,
                                                               without_host=without_host)
    assert_same_state(model_a, opt_a, model_b, opt_b, exact=True)


@pytest.mark.parametrize("opt_level", [0, 1, 2, 3])
def test_inference_at_every_opt_level(opt_level):
    model = make_model("cnn").eval()

    def infer(x, *, model):
        with torch.no_grad():
            return model(x).softmax(-1)

    traced = tracejit.trace(infer, opt_level=opt_level, without_host=True)
    for i in range(4):
        x, _ = batch("cnn", i)
        assert torch.equal(traced(x, model=model), infer(x, model=model))
    assert_replayed(traced, 4)
