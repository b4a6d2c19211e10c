"""The oracle itself: the beta convention, reductions, and agreement with TRL's generalized_jsd_loss."""

import math

import pytest
import torch
import torch.nn.functional as F

from liger_patch_kd import reference as R


def _logits(*shape):
    return torch.randn(*shape, dtype=torch.float64) * 2


def test_beta_ends_are_forward_and_reverse_kl():
    s, t = _logits(5, 11), _logits(5, 11)
    log_s, log_p = F.log_softmax(s, -1), F.log_softmax(t, -1)
    forward = (log_p.exp() * (log_p - log_s)).sum(-1)
    reverse = (log_s.exp() * (log_s - log_p)).sum(-1)
    torch.testing.assert_close(R.generalized_jsd_per_row(s, t, beta=0.0), forward)
    torch.testing.assert_close(R.generalized_jsd_per_row(s, t, beta=1.0), reverse)


def test_jsd_matches_its_definition_and_jumps_at_the_ends():
    s, t = _logits(4, 9), _logits(4, 9)
    beta = 0.3
    S, P = F.softmax(s, -1), F.softmax(t, -1)
    M = beta * P + (1 - beta) * S
    expected = beta * (P * (P / M).log()).sum(-1) + (1 - beta) * (S * (S / M).log()).sum(-1)
    torch.testing.assert_close(R.generalized_jsd_per_row(s, t, beta=beta), expected)
    # the documented discontinuity: the JSD vanishes as beta -> 0 while beta == 0 is forward KL
    assert R.generalized_jsd_per_row(s, t, beta=1e-9).abs().max() < 1e-6
    assert R.generalized_jsd_per_row(s, t, beta=0.0).min() > 1e-3


def test_temperature_scales_logits():
    s, t = _logits(3, 7), _logits(3, 7)
    torch.testing.assert_close(
        R.generalized_jsd_per_row(s, t, beta=0.5, temperature=2.0), R.generalized_jsd_per_row(s / 2, t / 2, beta=0.5)
    )


def test_reductions_and_ignore_index():
    s, t = _logits(6, 5), _logits(6, 5)
    labels = torch.tensor([1, -100, 2, 3, -100, 0])
    rows = R.generalized_jsd_per_row(s, t)
    keep = labels != -100
    none = R.generalized_jsd(s, t, labels, reduction="none")
    torch.testing.assert_close(none, torch.where(keep, rows, torch.zeros_like(rows)))
    torch.testing.assert_close(R.generalized_jsd(s, t, labels, reduction="sum"), rows[keep].sum())
    torch.testing.assert_close(R.generalized_jsd(s, t, labels), rows[keep].mean())
    torch.testing.assert_close(R.generalized_jsd(s, t, labels, num_items_in_batch=10), rows[keep].sum() / 10)
    all_ignored = torch.full_like(labels, -100)
    assert R.generalized_jsd(s, t, all_ignored).item() == 0.0


def test_kd_loss_adds_hard_ce_at_temperature_one():
    from liger_patch_kd import KDLossConfig

    s, t = _logits(6, 5), _logits(6, 5)
    labels = torch.tensor([1, -100, 2, 3, 4, 0])
    cfg = KDLossConfig(beta=0.5, temperature=2.0, soft_weight=0.7, hard_weight=0.3)
    expected = 0.7 * R.generalized_jsd(s, t, labels, beta=0.5, temperature=2.0) + 0.3 * F.cross_entropy(s, labels)
    torch.testing.assert_close(R.kd_loss(s, t, labels, cfg), expected)


def _trl_style_jsd(student_logits, teacher_logits, labels=None, beta=0.5, temperature=1.0, reduction="batchmean"):
    """TRL's GKDTrainer.generalized_jsd_loss, transcribed from its documented math (used when trl is absent)."""
    log_s = F.log_softmax(student_logits / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        jsd = F.kl_div(log_s, log_p, reduction="none", log_target=True)
    elif beta == 1:
        jsd = F.kl_div(log_p, log_s, reduction="none", log_target=True)
    else:
        b = torch.tensor(beta, dtype=student_logits.dtype)
        log_m = torch.logsumexp(torch.stack([log_s + torch.log(1 - b), log_p + torch.log(b)]), dim=0)
        jsd = b * F.kl_div(log_m, log_p, reduction="none", log_target=True) + (1 - b) * F.kl_div(
            log_m, log_s, reduction="none", log_target=True
        )
    mask = labels != -100
    jsd = jsd[mask]
    return jsd.sum() / mask.sum()


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_agrees_with_trl_generalized_jsd_loss(beta, temperature):
    s, t = _logits(2, 7, 33).float(), _logits(2, 7, 33).float()
    labels = torch.randint(0, 33, (2, 7))
    labels[0, :3] = -100
    got = R.generalized_jsd(s, t, labels, beta=beta, temperature=temperature)
    torch.testing.assert_close(
        got, _trl_style_jsd(s, t, labels, beta=beta, temperature=temperature), rtol=1e-5, atol=1e-6
    )
    assert math.isfinite(got.item())
    trainer = _trl_gkd_trainer()
    if trainer is not None:
        expected = trainer.generalized_jsd_loss(s, t, labels=labels, beta=beta, temperature=temperature)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _trl_gkd_trainer():
    """TRL's GKDTrainer wherever this trl keeps it (top level before 0.2x, trl.experimental.gkd after)."""
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    for module in ("trl.experimental.gkd", "trl"):
        try:
            return getattr(__import__(module, fromlist=["GKDTrainer"]), "GKDTrainer")
        except (ImportError, AttributeError):
            continue
    return None


def test_trl_is_what_we_compare_with():
    """The comparison above only means something if the real trl ran; the test extra installs it."""
    if _trl_gkd_trainer() is None:
        pytest.skip("trl is not installed (pip install -e .[test]); compared with the transcription only")
