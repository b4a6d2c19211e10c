"""On-policy estimators of KL(student || teacher) on a token sampled from the student: their per-token terms."""

from __future__ import annotations

import math

import torch

# ----------------------------------------------------------------------------------------- on-policy
KL_ESTIMATORS = ("k1", "k2", "k3", "pg")


def kl_estimator_terms(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, kind: str, clamp: float | None = None
) -> torch.Tensor:
    """Per-token estimates of KL(student || teacher) from the log-probs of a token sampled from the student.

    With log r = log p_teacher - log q_student: k1 = -log r (unbiased, high variance, can be negative),
    k2 = (log r)^2 / 2 (biased, low variance), k3 = r - 1 - log r (unbiased and never negative).
    `clamp` bounds log r to [-clamp, clamp] (a token the teacher rules out, log p = -inf, counts as -clamp).
    """
    log_ratio = teacher_logprobs - student_logprobs
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.expm1(log_ratio) - log_ratio
    if kind == "pg":
        return policy_gradient_terms(student_logprobs, teacher_logprobs, clamp=clamp)
    raise ValueError(f"kind must be one of {KL_ESTIMATORS}; got kind={kind!r}")


def policy_gradient_terms(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor | None = None,
    clamp: float | None = None,
    importance_cap: float | None = None,
) -> torch.Tensor:
    """Per-token surrogate of the policy gradient of KL(student || teacher) on tokens sampled from the student.

    The per-token reverse KL is the negative advantage, A = sg(log p - log q) (discount 0: Thinking Machines'
    on-policy distillation, TRL's DistillationTrainer), and the term is -rho * A with the importance ratio
    rho = exp(log q - sg(log b)) to the behaviour policy b that sampled the token (b = q, the default: rho = 1 with
    gradient grad log q). Its gradient sg(log q - log p) * rho * grad log q has, over tokens drawn from b, the
    expectation sum_y q(y) (log q(y) - log p(y)) grad log q(y) = grad KL(q || p) at each position, exactly (the
    sum_y grad q(y) term is 0); its value is the (importance-weighted) k1 estimate. `clamp` bounds the log-ratio
    inside the advantage.

    `importance_cap` C truncates the ratio (truncated importance sampling, TRL's / verl's token-level "TIS"): the
    weight is min(rho, C), its gradient min(rho, C) * grad log q (never 0: a capped token still trains). rho is
    unbounded (a token the engine sampled at log b = -20 that the student now gives log q = -1 weighs e^19), so one
    stale or faulty behaviour log-prob can dominate a step; the cap bounds each token's weight, hence the variance.
    The price is bias where the cap binds: the expected gradient is sum_y min(q(y), C b(y)) (log q(y) - log p(y))
    grad log q(y), which lacks the part of q above C b. Unbiased (equal to the uncapped estimator) whenever every
    ratio is <= C, as with fresh weights (rho = 1 up to the engine's numerics).
    """
    log_ratio = (teacher_logprobs - student_logprobs).detach()
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    behaviour = student_logprobs if behaviour_logprobs is None else behaviour_logprobs
    log_rho = student_logprobs - behaviour.detach()
    if importance_cap is not None:  # where log rho > log C: the value log C exactly, the gradient d log q; no inf made
        log_cap = math.log(importance_cap)
        log_rho = torch.where(log_rho.detach() > log_cap, (log_rho - log_rho.detach()) + log_cap, log_rho)
    return -torch.exp(log_rho) * log_ratio
