"""torch.nn.MultiheadAttention and the Transformer encoder layers choose a fused fast path in eval
under no_grad unless a torch function mode is active. Checked calls at the API level run under one,
so every traced call takes the composite path (record/modes.py _composite_attention). Before, the
recording call took the fast path and every later call raised TraceMismatchError at op #0, and
a padding mask crashed the recorder on the fast path's nested tensor."""

import pytest
import torch
import torch.nn as nn

import tracejit


def _composite(module, *args, **kwargs):
    """What the traced call computes: eager with torch's fast path off."""
    setting = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            return module(*args, **kwargs)
    finally:
        torch.backends.mha.set_fastpath_enabled(setting)


def _layer():
    return nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0).eval()


def _encoder():
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2).eval()


def _attention():
    return nn.MultiheadAttention(16, 4, batch_first=True).eval()


def _evaluate(x, *, model):
    with torch.no_grad():
        return model(x)


def _attend(x, *, model):
    with torch.no_grad():
        return model(x, x, x, need_weights=False)[0]


def _evaluate_masked(x, pad, *, model):
    with torch.no_grad():
        return model(x, src_key_padding_mask=pad)


def _mask(batch, tokens, generator):
    lengths = torch.randint(1, tokens + 1, (batch,), generator=generator)
    return torch.arange(tokens)[None, :] >= lengths[:, None]


@pytest.mark.parametrize("without_host", [False, True], ids=["checked", "without_host"])
@pytest.mark.parametrize("case", ["encoder_layer", "attention", "encoder_with_padding"])
def test_attention_modules_in_eval_replay(case, without_host):
    torch.manual_seed(0)
    make, function = {"encoder_layer": (_layer, _evaluate), "attention": (_attention, _attend),
                      "encoder_with_padding": (_encoder, _evaluate_masked)}[case]
    model = make()
    traced = tracejit.trace(function, backend="aten", without_host=without_host)
    generator = torch.Generator().manual_seed(1)
    for i in range(5):
        x = torch.randn(4, 7, 16, generator=generator)
        args = (x, _mask(4, 7, generator)) if case == "encoder_with_padding" else (x,)
        got = traced(*args, model=model)
        if case == "encoder_with_padding":
            want = _composite(model, x, src_key_padding_mask=args[1])
            fast = function(*args, model=model)  # torch's fast path: zeros where padded
            kept = ~args[1]
            torch.testing.assert_close(got[kept], fast[kept])
        else:
            want = _composite(model, x) if case == "encoder_layer" else _composite(model, x, x, x, need_weights=False)[0]
            torch.testing.assert_close(got, function(*args, model=model))  # the fast path agrees up to rounding
        assert torch.equal(got, want), f"call {i}"
    stats = traced.stats
    if without_host:
        assert stats.host_free_calls == 4, stats
    else:
        assert stats.api_replays == 3 and stats.api_fallbacks == 0, stats
    assert torch.backends.mha.get_fastpath_enabled()  # the switch is back


def test_the_fast_path_switch_is_restored_after_a_failing_call():
    model = _layer()

    def broken(x, *, model):
        with torch.no_grad():
            model(x)
        raise ValueError("user error")

    traced = tracejit.trace(broken, backend="aten")
    for _ in range(3):
        with pytest.raises(ValueError, match="user error"):
            traced(torch.randn(2, 3, 16), model=model)
        assert torch.backends.mha.get_fastpath_enabled()


def test_the_users_fast_path_setting_is_left_alone():
    # the composite path is chosen per thread by a torch function mode: torch's process-wide switch
    # is neither read nor written (it was switched off for every traced call, in every thread)
    model = _layer()
    seen = []

    def evaluate(x, *, model):
        seen.append(torch.backends.mha.get_fastpath_enabled())
        with torch.no_grad():
            return model(x)

    traced = tracejit.trace(evaluate, backend="aten")
    for setting in (True, False, True):
        torch.backends.mha.set_fastpath_enabled(setting)
        try:
            for _ in range(2):
                x = torch.randn(2, 3, 16)
                assert torch.equal(traced(x, model=model), _composite(model, x))
            assert torch.backends.mha.get_fastpath_enabled() is setting and set(seen) == {setting}
            seen.clear()
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
