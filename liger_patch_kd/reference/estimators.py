"""On-policy estimators of KL(student || teacher) on a token sampled from the student: their per-token terms."""

from __future__ import annotations

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
) -> torch.Tensor:
    """Per-token surrogate of the policy gradient of KL(student || teacher) on tokens sampled from the student.

    The per-token reverse KL is the negative advantage, A = sg(log p - log q) (discount 0: Thinking Machines'
    on-policy distillation, TRL's DistillationTrainer), and the term is -rho * A with the importance ratio
    rho = exp(log q - sg(log b)) to the behaviour policy b that sampled the token (b = q, the default: rho = 1 with
    gradient grad log q). Its gradient sg(log q - log p) * rho * grad log q has, over tokens drawn from b, the
    expectation sum_y q(y) (log q(y) - log p(y)) grad log q(y) = grad KL(q || p) at each position, exactly (the
    sum_y grad q(y) term is 0); its value is the (importance-weighted) k1 estimate. `clamp` bounds the log-ratio
    inside the advantage.
    """
    log_ratio = (teacher_logprobs - student_logprobs).detach()
    if clamp is not None:
        log_ratio = log_ratio.clamp(-clamp, clamp)
    behaviour = student_logprobs if behaviour_logprobs is None else behaviour_logprobs
    ratio = torch.exp(student_logprobs - behaviour.detach())
    return -ratio * log_ratio
