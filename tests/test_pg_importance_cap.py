"""The pg loss's importance ratio rho = q / b (student now / the engine's weights that sampled the token) truncated
at C: weight min(rho, C), gradient min(rho, C) * grad log q, checked against a float64 reference
written here; equal to the uncapped loss while every ratio is <= C; finite where the uncapped ratio overflows;
KDTrainer passes kd_pg_importance_cap to both its paths."""

import copy

import pytest
import torch
import torch.nn.functional as F

from liger_patch_kd import reference
from liger_patch_kd.config import KDLossConfig
from liger_patch_kd.losses import fused_linear_jsd, kl_estimator
from liger_patch_kd.trainer import KDTrainer
from liger_patch_kd.trainer.rollouts.generate import BEHAVIOUR

from .test_engine_trainer import pg_rollout_case
from .test_onpolicy import PROMPTS, _args, tokenizer  # noqa: F401

pytestmark = pytest.mark.usefixtures("clean_patches")
CAP = 3.0


def truncated_pg(log_q, log_p, log_b, cap, scored):
    """Independent float64 reference: value sum min(rho, C) (log q - log p) / scored, and a surrogate whose gradient
    is sum min(rho, C) (log q - log p) grad log q / scored (rho = exp(log q - log b), no gradient through it)."""
    weight = torch.exp(log_q.detach() - log_b)
    weight = weight if cap is None else weight.clamp(max=cap)
    advantage = log_q.detach() - log_p
    return (weight * advantage).sum() / scored, (weight * advantage * log_q).sum() / scored


def problem(seed=3, n=24, h=16, v=40):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w, xt, wt = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((v, h), (n, h), (v, h)))
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[0, 7]] = -100
    keep = labels != -100
    log_q = (x @ w.T).log_softmax(-1)[keep].gather(-1, labels[keep, None]).squeeze(-1)
    b = torch.full((n,), float("nan"), dtype=torch.float64)  # ignored rows: never read
    log_rho = torch.rand(int(keep.sum()), generator=g, dtype=torch.float64) * 5 - 1.5  # in [-1.5, 3.5]
    b[keep] = log_q - log_rho
    return x, w, xt, wt, labels, b


@pytest.mark.parametrize("cap", [CAP, None])
def test_the_truncated_pg_loss_matches_a_float64_reference(cap):
    x, w, xt, wt, labels, b = problem()
    keep = labels != -100
    rows = torch.arange(len(labels))[keep]
    x_ref = x.clone().requires_grad_(True)
    log_q = (x_ref @ w.T).log_softmax(-1)[rows, labels[keep]]
    log_p = (xt @ wt.T).log_softmax(-1)[rows, labels[keep]]
    want, surrogate = truncated_pg(log_q, log_p, b[keep], cap, int(keep.sum()))
    (want_dx,) = torch.autograd.grad(surrogate, x_ref)
    ratios = torch.exp(log_q.detach() - b[keep])
    assert int((ratios > CAP).sum()) >= 4 and int((ratios < 1).sum()) >= 4  # the cap binds on some rows, not all

    for name, loss_of in {
        "fused": lambda x_: fused_linear_jsd(x_, w, xt, wt, labels, behaviour_logprobs=b,
                                             config=KDLossConfig(estimator="pg", importance_cap=cap)),
        "reference": lambda x_: reference.kd_loss(x_ @ w.T, xt @ wt.T, labels, estimator="pg", behaviour_logprobs=b,
                                                  importance_cap=cap),
    }.items():  # fmt: skip
        x_ = x.clone().requires_grad_(True)
        got = loss_of(x_)
        (dx,) = torch.autograd.grad(got, x_)
        torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12, msg=name)
        torch.testing.assert_close(dx, want_dx, rtol=1e-10, atol=1e-12, msg=name)

    # on log-probs an RL framework holds: the value and d loss / d log q = min(rho, C) (log q - log p) / scored
    q_leaf = log_q.detach().clone().requires_grad_(True)
    got = kl_estimator(q_leaf, log_p, kind="pg", behaviour_logprobs=b[keep], importance_cap=cap)
    (dq,) = torch.autograd.grad(got, q_leaf)
    weight = ratios if cap is None else ratios.clamp(max=cap)
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dq, weight * (log_q.detach() - log_p) / int(keep.sum()), rtol=1e-12, atol=1e-15)


def test_the_cap_changes_nothing_while_every_ratio_is_below_it():
    x, w, xt, wt, labels, b = problem()
    # every ratio <= max(e^-6.5, q) <= 1: the cap never binds (b stays a log-prob, <= 0, which the loss checks)
    b = torch.where(labels != -100, (b + 10.0).clamp(max=0.0), b)
    losses, grads = [], []
    for cap in (None, CAP):
        x_ = x.clone().requires_grad_(True)
        loss = fused_linear_jsd(
            x_, w, xt, wt, labels, config=KDLossConfig(estimator="pg", importance_cap=cap), behaviour_logprobs=b
        )
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, x_)[0])
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])


def test_a_ratio_that_overflows_float32_stays_finite_under_the_cap():
    log_q = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    log_p = torch.tensor([-3.0, -1.0, -0.7])
    log_b = torch.tensor([-120.0, -2.5, -0.4])  # rho = e^119 overflows float32
    uncapped = kl_estimator(log_q, log_p, kind="pg", behaviour_logprobs=log_b, reduction="sum")
    assert not torch.isfinite(uncapped)
    capped = kl_estimator(log_q, log_p, kind="pg", behaviour_logprobs=log_b, importance_cap=CAP, reduction="sum")
    (dq,) = torch.autograd.grad(capped, log_q)
    weight = torch.tensor([CAP, float(torch.exp(torch.tensor(0.5))), float(torch.exp(torch.tensor(-0.1)))])
    torch.testing.assert_close(dq, weight * (log_q.detach() - log_p), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(capped.detach(), (weight * (log_q.detach() - log_p)).sum(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "bad, match",
    [
        (float("nan"), "behaviour_logprobs contains NaN on a selected token"),  # was a NaN loss
        (0.5, "behaviour_logprobs contains values > 0"),  # a logit, not a log-prob: was a finite, wrong loss
        (float("-inf"), "behaviour_logprobs holds -inf .*on a scored row"),  # was an infinite loss
        (-9999.0, "behaviour_logprobs holds -inf \\(or vLLM's -9999\\)"),
    ],
)
def test_the_fused_pg_loss_refuses_what_kl_estimator_refuses(bad, match):
    """fused_linear_jsd(estimator='pg') read behaviour log-probs unchecked (kl_estimator refuses these), and
    divided by a num_items_in_batch of torch.tensor(-3) into a loss of 0; an ignored row's value is never read."""
    g = torch.Generator().manual_seed(0)
    xs, ws = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(11, 8, generator=g, dtype=torch.float64)
    xt, wt = torch.randn(6, 8, generator=g, dtype=torch.float64), torch.randn(11, 8, generator=g, dtype=torch.float64)
    labels = torch.tensor([1, 2, -100, 4, 5, 6])
    log_b = torch.full((6,), -1.0, dtype=torch.float64)
    log_b[3] = bad
    with pytest.raises(ValueError, match=match):
        fused_linear_jsd(xs, ws, xt, wt, labels, config=KDLossConfig(estimator="pg"), behaviour_logprobs=log_b)
    log_b[3], log_b[2] = -1.0, bad  # on an ignored row: never read
    pg = KDLossConfig(estimator="pg")
    assert torch.isfinite(fused_linear_jsd(xs, ws, xt, wt, labels, config=pg, behaviour_logprobs=log_b))
    with pytest.raises(ValueError, match="num_items_in_batch must be a count >= 0"):
        fused_linear_jsd(xs, ws, xt, wt, labels, config=pg, num_items_in_batch=torch.tensor(-3))

def test_importance_cap_options_are_checked(tmp_path):
    for bad in (0.5, 0, float("inf"), float("nan"), True, "3"):
        with pytest.raises(ValueError, match="importance_cap must be None or a finite number >= 1"):
            KDLossConfig(estimator="pg", importance_cap=bad)
    with pytest.raises(ValueError, match="bounds the importance ratio of estimator 'pg', and estimator='k3'"):
        KDLossConfig(estimator="k3", importance_cap=2.0)
    with pytest.raises(ValueError, match="estimator='k1' has none"):
        kl_estimator(torch.zeros(2), torch.zeros(2), kind="k1", importance_cap=2.0)
    with pytest.raises(ValueError, match="kd_pg_importance_cap must be None or a finite number >= 1"):
        _args(tmp_path, kd_pg_importance_cap=0.9)
    assert _args(tmp_path).kd_pg_importance_cap == CAP and _args(tmp_path, kd_pg_importance_cap=None)
    with pytest.raises(ValueError, match="behaviour_logprobs holds -inf on a selected token"):
        kl_estimator(
            torch.zeros(2) - 1, torch.zeros(2) - 1, kind="pg", behaviour_logprobs=torch.tensor([-1, -float("inf")])
        )


@pytest.mark.parametrize("use_kd_patch", [True, False])
def test_the_trainer_truncates_the_engines_ratio_at_kd_pg_importance_cap(tmp_path, tokenizer, use_kd_patch):  # noqa: F811
    student, teacher, generated, scored, logits_s, logits_t = pg_rollout_case(tmp_path, tokenizer)
    labels = generated["labels"]
    behaviour = torch.where(labels != -100, -20.0, 0.0).double()  # the engine's weights far from the student's
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    b = F.pad(behaviour[:, 1:], (0, 1), value=0.0)
    for cap in (CAP, None):
        model = copy.deepcopy(student)
        trainer = KDTrainer(
            model=model, teacher_model=teacher, processing_class=tokenizer, train_dataset=PROMPTS,
            args=_args(tmp_path, use_kd_patch=use_kd_patch, kd_onpolicy_loss="pg", kd_pg_importance_cap=cap),
        )  # fmt: skip
        loss = trainer.compute_loss(model, {**generated, BEHAVIOUR: behaviour}, num_items_in_batch=torch.tensor(scored))
        want = reference.kd_loss(logits_s, logits_t, targets, estimator="pg", num_items_in_batch=scored,
                                 behaviour_logprobs=b, importance_cap=cap)  # fmt: skip
        torch.testing.assert_close(loss.detach(), want, rtol=1e-9, atol=1e-12)
        if cap is not None:  # every ratio is e^(log q + 20) > C here: the capped loss is C x k1
            k1 = reference.kd_loss(logits_s, logits_t, targets, estimator="k1", num_items_in_batch=scored)
            torch.testing.assert_close(loss.detach(), CAP * k1, rtol=1e-9, atol=1e-12)
