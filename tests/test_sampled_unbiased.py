"""Monte-Carlo proof that the sampled-token loss is unbiased: over many independent draws from the teacher, the
mean gradient equals the full-vocabulary forward-KL gradient within its standard error; top-k's is not.

Each draw is one row of a single fused call (reduction "sum"), so the gradient of row i is the gradient of draw
i alone. The test statistic per coordinate is z = (mean - exact) / (sd / sqrt(n)); by the central limit theorem
each z is ~N(0, 1) when the estimator is unbiased (n = 3000 draws of a bounded gradient), and over the d
coordinates the Bonferroni bound |z| < Phi^-1(1 - alpha / (2 d)) fails with probability at most alpha = 1e-6.
The seed is fixed, so the run is deterministic; the bound says why it is not a tuned threshold.
"""

import math
from statistics import NormalDist

import pytest
import torch
import torch.nn.functional as F

from liger_patch_kd import KDLossConfig, fused_linear_sampled_kd, fused_linear_topk_kd
from liger_patch_kd import reference as R
from liger_patch_kd.teacher.sampling import sample_teacher_tokens

ROWS, H, V, DRAWS = 3, 6, 40, 3000
ALPHA = 1e-6


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(ROWS, H, dtype=torch.float64, generator=g)
    w = torch.randn(V, H, dtype=torch.float64, generator=g) * 0.7
    teacher = torch.randn(ROWS, V, dtype=torch.float64, generator=g)  # flat: top-8 leaves ~half the mass out
    return h, w, teacher, g


def _exact_grad(h, w, teacher, temperature):
    h = h.clone().requires_grad_()
    loss = R.kd_loss(h @ w.T, teacher, beta=0.0, temperature=temperature, reduction="sum")
    return torch.autograd.grad(loss, h)[0]


def _per_draw_grads(h, w, data, temperature):
    """(DRAWS, ROWS, H): the gradient of each draw's loss with respect to its row's hidden state."""
    hs = h.repeat(DRAWS, 1).requires_grad_()
    loss = fused_linear_sampled_kd(
        hs, w, data.ids, data.counts, data.logprobs, teacher_token_ids=data.topk_ids,
        teacher_logprobs=data.topk_logprobs, config=KDLossConfig(beta=0.0, temperature=temperature, reduction="sum"),
    )  # fmt: skip
    return torch.autograd.grad(loss, hs)[0].reshape(DRAWS, ROWS, H)


def _z(per_draw, exact):
    mean, sd = per_draw.mean(0), per_draw.std(0)
    return (mean - exact) / (sd / math.sqrt(DRAWS))


def _bound(coordinates):
    return NormalDist().inv_cdf(1 - ALPHA / (2 * coordinates))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("m,top_k", [(1, 0), (8, 0), (4, 4)])
def test_mean_gradient_is_the_full_vocabulary_gradient(m, top_k, temperature):
    h, w, teacher, g = _case()
    log_p = F.log_softmax(teacher / temperature, -1).repeat(DRAWS, 1)  # draws come from P_T
    data = sample_teacher_tokens(log_p, m, top_k=top_k, generator=g)
    per_draw = _per_draw_grads(h, w, data, temperature)
    z = _z(per_draw, _exact_grad(h, w, teacher, temperature))
    assert z.abs().max() < _bound(z.numel()), z


def test_top_k_gradient_is_biased_on_the_same_case():
    # the same test rejects top-k: its (deterministic) gradient is many standard errors of the sampled mean away
    h, w, teacher, g = _case()
    log_p = F.log_softmax(teacher, -1)
    data = sample_teacher_tokens(log_p.repeat(DRAWS, 1), 8, generator=g)
    sampled = _per_draw_grads(h, w, data, 1.0)
    exact = _exact_grad(h, w, teacher, 1.0)
    se = sampled.std(0) / math.sqrt(DRAWS)
    top_lp, top_ids = log_p.topk(8, -1)
    for tail in ("bucket", "renormalize", "none"):
        hk = h.clone().requires_grad_()
        loss = fused_linear_topk_kd(hk, w, top_ids, top_lp, config=KDLossConfig(beta=0.0, tail=tail, reduction="sum"))
        z = (torch.autograd.grad(loss, hk)[0] - exact) / se
        assert z.abs().max() > 5 * _bound(z.numel()), (tail, z.abs().max())


def test_loss_value_is_unbiased_for_the_kl():
    # the value too: the mean of the per-draw estimates is KL(P_T || S_T) within its standard error
    h, w, teacher, g = _case(1)
    log_p = F.log_softmax(teacher / 1.5, -1)
    data = sample_teacher_tokens(log_p.repeat(DRAWS, 1), 4, generator=g)
    per_row = fused_linear_sampled_kd(
        h.repeat(DRAWS, 1),
        w,
        data.ids,
        data.counts,
        data.logprobs,
        config=KDLossConfig(beta=0.0, temperature=1.5, reduction="none"),
    ).reshape(DRAWS, ROWS)
    exact = R.kd_loss(h @ w.T, teacher, beta=0.0, temperature=1.5, reduction="none")
    z = (per_row.mean(0) - exact) / (per_row.std(0) / math.sqrt(DRAWS))
    assert z.abs().max() < _bound(ROWS)
