"""torch.nn's attention and transformer layers answered whole at the API level (module stand-ins):
parity with eager over several training and inference calls, and settings changed between calls."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tracejit


def _encoder(**layer):
    torch.manual_seed(0)
    encoder_layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, **layer)
    return nn.Sequential(nn.TransformerEncoder(encoder_layer, 2, enable_nested_tensor=False), nn.Linear(32, 3))


def _train_step(x, y, mask, *, model, opt):
    hidden = model[0](x, src_key_padding_mask=mask)
    loss = F.cross_entropy(model[1](hidden.mean(1)), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("layer", [{}, {"norm_first": True, "activation": "gelu"}, {"dropout": 0.0}],
                         ids=["post_norm", "pre_norm_gelu", "no_dropout"])
def test_a_transformer_encoder_trains_as_in_eager_with_its_layers_stood_in(layer):
    model_a = _encoder(**layer)
    model_b = copy.deepcopy(model_a)
    opt_a, opt_b = (torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (model_a, model_b))
    traced = tracejit.trace(_train_step, backend="aten")
    for i in range(6):
        x, y = torch.randn(4, 10, 32), torch.randint(0, 3, (4,))
        mask = torch.zeros(4, 10, dtype=torch.bool)
        mask[:, 7 + i % 3:] = True
        torch.manual_seed(i)
        want = _train_step(x, y, mask, model=model_a, opt=opt_a)
        torch.manual_seed(i)
        got = traced(x, y, mask, model=model_b, opt=opt_b)
        assert torch.equal(want, got), i
        for p, q in zip(model_a.parameters(), model_b.parameters()):
            assert torch.equal(p, q), i
    assert traced.stats.module_stand_ins >= 2 and traced.stats.api_replays >= 2
    assert not _refused(traced)


def _refused(traced):
    """The module and optimizer calls the API level could not answer whole, with the reasons."""
    return {k: v for e in traced._entries() if e.api is not None for k, v in e.api.stand_ins_refused.items()}


def _infer(x, *, model):
    with torch.no_grad():
        return model(x)


def test_attention_settings_changed_between_calls_are_followed():
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0), 1,
                                  enable_nested_tensor=False)
    model.train()  # no fast path: the same ops in eager and recorded
    traced = tracejit.trace(_infer)
    x = torch.randn(2, 6, 32)
    for i in range(8):
        if i == 4:
            model.layers[0].activation = F.gelu  # another function kept as the setting
        if i == 6:
            model.layers[0].norm_first = True
        want = _infer(x, model=model)
        try:
            got = traced(x, model=model)
        except tracejit.TraceMismatchError:
            continue  # loud: the function ran and dispatched other ops
        assert torch.allclose(want, got, atol=1e-6), i
    assert traced.stats.module_stand_ins >= 2 and not _refused(traced)


def test_multihead_attention_stood_in_with_masks_and_weights():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 2, batch_first=True)

    def attend(q, k, *, mha):
        out, weights = mha(q, k, k, need_weights=True)
        return out.sum() + weights.sum()

    def step(q, k, *, mha, opt):
        loss = attend(q, k, mha=mha)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    mha_b = copy.deepcopy(mha)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (mha, mha_b))
    traced = tracejit.trace(step, backend="aten")
    for i in range(6):
        q, k = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
        assert torch.equal(step(q, k, mha=mha, opt=opt_a), traced(q, k, mha=mha_b, opt=opt_b)), i
        for p, r in zip(mha.parameters(), mha_b.parameters()):
            assert torch.equal(p, r), i
    assert traced.stats.module_stand_ins >= 2 and not _refused(traced)


_SLOPE = [0.1]


def _leaky(x):
    return F.leaky_relu(x, _SLOPE[0])


def test_a_layer_with_an_activation_of_yours_is_not_answered_whole():
    # the stand-in compared the function by identity and skipped what it reads (a global slope)
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0,
                                                             activation=_leaky), 1, enable_nested_tensor=False).train()
    traced = tracejit.trace(_infer)
    x = torch.randn(2, 6, 32)
    for i in range(7):
        _SLOPE[0] = 0.1 if i < 4 else 3.0
        assert torch.allclose(traced(x, model=model), _infer(x, model=model), atol=1e-6), i
    assert traced.stats.checked_replays >= 4


def test_a_layer_method_patched_on_the_class_after_recording_is_seen():
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0), 1,
                                  enable_nested_tensor=False).train()
    traced = tracejit.trace(_infer)
    x = torch.randn(2, 6, 32)
    original = nn.TransformerEncoderLayer._sa_block
    try:
        for i in range(7):
            if i == 4:
                nn.TransformerEncoderLayer._sa_block = lambda self, x, *args, **kwargs: torch.zeros_like(x)
            want = _infer(x, model=model)
            try:
                got = traced(x, model=model)
            except tracejit.TraceMismatchError:
                continue  # loud: the function ran and dispatched other ops
            assert torch.allclose(got, want, atol=1e-6), i
    finally:
        nn.TransformerEncoderLayer._sa_block = original
