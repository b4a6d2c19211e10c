"""Losses on log-probs an RL framework already holds (no logits, no patch): the on-policy KL estimators on
sampled tokens, and top-k forward / reverse KL / JSD on the teacher's top-k ids."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import reference
from ..config import ESTIMATORS, KDLossConfig
from ..ops.divergence import divergence_terms
from .checks import logprob_checks, loss_config, run_device_checks, selected_tokens, zero_rows
from .docs import args_section, shared_docs

__all__ = ["kl_estimator", "topk_kd_from_logprobs"]

FORWARD_KL = KDLossConfig(beta=0.0)  # topk_kd_from_logprobs' default


@shared_docs(mask=args_section("logprob_mask"), reduction=args_section("logprob_reduction"))
def kl_estimator(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    kind: str = "k3",
    mask: torch.Tensor | None = None,
    clamp: float | None = None,
    reduction: str = "mean",
    check_inputs: bool = True,
    behaviour_logprobs: torch.Tensor | None = None,
    importance_cap: float | None = None,
) -> torch.Tensor:
    """On-policy estimate of KL(student || teacher) from the log-probs of tokens sampled from the student.

    k1 = log q - log p, k2 = (log q - log p)^2 / 2, k3 = exp(log p - log q) - (log p - log q) - 1 (see
    reference.kl_estimator_terms), each differentiated as a loss (verl's use); "pg" is the policy gradient of
    the reverse KL, -rho * sg(log p - log q) with rho = exp(log q - sg(log b)) (reference.policy_gradient_terms):
    its value is k1's, its gradient's expectation over the samples is exactly grad KL(q || p) per position.
    `clamp` bounds the log-ratio to [-clamp, clamp] first (the k3 exponent can explode on tokens the teacher finds
    unlikely). A teacher log-prob of -inf (a token the teacher rules out)
    makes the estimate +inf without `clamp` and counts as log-ratio -clamp with it (no gradient there, as
    clamp's own). `mask` (same shape, bool or 0/1) selects the tokens that count: the completion, not the
    prompt or padding, whose values are never read. reduction: "mean" over masked tokens (0 when none), "sum",
    or "none". `check_inputs` refuses, with one host sync, NaN, +inf or positive log-probs on selected tokens,
    and a student or behaviour log-prob of -inf (a sampled token has probability > 0 under the policy that
    sampled it). `importance_cap` C truncates pg's importance ratio, min(rho, C) (reference.policy_gradient_terms:
    bounded variance, biased only where the cap binds).
    Gradients flow to whichever inputs require them (usually student_logprobs).

    Args:
        student_logprobs (Tensor): (...) the student's log-prob of each sampled token; gradients flow to it.
        teacher_logprobs (Tensor): (...) the teacher's log-prob of the same tokens.
        kind (str): "k1", "k2", "k3" (default) or "pg", see below.
{mask}
        clamp (float | None): bound the log-ratio to [-clamp, clamp] first.
{reduction}
        check_inputs (bool): refuse bad log-probs on selected tokens (one host sync), see below.
        behaviour_logprobs (Tensor | None): (...) "pg" only: the log-probs of the policy that sampled the tokens
            (an engine's weights some steps old); None: the student itself (fresh rollouts).
        importance_cap (float | None): "pg" only: the largest importance ratio a token weighs (>= 1); None: unbounded.

    Returns:
        Tensor: a scalar ("mean", "sum") or (...) per token ("none").
    """
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"student_logprobs {tuple(student_logprobs.shape)} and teacher_logprobs "
            f"{tuple(teacher_logprobs.shape)} must have one shape (one value per sampled token)"
        )
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be None or > 0; got clamp={clamp!r}")
    KDLossConfig(estimator=kind if kind in ESTIMATORS else None, importance_cap=importance_cap)  # validates the cap
    selected = selected_tokens(mask, student_logprobs.shape, student_logprobs.device)
    if check_inputs:
        checks = logprob_checks("student_logprobs", student_logprobs, selected)
        checks += logprob_checks("teacher_logprobs", teacher_logprobs, selected)
        sampling = {"student_logprobs": student_logprobs, "behaviour_logprobs": behaviour_logprobs}
        if behaviour_logprobs is not None and behaviour_logprobs.shape == student_logprobs.shape:
            checks += logprob_checks("behaviour_logprobs", behaviour_logprobs, selected)
        for name, values in sampling.items():
            if values is not None and values.shape == student_logprobs.shape:
                checks.append(((values.isneginf() & selected).any(), _sampled_neginf(name)))
        run_device_checks(checks)
    # the estimators in fp32 at least: 16-bit log-probs are upcast (their gradients come back in their dtype)
    student_logprobs, teacher_logprobs = (
        reference.upcast_logits(zero_rows(t, selected)) for t in (student_logprobs, teacher_logprobs)
    )
    if behaviour_logprobs is not None:
        if kind != "pg":
            raise ValueError(f"behaviour_logprobs importance-correct the policy gradient: pass kind='pg', not {kind!r}")
        if behaviour_logprobs.shape != student_logprobs.shape:
            raise ValueError(
                f"behaviour_logprobs {tuple(behaviour_logprobs.shape)} must have student_logprobs' shape "
                f"{tuple(student_logprobs.shape)}"
            )
        behaviour = reference.upcast_logits(zero_rows(behaviour_logprobs, selected))
        terms = reference.policy_gradient_terms(student_logprobs, teacher_logprobs, behaviour, clamp, importance_cap)
    else:
        terms = reference.kl_estimator_terms(student_logprobs, teacher_logprobs, kind, clamp)
    return _masked_reduce(terms, mask, reduction)


@shared_docs(mask=args_section("logprob_mask"), reduction=args_section("logprob_reduction"))
def topk_kd_from_logprobs(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    config: KDLossConfig | None = None,
    reduction: str = "mean",
    check_inputs: bool = True,
    **options: Any,
) -> torch.Tensor:
    """Top-k forward KL (beta=0) / reverse KL (beta=1) / generalized JSD on student-sampled sequences, from
    log-probs an RL framework already holds: both (..., K) on the same K ids (e.g. the teacher's top-k),
    each normalised over its full vocabulary. No logits, no patch. `tail` as in `fused_linear_topk_kd`; padding
    slots (-inf in either, or a teacher value <= -1000) are ignored. `mask` (...) selects the tokens; the others
    are never read. `check_inputs` refuses NaN, +inf and positive log-probs on selected tokens (one host sync).
    reduction as in `kl_estimator`.

    Args:
        student_logprobs (Tensor): (..., K) the student's log-probs on K ids; gradients flow to it.
        teacher_logprobs (Tensor): (..., K) the teacher's log-probs on the same ids.
{mask}
        config (KDLossConfig | None): its beta (0 forward KL, 1 reverse KL, otherwise generalized JSD) and tail
            ("bucket", "renormalize" or "none", as in `fused_linear_topk_kd`); default KDLossConfig(beta=0.0): forward
            KL, the bucket tail. Its reduction is the keyword below. A keyword naming an option is a TypeError.
{reduction}
        check_inputs (bool): refuse NaN, +inf and positive log-probs on selected tokens (one host sync).

    Returns:
        Tensor: a scalar ("mean", "sum") or (...) per token ("none").
    """
    cfg = loss_config("topk_kd_from_logprobs", config, options, default=FORWARD_KL)
    if cfg.reduction != "batchmean":  # its own `reduction` keyword reduces here: a config's would go unread
        raise ValueError(
            f"topk_kd_from_logprobs reduces by its own reduction= keyword (\"mean\", \"sum\" or \"none\"); got "
            f"config.reduction={cfg.reduction!r}: leave the config's at its default and pass reduction= instead"
        )
    beta, tail = cfg.beta, cfg.tail
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"student_logprobs {tuple(student_logprobs.shape)} and teacher_logprobs {tuple(teacher_logprobs.shape)} "
            f"must have one shape (..., K): both models' log-probs on the same K ids"
        )
    selected = selected_tokens(mask, student_logprobs.shape[:-1], student_logprobs.device)
    if check_inputs:
        checks = logprob_checks("student_logprobs", student_logprobs, selected[..., None])
        run_device_checks(checks + logprob_checks("teacher_logprobs", teacher_logprobs, selected[..., None]))
    present = (
        selected[..., None]
        & torch.isfinite(student_logprobs)
        & (teacher_logprobs > reference.LOGPROB_PLACEHOLDER)
        & torch.isfinite(teacher_logprobs)
    )
    log_s = torch.where(present, reference.upcast_logits(student_logprobs), -math.inf)  # the math in fp32 at least
    log_p = torch.where(present, teacher_logprobs.to(log_s.dtype), -math.inf)
    if tail == "renormalize":
        log_s = torch.where(present, log_s - torch.logsumexp(log_s, -1, keepdim=True), -math.inf)
        log_p = torch.where(present, log_p - torch.logsumexp(log_p, -1, keepdim=True), -math.inf)
    terms = divergence_terms(log_s, log_p, beta, present).sum(-1)
    if tail == "bucket":
        tails = [(1 - t.exp().sum(-1)).clamp(min=reference.TAIL_FLOOR).log() for t in (log_s, log_p)]
        terms = terms + divergence_terms(*tails, beta)
    return _masked_reduce(terms, mask, reduction)


def _sampled_neginf(name: str):
    return lambda: (f"{name} holds -inf on a selected token, which the policy that sampled it cannot have "
                    f"sampled; mask that token out")  # fmt: skip


def _masked_reduce(terms: torch.Tensor, mask: torch.Tensor | None, reduction: str) -> torch.Tensor:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got reduction={reduction!r}")
    if mask is not None:
        if mask.shape != terms.shape:
            raise ValueError(f"mask {tuple(mask.shape)} must have the per-token shape {tuple(terms.shape)}")
        terms = torch.where(mask.bool(), terms, torch.zeros_like(terms))
    if reduction == "none":
        return terms
    if reduction == "sum":
        return terms.sum()
    count = terms.new_tensor(terms.numel()) if mask is None else mask.sum().to(terms.dtype)
    return terms.sum() / count.clamp(min=1)
