"""The sampled-token estimators of KL(student || teacher) (k1, k2, k3, pg) against a teacher's log-probs given as
data: the teacher's log-prob of each sampled token, stored once (an offline on-policy store), instead of a live
teacher's hidden states. The student side is differentiable and never materialises logits (`linear_estimator_kd`,
one chunk of logits at a time through ops.token_logprobs); `estimator_kd_from_logprobs` is the same loss on the
student's log-probs however they were obtained (the materialised twin reads them off full logits). Both reduce as
losses.sampled.sampled_token_kd does, so a run on stored rows equals the in-process on-policy run on the same
rollouts up to the rounding of the teacher's log-probs.
"""

from __future__ import annotations

import torch

from .. import reference
from ..config import KDLossConfig
from ..ops.token_logprobs import linear_token_logprobs
from .checks import check_num_items, logprob_checks, run_device_checks


def estimator_kd_from_logprobs(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    flat_labels: torch.Tensor,
    cfg: KDLossConfig,
    num_items_in_batch: int | torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, soft, hard) of cfg.estimator with cfg.reduction: soft_weight * estimator + hard_weight * (-log q).

    Args:
        student_logprobs: (N,) log q of each row's label (gradients flow through it); ignored rows are never read.
        teacher_logprobs: (N,) log p of each row's label under the teacher (data: no gradient).
        flat_labels: (N,) the sampled tokens, ignore_index where nothing is scored.
        cfg: the loss options, cfg.estimator set ("pg" alone takes behaviour log-probs and cfg.importance_cap).
        num_items_in_batch: the divisor of "batchmean" (the whole accumulated batch's scored tokens), or None.
        behaviour_logprobs: (N,) "pg" only: log b of each label under the policy that sampled it; None: b = q.
    """
    if cfg.estimator is None:
        raise ValueError("estimator_kd_from_logprobs scores sampled tokens: set KDLossConfig.estimator")
    if cfg.reduction == "batchmean":
        check_num_items(num_items_in_batch)
    scored = flat_labels != cfg.ignore_index
    checks = logprob_checks("teacher_token_logprobs", teacher_logprobs, scored)
    checks.append(((teacher_logprobs.isneginf() & scored).any(),
                   lambda: "teacher_token_logprobs holds -inf on a scored token: the teacher gives a sampled token "
                           "probability 0, an infinite KL; rescore the store or mask the row"))  # fmt: skip
    if behaviour_logprobs is not None:
        if cfg.estimator != "pg":
            raise ValueError(f"behaviour_logprobs importance-correct the policy gradient: set estimator='pg' (got "
                             f"{cfg.estimator!r})")  # fmt: skip
        checks += logprob_checks("behaviour_logprobs", behaviour_logprobs, scored)
        checks.append(((behaviour_logprobs.isneginf() & scored).any(),
                       lambda: "behaviour_logprobs holds -inf on a scored token, which the policy that sampled it "
                               "cannot have sampled"))  # fmt: skip
    run_device_checks(checks)
    log_q = student_logprobs
    log_p = torch.where(scored, teacher_logprobs.to(log_q.dtype), log_q.detach())  # ignored rows: term 0
    if behaviour_logprobs is None:
        soft = reference.kl_estimator_terms(log_q, log_p, cfg.estimator)
    else:
        log_b = torch.where(scored, behaviour_logprobs.to(log_q.dtype), log_q.detach())  # ratio 1 where ignored
        soft = reference.policy_gradient_terms(log_q, log_p, log_b, importance_cap=cfg.importance_cap)
    hard = -log_q

    def reduce(per_row):
        return reference.reduce_rows(per_row, flat_labels, reduction=cfg.reduction, ignore_index=cfg.ignore_index,
                                     num_items_in_batch=num_items_in_batch)  # fmt: skip

    total = cfg.soft_weight * soft + (cfg.hard_weight * hard if cfg.hard_weight else 0.0)
    hard_out = reduce(hard.detach()) if cfg.hard_weight else reduce(torch.zeros_like(soft.detach()))
    return reduce(total), reduce(soft.detach()), hard_out


def linear_estimator_kd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    flat_labels: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    cfg: KDLossConfig,
    num_items_in_batch: int | torch.Tensor | None,
    behaviour_logprobs: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """estimator_kd_from_logprobs with log q read from hidden states and the lm_head, one chunk of logits at a time
    (the logits are never held whole). student_input (..., H) row-aligned with flat_labels (N,); the head's rows
    past cfg.vocab_size (padding) are never scored; `softcap` is the student's final-logit soft-capping."""
    vocab = cfg.vocab_size or student_weight.shape[0]
    flat = student_input.reshape(-1, student_input.shape[-1])
    if flat.shape[0] != flat_labels.shape[0] or teacher_logprobs.shape != flat_labels.shape:
        raise ValueError(f"student rows {flat.shape[0]}, labels {tuple(flat_labels.shape)} and teacher_token_logprobs "
                         f"{tuple(teacher_logprobs.shape)} must be one row each")  # fmt: skip
    ids = torch.where(flat_labels == cfg.ignore_index, -1, flat_labels)
    if bool(((ids >= vocab) | (ids < -1)).any()):
        raise ValueError(f"a label is outside the student's vocabulary [0, {vocab}) (or a negative id other than "
                         f"ignore_index {cfg.ignore_index})")  # fmt: skip
    bias = None if student_bias is None else student_bias[:vocab]
    log_q = linear_token_logprobs(flat, student_weight[:vocab], ids, bias, temperature=cfg.temperature,
                                  softcap=softcap, chunk_size=cfg.chunk_size)  # fmt: skip
    return estimator_kd_from_logprobs(log_q, teacher_logprobs, flat_labels, cfg, num_items_in_batch,
                                      behaviour_logprobs)  # fmt: skip
