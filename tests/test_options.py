"""One rule for options: a keyword given beside a `config` must agree with it (KDLossConfig.build), for every
entry point that takes both; keywords alone and a config alone still work. The functional losses take a config only:
an option keyword is a TypeError that says how to pass it."""

import pytest
import torch
import torch.nn.functional as F

from liger_patch_kd import (
    FusedLinearJSDLoss,
    FusedLinearTopKKDLoss,
    KDLossConfig,
    fused_linear_jsd,
    fused_linear_topk_kd,
)
from liger_patch_kd import reference as R
from liger_patch_kd.align import CrossTokenizerConfig, fused_linear_cross_tokenizer_kd

from .test_cross_tokenizer_loss import random_case

N, H, V, K = 6, 5, 11, 3


def _tensors():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    h_t = torch.randn(N, H, generator=g, dtype=torch.float64)
    w_t = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N,), generator=g)
    logprobs, ids = F.log_softmax(h_t @ w_t.T, -1).topk(K, -1)
    return h, w, h_t, w_t, labels, ids, logprobs


def _align_call(config=None, **options):
    c = random_case()
    return fused_linear_cross_tokenizer_kd(
        c["h_s"], c["w_s"], c["h_t"], c["w_t"], c["s_labels"], c["t_labels"], c["s_groups"], c["t_groups"],
        c["vocab_map"], c["exact_ok"], config=config, **options,
    )  # fmt: skip


def _entry_points():
    h, w, h_t, w_t, labels, ids, logprobs = _tensors()
    s_logits, t_logits = h @ w.T, h_t @ w_t.T
    return {
        "FusedLinearJSDLoss": lambda config=None, **kw: FusedLinearJSDLoss(config, **kw)(h, w, h_t, w_t, labels),
        "FusedLinearTopKKDLoss": lambda config=None, **kw: FusedLinearTopKKDLoss(config, **kw)(
            h, w, ids, logprobs, labels
        ),
        "reference.generalized_jsd": lambda config=None, **kw: R.generalized_jsd(
            s_logits, t_logits, labels, config=config, **kw
        ),
        "reference.kd_loss": lambda config=None, **kw: R.kd_loss(s_logits, t_logits, labels, config, **kw),
        "reference.topk_kd_loss": lambda config=None, **kw: R.topk_kd_loss(
            s_logits, ids, logprobs, labels, config, **kw
        ),
        "align.fused_linear_cross_tokenizer_kd": _align_call,
    }


ENTRY_POINTS = list(_entry_points())


def _config(name: str, **fields):
    return (CrossTokenizerConfig if name.startswith("align") else KDLossConfig)(**fields)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_a_keyword_that_conflicts_with_the_config_is_refused(name):
    call = _entry_points()[name]
    with pytest.raises(ValueError, match=r"beta=0\.0 conflicts with config\.beta=0\.5; pass one or the other"):
        call(config=_config(name, beta=0.5), beta=0.0)
    with pytest.raises(ValueError, match=r"temperature=1\.0 conflicts with config\.temperature=2\.0"):
        call(config=_config(name, beta=0.5, temperature=2.0), temperature=1.0)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_keywords_alone_config_alone_and_agreeing_keywords_give_one_loss(name):
    call = _entry_points()[name]
    by_config = call(config=_config(name, beta=0.3, temperature=1.5))
    by_keywords = call(beta=0.3, temperature=1.5)
    agreeing = call(config=_config(name, beta=0.3, temperature=1.5), beta=0.3)
    torch.testing.assert_close(by_keywords, by_config, rtol=0, atol=0)
    torch.testing.assert_close(agreeing, by_config, rtol=0, atol=0)
    defaults = call()
    torch.testing.assert_close(defaults, call(config=_config(name)), rtol=0, atol=0)
    assert not torch.allclose(defaults, by_config)  # the options were applied, not dropped


def test_functional_losses_take_their_options_in_one_config():
    from liger_patch_kd import fused_linear_multi_teacher_jsd, fused_linear_sampled_kd, topk_kd_from_logprobs

    h, w, h_t, w_t, labels, ids, logprobs = _tensors()
    counts = torch.ones_like(ids)
    calls = {
        "fused_linear_jsd": lambda **kw: fused_linear_jsd(h, w, h_t, w_t, labels, **kw),
        "fused_linear_topk_kd": lambda **kw: fused_linear_topk_kd(h, w, ids, logprobs, labels, **kw),
        "fused_linear_sampled_kd": lambda **kw: fused_linear_sampled_kd(h, w, ids, counts, logprobs, labels, **kw),
        "fused_linear_multi_teacher_jsd": lambda **kw: fused_linear_multi_teacher_jsd(
            h, w, [h_t], [w_t], torch.ones(1, dtype=torch.float64), labels, **kw
        ),
        "topk_kd_from_logprobs": lambda **kw: topk_kd_from_logprobs(logprobs, logprobs, **kw),
    }
    for name, call in calls.items():
        message = rf"{name}\(\) takes its loss options in one KDLossConfig: pass config=KDLossConfig\(beta=\.\.\.\)"
        with pytest.raises(TypeError, match=message):
            call(beta=0.0)
        with pytest.raises(TypeError, match=r"config=KDLossConfig\(beta=\.\.\., temperature=\.\.\.\)"):
            call(config=KDLossConfig(beta=0.0), temperature=2.0, beta=0.0)
        with pytest.raises(TypeError, match=rf"{name}\(\) got an unexpected keyword argument 'betta'"):
            call(betta=0.0)
        assert torch.isfinite(call(config=KDLossConfig(beta=0.0)))


def test_build_fills_options_the_config_leaves_unset_and_names_unknown_ones():
    assert KDLossConfig.build(KDLossConfig(beta=0.2), vocab_size=7) == KDLossConfig(beta=0.2, vocab_size=7)
    assert KDLossConfig.build(None, beta=None) == KDLossConfig()
    with pytest.raises(ValueError, match=r"vocab_size=6 conflicts with config\.vocab_size=7"):
        KDLossConfig.build(KDLossConfig(vocab_size=7), vocab_size=6)
    with pytest.raises(ValueError, match=r"unknown KDLossConfig option\(s\) \['betta'\]"):
        KDLossConfig.build(None, betta=0.1)
