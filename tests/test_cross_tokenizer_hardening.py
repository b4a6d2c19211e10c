"""Cross-tokenizer distillation, hardened: item counts of 0 or below, batches without groups, the models' own
logit transforms (Granite / Cohere), on-policy options refused, a teacher_tokenizer object enabling it, and
heads of different sizes refused unless their relation is known. The reference (float64) is the oracle."""

from __future__ import annotations

import pytest
import torch

from liger_patch_kd.align import CrossTokenizerConfig
from liger_patch_kd.align import reference as xref

from .test_cross_tokenizer_loss import fused_loss, grads, random_case, reference_loss
from .test_cross_tokenizer_topk import teacher_topk, topk_fused, topk_reference

KINDS = ["uld", "exact", "hybrid", "next_byte", "chain"]


def _three_paths(c, cfg, **kw):
    """The fused loss (in-process teacher and top-k teacher) and the reference on the same case."""
    ids, logprobs = teacher_topk(c, k=6)
    n = kw.get("num_items_in_batch")
    ref = xref.cross_tokenizer_kd_loss(
        (c["h_s"] @ c["w_s"].T).double(), (c["h_t"] @ c["w_t"].T).double(), c["s_labels"], c["t_labels"],
        c["s_groups"], c["t_groups"], c["vocab_map"], c["exact_ok"], cfg, n,
    )  # fmt: skip
    topk_ref = xref.cross_tokenizer_topk_kd_loss(
        (c["h_s"] @ c["w_s"].T).double(), ids, logprobs, c["w_t"].shape[0], c["s_labels"], c["t_labels"],
        c["s_groups"], c["t_groups"], c["vocab_map"], c["exact_ok"], cfg, n,
    )  # fmt: skip
    return {"fused": fused_loss(c, cfg, **kw), "fused top-k": topk_fused(c, ids, logprobs, cfg, **kw),
            "reference": ref, "reference top-k": topk_ref}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_zero_items_give_zero_loss_and_zero_grads(kind):
    """num_items_in_batch=0 with scored rows (the Trainer's count for an accumulation step without items on
    other ranks / micro-batches): 0 and zero gradients, never inf / NaN, on every path."""
    c = random_case(seed=5)
    for name, loss in _three_paths(c, CrossTokenizerConfig(kind=kind, hard_weight=0.5), num_items_in_batch=0).items():
        assert float(loss.detach()) == 0.0, (kind, name)
        assert all(float(g.abs().sum()) == 0.0 for g in grads(loss, c)), (kind, name)
    tensor_zero = fused_loss(c, CrossTokenizerConfig(kind=kind), num_items_in_batch=torch.tensor(0))
    assert float(tensor_zero.detach()) == 0.0 and all(float(g.abs().sum()) == 0 for g in grads(tensor_zero, c))


@pytest.mark.parametrize("bad", [-3, torch.tensor(-3)])
def test_negative_items_are_refused(bad):
    c = random_case(seed=5)
    ids, logprobs = teacher_topk(c, k=6)
    cfg = CrossTokenizerConfig(hard_weight=0.5)
    calls = {
        "fused": lambda: fused_loss(c, cfg, num_items_in_batch=bad),
        "fused top-k": lambda: topk_fused(c, ids, logprobs, cfg, num_items_in_batch=bad),
        "reference": lambda: xref.cross_tokenizer_kd_loss(
            c["h_s"] @ c["w_s"].T, c["h_t"] @ c["w_t"].T, c["s_labels"], c["t_labels"], c["s_groups"],
            c["t_groups"], c["vocab_map"], c["exact_ok"], cfg, bad),
        "reference top-k": lambda: xref.cross_tokenizer_topk_kd_loss(
            c["h_s"] @ c["w_s"].T, ids, logprobs, c["w_t"].shape[0], c["s_labels"], c["t_labels"], c["s_groups"],
            c["t_groups"], c["vocab_map"], c["exact_ok"], cfg, bad),
    }  # fmt: skip
    for name, call in calls.items():
        with pytest.raises(ValueError, match="num_items_in_batch"):
            call()


def test_positive_items_still_divide():
    c = random_case(seed=6)
    cfg = CrossTokenizerConfig(kind="hybrid", hard_weight=0.5)
    out = _three_paths(c, cfg, num_items_in_batch=7)
    total = reference_loss(c, cfg.replace(reduction="sum"))
    for name in ("fused", "reference"):
        torch.testing.assert_close(out[name], total / 7, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out["fused top-k"], out["reference top-k"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hard_weight", [0.0, 0.5])
def test_no_groups_fused_equals_reference_equals_zero(kind, hard_weight):
    """An empty completion: no aligned group (labels still on, or off). The oracle gives what the fused loss
    gives: the CE term only (0 without it), zero KD gradients."""
    c = random_case(seed=3)
    c["s_groups"], c["t_groups"] = torch.full_like(c["s_groups"], -1), torch.full_like(c["t_groups"], -1)
    if hard_weight == 0.0:
        c["s_labels"] = torch.full_like(c["s_labels"], -100)
    cfg = CrossTokenizerConfig(kind=kind, hard_weight=hard_weight)
    out = _three_paths(c, cfg)
    ref_grads = grads(out["reference"], c) if hard_weight else None
    for name, loss in out.items():
        torch.testing.assert_close(loss.double(), out["reference"].double(), rtol=1e-10, atol=1e-12)
        if hard_weight == 0.0:
            assert float(loss.detach()) == 0.0, (kind, name)
            assert all(float(g.abs().sum()) == 0.0 for g in grads(loss, c)), (kind, name)
        else:
            got = ref_grads if name == "reference" else grads(loss, c)
            for a, b in zip(got, ref_grads):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    none = xref.cross_tokenizer_kd_loss(
        c["h_s"] @ c["w_s"].T, c["h_t"] @ c["w_t"].T, c["s_labels"], c["t_labels"], c["s_groups"], c["t_groups"],
        c["vocab_map"], c["exact_ok"], cfg.replace(reduction="none"))  # fmt: skip
    assert none.shape == c["s_labels"].shape
