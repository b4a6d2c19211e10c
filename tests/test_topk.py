"""Offline / top-k teacher losses and on-policy estimators against reference/ in float64."""

import math

import pytest
import torch
import torch.nn.functional as F

from liger_patch_kd import KDLossConfig, fused_linear_jsd, fused_linear_topk_kd, kl_estimator, topk_kd_from_logprobs
from liger_patch_kd import reference as R

from .helpers import DEVICE, backends, grads, rel_err

TOL = {"torch": dict(rtol=1e-10, atol=1e-12), "triton": dict(rtol=1e-6, atol=1e-8)}
N, H, V = 23, 17, 301


def _data(k, dtype=torch.float64, bias=False):
    h = torch.randn(N, H, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()
    w = (torch.randn(V, H, dtype=torch.float64) * 0.8).to(DEVICE, dtype).requires_grad_()
    b = (torch.randn(V, dtype=torch.float64) * 0.3).to(DEVICE, dtype).requires_grad_() if bias else None
    teacher_logits = torch.randn(N, V, dtype=torch.float64, device=DEVICE) * 3
    logprobs, ids = F.log_softmax(teacher_logits, -1).topk(k, -1)
    labels = torch.randint(0, V, (N,), device=DEVICE)
    labels[::4] = -100
    return h, w, b, teacher_logits, ids, logprobs, labels


def _check(h, w, b, ids, logprobs, labels, cfg, backend):
    loss = fused_linear_topk_kd(h, w, ids, logprobs, labels, student_bias=b, config=cfg, backend=backend)
    logits = h @ w.T if b is None else h @ w.T + b
    expected = R.topk_kd_loss(logits, ids, logprobs, labels, cfg)
    torch.testing.assert_close(loss, expected, **TOL[backend])
    params = [t for t in (h, w, b) if t is not None]
    for g, e in zip(grads(loss, params), grads(expected, params)):
        torch.testing.assert_close(g, e, **TOL[backend])


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("tail", ["bucket", "renormalize", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [0.7, 2.0])
@pytest.mark.parametrize("k", [1, 8, V])
def test_matches_reference_float64(backend, tail, beta, temperature, k):
    h, w, _, _, ids, logprobs, labels = _data(k)
    _check(
        h,
        w,
        None,
        ids,
        logprobs,
        labels,
        KDLossConfig(beta=beta, temperature=temperature, tail=tail, chunk_size=8),
        backend,
    )


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("tail", ["bucket", "renormalize", "none"])
def test_hard_term_softcap_bias_and_unit_temperature(backend, tail):
    h, w, b, _, ids, logprobs, labels = _data(16, bias=True)
    cfg = KDLossConfig(beta=0.1, tail=tail, soft_weight=0.7, hard_weight=0.5, softcap=4.0, chunk_size=5)
    _check(h, w, b, ids, logprobs, labels, cfg, backend)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("tail", ["bucket", "renormalize", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_full_vocab_logprobs_equal_the_online_loss(backend, tail, beta):
    """K = V: no tail, and tempering log-probs is exact, so every policy is the online generalized JSD."""
    torch.manual_seed(1)
    h = torch.randn(N, H, dtype=torch.float64, device=DEVICE, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, device=DEVICE, requires_grad=True)
    h_t, w_t = (
        torch.randn(N, 11, dtype=torch.float64, device=DEVICE),
        torch.randn(V, 11, dtype=torch.float64, device=DEVICE),
    )
    labels = torch.randint(0, V, (N,), device=DEVICE)
    logprobs = F.log_softmax(h_t @ w_t.T, -1)
    ids = torch.arange(V, device=DEVICE).expand(N, V).flip(-1)  # any order
    cfg = KDLossConfig(beta=beta, temperature=1.7, tail=tail, chunk_size=7)
    offline = fused_linear_topk_kd(h, w, ids, logprobs.flip(-1), labels, config=cfg, backend=backend)
    online = fused_linear_jsd(h, w, h_t, w_t, labels, config=cfg, backend=backend)
    torch.testing.assert_close(offline, online, **TOL[backend])
    for g, e in zip(grads(offline, [h, w]), grads(online, [h, w])):
        torch.testing.assert_close(g, e, **TOL[backend])


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("tail", ["bucket", "renormalize", "none"])
def test_padding_slots_are_absent_slots(backend, tail):
    """-inf, vLLM's -9999 and negative ids mark padding: the loss is that of the row without those slots."""
    h, w, _, _, ids, logprobs, labels = _data(8)
    padded_ids, padded_lp = ids.clone(), logprobs.clone()
    padded_lp[0, 5:] = -math.inf
    padded_lp[1, 4:] = -9999.0
    padded_ids[2, 6:] = -1
    padded_lp[3, :] = -math.inf  # a row with no teacher data at all
    cfg = KDLossConfig(tail=tail, reduction="none", chunk_size=4)
    rows = fused_linear_topk_kd(h, w, padded_ids, padded_lp, labels, config=cfg, backend=backend)
    assert torch.isfinite(rows).all()
    for row, keep in ((0, 5), (1, 4), (2, 6)):
        alone = fused_linear_topk_kd(
            h[row : row + 1], w, ids[row : row + 1, :keep], logprobs[row : row + 1, :keep], labels[row : row + 1],
            config=cfg, backend=backend,
        )  # fmt: skip
        torch.testing.assert_close(rows[row : row + 1], alone, **TOL[backend])
    assert rows[3].item() == pytest.approx(0.0, abs=1e-6)  # no teacher data: nothing to match
    g = grads(rows.sum(), [h, w])
    assert all(torch.isfinite(x).all() for x in g)


@pytest.mark.parametrize("backend", backends())
def test_low_precision_logprobs_and_inputs(backend):
    h, w, _, _, ids, logprobs, labels = _data(64, dtype=torch.bfloat16)
    cfg = KDLossConfig(beta=0.5, temperature=2.0)
    loss = fused_linear_topk_kd(h, w, ids.int(), logprobs.to(torch.bfloat16), labels, config=cfg, backend=backend)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = R.topk_kd_loss(h64 @ w64.T, ids, logprobs.to(torch.bfloat16).double(), labels, cfg)
    assert abs(loss.item() - ref.item()) < 1e-4 * abs(ref.item()) + 1e-6
    for g, e in zip(grads(loss, [h, w]), grads(ref, [h64, w64])):
        assert g.dtype == torch.bfloat16 and rel_err(g, e) < 1.5e-2


def test_all_rows_ignored():
    h, w, _, _, ids, logprobs, labels = _data(4)
    labels.fill_(-100)
    loss = fused_linear_topk_kd(h, w, ids, logprobs, labels, config=KDLossConfig(hard_weight=1.0))
    assert loss.item() == 0.0
    assert all((g == 0).all() for g in grads(loss, [h, w]))


def test_bad_teacher_data():
    h, w, _, _, ids, logprobs, labels = _data(4)
    with pytest.raises(ValueError, match="vocab size"):
        fused_linear_topk_kd(h, w, ids + V, logprobs, labels)
    bad = logprobs.clone()
    bad[1, 0] = float("nan")  # row 1 counts (row 0 is ignored: its data is never read, so never checked)
    with pytest.raises(ValueError, match="NaN"):
        fused_linear_topk_kd(h, w, ids, bad, labels)
    with pytest.raises(ValueError, match="logits"):
        fused_linear_topk_kd(h, w, ids, logprobs + 5, labels)
    with pytest.raises(ValueError, match="one shape"):
        fused_linear_topk_kd(h, w, ids[:, :2], logprobs, labels)
    with pytest.raises(ValueError, match="rows"):
        fused_linear_topk_kd(h, w, ids[:5], logprobs[:5], labels)
    with pytest.raises(ValueError, match="integer"):
        fused_linear_topk_kd(h, w, ids.double(), logprobs, labels)
    with pytest.raises(ValueError, match="tail"):
        fused_linear_topk_kd(h, w, ids, logprobs, labels, config=KDLossConfig(tail="drop"))


# ------------------------------------------------------------------------------------------ on-policy
def test_kl_estimators_match_their_formulas():
    q = torch.tensor([-0.5, -2.0, -1.0])
    p = torch.tensor([-1.0, -1.5, -1.0])
    r = p - q
    torch.testing.assert_close(kl_estimator(q, p, "k1", reduction="none"), q - p)
    torch.testing.assert_close(kl_estimator(q, p, "k2", reduction="none"), 0.5 * r**2)
    torch.testing.assert_close(kl_estimator(q, p, "k3", reduction="none"), r.exp() - r - 1)
    mask = torch.tensor([1, 0, 1])
    torch.testing.assert_close(kl_estimator(q, p, "k1", mask=mask), (q - p)[[0, 2]].mean())
    assert kl_estimator(q, p, "k3", mask=torch.zeros(3)).item() == 0.0
    torch.testing.assert_close(
        kl_estimator(q, p - 10, "k3", clamp=1.0, reduction="none"), torch.full((3,), math.exp(-1) + 1 - 1)
    )
    with pytest.raises(ValueError, match="kind"):
        kl_estimator(q, p, "k4")
    with pytest.raises(ValueError, match="one shape"):
        kl_estimator(q, p[:2])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_against_monte_carlo(kind):
    """Tokens sampled from the student: k1 and k3 average to KL(q || p) (unbiased); k2 averages to its own
    expectation E_q[(log q - log p)^2 / 2], which is KL to second order (close distributions)."""
    torch.manual_seed(0)
    log_q = F.log_softmax(torch.randn(12, dtype=torch.float64) * 0.6, -1)
    log_p = F.log_softmax(torch.randn(12, dtype=torch.float64) * 0.6, -1)
    q = log_q.exp()
    true_kl = (q * (log_q - log_p)).sum()
    expected = true_kl if kind != "k2" else (q * 0.5 * (log_q - log_p) ** 2).sum()
    samples = torch.multinomial(q, 400_000, replacement=True)
    estimate = kl_estimator(log_q[samples], log_p[samples], kind)
    assert abs(estimate - expected) < 0.02 * expected + 3e-3, (estimate.item(), expected.item())
    if kind == "k2":
        near = F.log_softmax(log_q + 0.05 * torch.randn(12, dtype=torch.float64), -1)
        kl_near = (q * (log_q - near)).sum()
        k2_near = (q * 0.5 * (log_q - near) ** 2).sum()
        assert abs(k2_near - kl_near) < 0.05 * kl_near


@pytest.mark.parametrize("tail", ["bucket", "renormalize", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_from_logprobs(tail, beta):
    student_logits = torch.randn(6, 40, dtype=torch.float64, requires_grad=True)
    teacher_logits = torch.randn(6, 40, dtype=torch.float64)
    # full vocabulary: every policy is the generalized JSD
    got = topk_kd_from_logprobs(
        F.log_softmax(student_logits, -1), F.log_softmax(teacher_logits, -1), config=KDLossConfig(beta=beta, tail=tail)
    )
    torch.testing.assert_close(got, R.generalized_jsd_per_row(student_logits, teacher_logits, beta=beta).mean())
    # top-k on the teacher's ids: the offline reference on the same ids
    lp_t, ids = F.log_softmax(teacher_logits, -1).topk(5, -1)
    lp_s = F.log_softmax(student_logits, -1).gather(-1, ids)
    got = topk_kd_from_logprobs(lp_s, lp_t, config=KDLossConfig(beta=beta, tail=tail), reduction="none")
    torch.testing.assert_close(got, R.topk_kd_per_row(student_logits, ids, lp_t, beta=beta, tail=tail))
    got.sum().backward()
    assert torch.isfinite(student_logits.grad).all()


@pytest.mark.parametrize("tail", ["renormalize", "none", "bucket"])
def test_logprob_losses_of_bf16_log_probs_do_their_math_in_fp32(tail):
    """bf16 log-probs (what an RL framework often holds) into topk_kd_from_logprobs and kl_estimator: the
    renormalising log-sum-exp, the divergence and the estimators run in fp32 (the loss contract's softmax math),
    not in bf16, where a log-sum-exp and a sum of 16 terms lose 8 bits (relative errors of 1e-3 to 3e-2 here).
    Against the float64 result of the same bf16 values: fp32 rounding (1e-5 relative allowed). Gradients come back
    in the inputs' dtype."""
    torch.manual_seed(5)
    log_s = torch.log_softmax(torch.randn(64, 2000) * 3, -1)
    log_p, ids = torch.log_softmax(torch.randn(64, 2000) * 3, -1).topk(16, -1)
    lp_s = log_s.gather(-1, ids).bfloat16().requires_grad_()
    lp_t = log_p.bfloat16()
    for beta in (0.0, 0.5):
        cfg = KDLossConfig(tail=tail, beta=beta)
        got = topk_kd_from_logprobs(lp_s, lp_t, config=cfg)
        want = topk_kd_from_logprobs(lp_s.detach().double(), lp_t.double(), config=cfg)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
        (g,) = torch.autograd.grad(got, [lp_s])
        assert g.dtype == torch.bfloat16
    for kind in ("k1", "k2", "k3"):
        got = kl_estimator(lp_s[:, 0], lp_t[:, 0], kind=kind)
        want = kl_estimator(lp_s[:, 0].detach().double(), lp_t[:, 0].double(), kind=kind)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("tail", ["bucket", "renormalize"])
def test_gradient_groups_match_reference_float64(backend, tail):
    """The top-k loss with its chunks' gradients gathered in groups (23 rows: groups of 9, the last of 5) and with
    a group larger than the rows."""
    h, w, b, _, ids, logprobs, labels = _data(16, bias=True)
    for chunk, group in ((3, 9), (4, 32)):
        cfg = KDLossConfig(beta=0.5, tail=tail, temperature=1.5, hard_weight=0.3, chunk_size=chunk,
                           grad_chunk_size=group)  # fmt: skip
        _check(h, w, b, ids, logprobs, labels, cfg, backend)
