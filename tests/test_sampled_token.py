"""The sampled-token estimators (KDLossConfig.estimator): fused from hidden states against reference.kd_loss on
materialised logits, float64; and the policy-gradient loss's gradient is the reverse KL's, in expectation."""

import pytest
import torch

from liger_patch_kd import KDLossConfig, fused_linear_jsd, kl_estimator
from liger_patch_kd import reference as R

from .helpers import grads, make_pair


@pytest.mark.parametrize("estimator", ["pg", "k1", "k2", "k3"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "extra", [{}, {"softcap": 2.0, "teacher_softcap": 3.0}, {"hard_weight": 0.3}, {"vocab_size": 1200}]
)
def test_fused_equals_the_reference_on_materialised_logits(estimator, bias, extra):
    torch.manual_seed(0)
    pair = make_pair(bias=bias)
    if "vocab_size" in extra:
        pair.labels[pair.labels >= extra["vocab_size"]] = 3
    cfg = KDLossConfig(estimator=estimator, **extra)
    got = fused_linear_jsd(
        pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels,
        student_bias=pair.student_bias, teacher_bias=pair.teacher_bias, config=cfg,
    )  # fmt: skip
    want = R.kd_loss(pair.student_logits(), pair.teacher_logits(), pair.labels, cfg)
    # float64 both ways; the chunked log-sum-exp sums in another order: ~1e-15 relative, 1e-10 allowed
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(grads(got, pair.params()), grads(want, pair.params())):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_reduction_none_ignored_rows_with_nan_and_no_items():
    pair = make_pair()
    ignored = pair.labels == -100
    with torch.no_grad():
        pair.student_input[ignored] = float("nan")
    args = (pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels)
    per_row = fused_linear_jsd(*args, config=KDLossConfig(estimator="pg", reduction="none"))
    assert per_row.shape == pair.labels.shape and (per_row[ignored] == 0).all() and torch.isfinite(per_row).all()
    zero = fused_linear_jsd(*args, config=KDLossConfig(estimator="k3"), num_items_in_batch=0)
    assert zero == 0
    (g,) = grads(zero, [pair.student_input])
    assert (g == 0).all()
    none_scored = torch.full_like(pair.labels, -100)
    loss = fused_linear_jsd(*args[:4], none_scored, config=KDLossConfig(estimator="pg"))
    assert loss == 0 and (grads(loss, [pair.student_weight])[0] == 0).all()


def test_estimator_refuses_a_temperature_and_a_label_outside_the_vocabulary():
    with pytest.raises(ValueError, match="temperature=1"):
        KDLossConfig(estimator="pg", temperature=2.0)
    with pytest.raises(ValueError, match="estimator must be"):
        KDLossConfig(estimator="k4")
    pair = make_pair()
    pair.labels[0] = 5000
    with pytest.raises(ValueError, match="labels"):
        fused_linear_jsd(
            pair.student_input, pair.student_weight, pair.teacher_input, pair.teacher_weight, pair.labels,
            config=KDLossConfig(estimator="k1"),
        )  # fmt: skip


def test_policy_gradient_is_the_reverse_kl_gradient_in_expectation():
    """Tokens sampled from the student: the mean gradient of the pg loss over the draws equals the gradient of
    KL(q || p) over the full vocabulary, within 4 standard errors (float64, 40,000 draws of one row)."""
    torch.manual_seed(0)
    v, h, draws = 13, 5, 40_000
    hidden = torch.randn(1, h, dtype=torch.float64)
    w_s = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    teacher_logits = torch.randn(1, v, dtype=torch.float64)
    log_q = torch.log_softmax(hidden @ w_s.T, -1)
    log_p = torch.log_softmax(teacher_logits, -1)
    (exact,) = torch.autograd.grad((log_q.exp() * (log_q - log_p)).sum(), [w_s])
    samples = torch.multinomial(log_q.detach().exp()[0], draws, replacement=True)
    rows_q = torch.log_softmax(hidden.expand(draws, h) @ w_s.T, -1).gather(1, samples[:, None]).squeeze(1)
    rows_p = log_p[0, samples]
    per_draw = []
    for chunk in torch.arange(draws).chunk(40):  # 40 batch means: their spread gives the standard error
        loss = kl_estimator(rows_q[chunk], rows_p[chunk], "pg", reduction="mean")
        per_draw.append(torch.autograd.grad(loss, [w_s], retain_graph=True)[0])
    stacked = torch.stack(per_draw)
    mean, stderr = stacked.mean(0), stacked.std(0) / len(per_draw) ** 0.5
    assert ((mean - exact).abs() <= 4 * stderr + 1e-12).float().mean() >= 0.99
    # and it is not the gradient of the mean k1 (which has expectation 0), nor of k3 (that of forward KL)
    assert (mean - exact).norm() < 0.1 * exact.norm()


def test_policy_gradient_with_behaviour_logprobs_is_importance_weighted():
    q = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    p = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    b = torch.tensor([-1.2, -2.0], dtype=torch.float64)
    loss = kl_estimator(q, p, "pg", behaviour_logprobs=b, reduction="sum")
    ratio = (q - b).exp().detach()
    torch.testing.assert_close(loss, (ratio * (q - p)).sum().detach())
    (g,) = torch.autograd.grad(loss, [q])
    torch.testing.assert_close(g, ratio * (q - p).detach())
    with pytest.raises(ValueError, match="kind='pg'"):
        kl_estimator(q, p, "k3", behaviour_logprobs=b)


def test_estimator_without_labels_is_refused():
    pair = make_pair()
    with pytest.raises(ValueError, match="pass labels"):
        fused_linear_jsd(
            pair.student_input,
            pair.student_weight,
            pair.teacher_input,
            pair.teacher_weight,
            config=KDLossConfig(estimator="pg"),
        )
    with pytest.raises(ValueError, match="pass labels"):
        R.kd_loss(pair.student_logits(), pair.teacher_logits(), None, estimator="pg")


def test_a_top_k_teacher_cannot_serve_an_estimator():
    """The sampled token may lie outside the teacher's top-k: its log-prob is unknown, so this is refused, not
    guessed (fused, reference, and a served teacher's arguments)."""
    from liger_patch_kd import fused_linear_topk_kd
    from liger_patch_kd.trainer import KDTrainingArguments

    pair = make_pair()
    ids = torch.arange(4).expand(pair.labels.shape[0], 4).contiguous()
    lp = torch.log_softmax(torch.randn(pair.labels.shape[0], 4, dtype=torch.float64), -1) - 1
    with pytest.raises(ValueError, match="top-k teacher data"):
        fused_linear_topk_kd(
            pair.student_input, pair.student_weight, ids, lp, pair.labels, config=KDLossConfig(estimator="pg")
        )
    with pytest.raises(ValueError, match="top-k teacher data"):
        R.topk_kd_loss(pair.student_logits(), ids, lp, pair.labels, config=KDLossConfig(estimator="k3"))
    with pytest.raises(ValueError, match="served"):
        KDTrainingArguments(output_dir="unused", use_cpu=True, report_to="none", kd_teacher_url="http://x",
                            kd_lmbda=1.0, kd_onpolicy_loss="pg")  # fmt: skip
