"""The cross-tokenizer loss with the teacher given as top-k log-probs (a store or a server): fused against the
reference in float64 for every kind, and with K = V_t against the in-process teacher (an exact reconstruction)."""

from __future__ import annotations

import math

import pytest
import torch

from liger_patch_kd.align import CrossTokenizerConfig, fused_linear_cross_tokenizer_topk_kd
from liger_patch_kd.align import reference as xref
from liger_patch_kd.conventions import dense_topk_teacher

from .test_cross_tokenizer_loss import fused_loss, grads, random_case, reference_loss

KINDS = ["uld", "exact", "hybrid", "next_byte", "chain"]


def teacher_topk(c, k: int, seed: int = 0, padding: bool = True):
    """The in-process teacher's top-k at T = 1, slots shuffled, a few of them padding (-1 / -inf, and vLLM's
    -9999 with a real id) when `padding`."""
    log_p = torch.log_softmax(c["h_t"].double() @ c["w_t"].double().T, dim=-1)
    values, ids = log_p.topk(k, dim=-1)
    g = torch.Generator().manual_seed(seed)
    order = torch.argsort(torch.rand(values.shape, generator=g), dim=-1)
    values, ids = values.gather(-1, order), ids.gather(-1, order)
    if padding:
        drop = torch.rand(values.shape, generator=g) < 0.25
        ids = torch.where(drop, -1, ids)
        values = torch.where(drop, -math.inf, values)
        values[0, 2, 0] = -9999.0  # a placeholder log-prob on a real id: padding too
    return ids, values


def topk_fused(c, ids, logprobs, cfg, **kw):
    return fused_linear_cross_tokenizer_topk_kd(
        c["h_s"], c["w_s"], ids, logprobs, c["s_labels"], c["t_labels"], c["s_groups"], c["t_groups"],
        c["vocab_map"], c["exact_ok"], config=cfg, student_bias=c["b_s"], **kw,
    )  # fmt: skip


def topk_reference(c, ids, logprobs, cfg):
    s_logits = c["h_s"] @ c["w_s"].T + (0 if c["b_s"] is None else c["b_s"])
    return xref.cross_tokenizer_topk_kd_loss(
        s_logits.double(), ids, logprobs, c["w_t"].shape[0], c["s_labels"], c["t_labels"], c["s_groups"],
        c["t_groups"], c["vocab_map"], c["exact_ok"], cfg,
    )  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_fused_matches_reference(kind, beta):
    c = random_case(bias=True)
    ids, logprobs = teacher_topk(c, k=6)
    cfg = CrossTokenizerConfig(kind=kind, beta=beta, temperature=1.7, hard_weight=0.4, exact_weight=0.7,
                               uld_weight=1.3, uld_top_k=4 if kind == "hybrid" else None, chunk_size=5)  # fmt: skip
    ref, fused = topk_reference(c, ids, logprobs, cfg), topk_fused(c, ids, logprobs, cfg)
    torch.testing.assert_close(fused, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads(fused, c), grads(ref, c)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    # the top-k teacher is not the full one: the loss must differ from the in-process teacher's
    assert not torch.allclose(fused, fused_loss(c, cfg), rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_full_vocabulary_topk_equals_the_in_process_teacher(kind):
    """K = V_t, slots shuffled: the dense rebuild is exactly the teacher's tempered softmax."""
    c = random_case(seed=4, bias=True)
    ids, logprobs = teacher_topk(c, k=c["w_t"].shape[0], seed=1, padding=False)
    cfg = CrossTokenizerConfig(kind=kind, temperature=0.6, hard_weight=0.3, beta=0.3, chunk_size=4)
    from_topk, in_process = topk_fused(c, ids, logprobs, cfg), fused_loss(c, cfg)
    torch.testing.assert_close(from_topk, in_process, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads(from_topk, c), grads(in_process, c)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(topk_reference(c, ids, logprobs, cfg), reference_loss(c, cfg), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_topk_reductions_float32_and_components(reduction):
    c = random_case(seed=5)
    ids, logprobs = teacher_topk(c, k=8, seed=2)
    cfg = CrossTokenizerConfig(kind="hybrid", reduction=reduction, hard_weight=0.5, chunk_size=3)
    ref = topk_reference(c, ids, logprobs, cfg)
    torch.testing.assert_close(topk_fused(c, ids, logprobs, cfg), ref, rtol=1e-10, atol=1e-12)
    c32 = {k: (v.detach().float().requires_grad_(v.requires_grad) if torch.is_tensor(v) and v.is_floating_point()
               else v) for k, v in c.items()}  # fmt: skip
    out = topk_fused(c32, ids, logprobs.float(), cfg, return_components=True)
    torch.testing.assert_close(out.loss.double(), ref, rtol=1e-4, atol=1e-5)
    assert out.loss.requires_grad and not out.soft.requires_grad


def test_dense_topk_teacher_by_hand():
    """Two ids of four known (probs 0.5 and 0.2): at T = 1 the other two get 0.15 each; at T = 2 every
    log-prob is halved and the row renormalised."""
    ids = torch.tensor([[2, 0, -1]])
    logprobs = torch.tensor([[0.5, 0.2, 0.1]], dtype=torch.float64).log()
    logprobs[0, 2] = -math.inf
    dense = dense_topk_teacher(ids, logprobs, 4, 1.0).exp()
    torch.testing.assert_close(dense, torch.tensor([[0.2, 0.15, 0.5, 0.15]], dtype=torch.float64))
    tempered = dense_topk_teacher(ids, logprobs, 4, 2.0).exp()
    expected = torch.tensor([[0.2, 0.15, 0.5, 0.15]], dtype=torch.float64).sqrt()
    torch.testing.assert_close(tempered, expected / expected.sum(), rtol=1e-12, atol=1e-14)


def test_topk_bad_inputs_are_clear_errors():
    c = random_case()
    ids, logprobs = teacher_topk(c, k=5)
    cfg = CrossTokenizerConfig(kind="uld")
    with pytest.raises(ValueError, match="teacher_softcap"):
        topk_fused(c, ids, logprobs, cfg.replace(teacher_softcap=30.0))
    with pytest.raises(ValueError, match="teacher_vocab_size"):
        topk_fused(dict(c, vocab_map=None), ids, logprobs, cfg)
    with pytest.raises(ValueError, match="ids >= the vocab size"):
        topk_fused(c, torch.where(ids == ids.max(), 41, ids), logprobs, cfg)
    with pytest.raises(ValueError, match="one shape"):
        topk_fused(c, ids[..., :4], logprobs, cfg)
    with pytest.raises(ValueError, match="leading shape"):
        topk_fused(dict(c, t_groups=c["t_groups"][:, :-1]), ids, logprobs, cfg)
    with pytest.raises(ValueError, match="repeats an id"):
        topk_fused(c, torch.where(ids >= 0, ids[..., :1].clamp(min=0), ids), logprobs, cfg)
    # uld without a vocab map runs with teacher_vocab_size given
    out = topk_fused(dict(c, vocab_map=None), ids, logprobs, cfg, teacher_vocab_size=41)
    assert torch.isfinite(out)


def _both_paths(c, cfg, ids, logprobs, **kw):
    return {"in process": fused_loss(c, cfg, **kw), "top-k": topk_fused(c, ids, logprobs, cfg, **kw)}


def test_all_rows_ignored_with_zero_items_is_zero_with_zero_grads():
    """Every label ignored and no aligned group, num_items_in_batch=0 (a batch of prompts only)."""
    c = random_case(seed=4)
    ids, logprobs = teacher_topk(c, k=6)
    c["s_groups"], c["t_groups"] = torch.full_like(c["s_groups"], -1), torch.full_like(c["t_groups"], -1)
    c["s_labels"] = torch.full_like(c["s_labels"], -100)
    for kind in KINDS:
        for name, loss in _both_paths(c, CrossTokenizerConfig(kind=kind, hard_weight=0.5), ids, logprobs,
                                      num_items_in_batch=0).items():  # fmt: skip
            assert float(loss.detach()) == 0.0, (kind, name)
            assert all(float(g.abs().sum()) == 0.0 for g in grads(loss, c)), (kind, name)


def test_nan_in_ignored_rows_and_non_contiguous_inputs_change_nothing():
    """NaN in rows that are not scored (student rows without a label or group, teacher rows without a group,
    their top-k) never reaches the loss or a gradient; strided views give the contiguous result."""
    c = random_case(seed=5, bias=True)
    ids, logprobs = teacher_topk(c, k=6)
    cfg = CrossTokenizerConfig(kind="hybrid", hard_weight=0.4, temperature=1.7, beta=0.5)
    expected = {name: (loss.detach(), grads(loss, c)) for name, loss in _both_paths(c, cfg, ids, logprobs).items()}
    s_idle = (c["s_labels"] == -100) & (c["s_groups"] < 0)
    t_idle = c["t_groups"] < 0
    poisoned = dict(c, h_s=c["h_s"].detach().masked_fill(s_idle[..., None], math.nan).requires_grad_(),
                    h_t=c["h_t"].masked_fill(t_idle[..., None], math.nan))  # fmt: skip
    strided = dict(poisoned, h_t=poisoned["h_t"].transpose(0, 1).contiguous().transpose(0, 1))
    ids_view = ids.transpose(0, 1).contiguous().transpose(0, 1)
    lp_view = logprobs.masked_fill(t_idle[..., None], math.nan).transpose(0, 1).contiguous().transpose(0, 1)
    assert not (ids_view.is_contiguous() or lp_view.is_contiguous() or strided["h_t"].is_contiguous())
    assert poisoned["h_s"].isnan().any() and poisoned["h_t"].isnan().any() and lp_view.isnan().any()
    for name, loss in _both_paths(strided, cfg, ids_view, lp_view).items():
        want_loss, want_grads = expected[name]
        torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-10, atol=1e-12)
        got = grads(loss, strided)
        for i, (a, b) in enumerate(zip(got, want_grads)):  # the poisoned rows' own gradient included: 0
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=f"{name}: gradient {i}")
