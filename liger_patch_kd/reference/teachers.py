"""The oracle for sparse and several teachers: tokens sampled from the teacher (importance-weighted forward KL),
and the mixture of several teachers' distributions."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import KDLossConfig
from ..conventions import apply_softcap, require_sampled_objective, resolve_vocab, topk_valid_slots
from .core import generalized_jsd_of_logprobs, upcast_logits, weigh_and_reduce


# ------------------------------------------------------------------------------- sampled teacher tokens
def sampled_kd_per_row(
    student_logits: torch.Tensor,
    sample_ids: torch.Tensor,
    sample_counts: torch.Tensor,
    sample_logprobs: torch.Tensor,
    topk_ids: torch.Tensor | None = None,
    topk_logprobs: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Importance-weighted estimate of forward KL(P_T || S_T) per row from tokens sampled from the teacher.

    The data of a row: m = sum(counts) draws from P_T (the teacher at temperature T; from P_T restricted to the
    ids outside the top-k in the hybrid), as distinct ids with counts (id -1 or count 0: a padding slot), and
    log P_T of each id. Its log-probs are at the temperature the draws were made at (normalised over the full
    vocabulary there, as `precompute(temperature=T)` writes them): tempering log-probs taken at T = 1 would need
    the teacher's normaliser at T, which sparse data do not hold, so the loss never re-tempers them, and `T`
    must be the temperature the tokens were drawn at. Hybrid: the top-k is exact and the draws stand for the rest
    mass R = 1 - sum_k P_T(k). The estimate of P_T is P^(v) = P_T(v) on the top-k, R c_v / m elsewhere, and
        loss = sum_v P^(v) (log P_T(v) - log S_T(v)),    S_T = softmax(student_logits / T) over the full vocab.
    E[P^] = P_T, and the loss is linear in P^, so the loss and its gradient (S_T - P^) / T (sum P^ = 1) are
    unbiased for KL(P_T || S_T) and its gradient, with no other approximation: the student's normaliser is exact.

    Only forward KL has this form. Reverse KL and the generalized JSD (beta > 0) hold terms S(v) h(v) on every
    id the student likes; from teacher draws they are reached only as E_P[S(x) h(x) / P(x)], unbiased where
    P > 0 but with a variance of order sum_v S(v)^2 / P(v), unbounded as P(v) -> 0, so they are refused.
    """
    log_s = F.log_softmax(student_logits / temperature, dim=-1)
    acc = log_s.dtype
    present = (sample_ids >= 0) & (sample_counts > 0)
    counts = torch.where(present, sample_counts, 0).to(acc)
    draws = counts.sum(-1, keepdim=True)
    ids = torch.where(present, sample_ids, 0).long()
    per_draw = torch.where(present, sample_logprobs.to(acc) - log_s.gather(-1, ids), 0.0)
    rest = torch.ones_like(draws)
    loss = torch.zeros_like(draws[..., 0])
    if topk_ids is not None:
        valid = topk_valid_slots(topk_ids, topk_logprobs)
        lp = torch.where(valid, topk_logprobs.to(acc), -math.inf)
        top = log_s.gather(-1, torch.where(valid, topk_ids, 0).long())
        loss = torch.where(valid, lp.exp() * (lp - top), 0.0).sum(-1)
        rest = (1 - lp.exp().sum(-1, keepdim=True)).clamp(min=0)
    share = torch.where(draws > 0, rest / draws.clamp(min=1), 0.0)  # R / m: what one draw stands for
    return loss + (share * counts * per_draw).sum(-1)


def sampled_kd_loss(
    student_logits: torch.Tensor,
    sample_ids: torch.Tensor,
    sample_counts: torch.Tensor,
    sample_logprobs: torch.Tensor,
    labels: torch.Tensor | None = None,
    config: KDLossConfig | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    *,
    topk_ids: torch.Tensor | None = None,
    topk_logprobs: torch.Tensor | None = None,
    **options,
) -> torch.Tensor:
    """soft_weight * sampled forward-KL estimate (`sampled_kd_per_row`) + hard_weight * CE(cap(student), labels).
    beta defaults to 0 here (the only divergence with an unbiased sampled form); any other beta is refused."""
    if config is None and options.get("beta") is None:
        options["beta"] = 0.0
    cfg = KDLossConfig.build(config, **options)
    require_sampled_objective(cfg)
    vocab = resolve_vocab(student_logits.shape[-1], None, cfg.vocab_size)
    student = apply_softcap(student_logits[..., :vocab], cfg.softcap)
    if labels is not None:  # an ignored row's teacher data are never read (as in the fused loss): padding slots
        ignored = (labels == cfg.ignore_index).unsqueeze(-1)
        sample_ids = torch.where(ignored, -1, sample_ids)
        topk_ids = None if topk_ids is None else torch.where(ignored, -1, topk_ids)
    soft = sampled_kd_per_row(
        student, sample_ids, sample_counts, sample_logprobs, topk_ids, topk_logprobs, temperature=cfg.temperature
    )
    return weigh_and_reduce(soft, student, labels, cfg, num_items_in_batch)


# ------------------------------------------------------------------------------------------ several teachers
MIXTURES = ("distribution", "loss")


def tempered_logprobs(logits: torch.Tensor, softcap: float | None, temperature: float) -> torch.Tensor:
    """log softmax(cap(z) / T) over the last dim, in fp32 at least."""
    return F.log_softmax(apply_softcap(upcast_logits(logits), softcap) / temperature, dim=-1)


def log_teacher_mixture(
    teacher_logits: list[torch.Tensor],
    weights: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcaps: list[float | None] | None = None,
) -> torch.Tensor:
    """log P with P = sum_j w_j softmax(cap_j(z_j) / T): each teacher is tempered (and soft-capped) on its own,
    then the distributions are mixed. teacher_logits: J tensors (..., V); weights (..., J) per row (or (J,)),
    >= 0 and summing to 1; a one-hot row is routing (P = that teacher's distribution)."""
    softcaps = softcaps or [None] * len(teacher_logits)
    weights = weights.expand(*teacher_logits[0].shape[:-1], len(teacher_logits))
    log_p = [tempered_logprobs(z, c, temperature) for z, c in zip(teacher_logits, softcaps)]
    stacked = torch.stack(log_p, dim=-2) + weights.to(log_p[0].dtype).log()[..., None]  # (..., J, V)
    return torch.logsumexp(stacked, dim=-2)


def multi_teacher_kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: list[torch.Tensor],
    weights: torch.Tensor,
    labels: torch.Tensor | None = None,
    config: KDLossConfig | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    *,
    teacher_softcaps: list[float | None] | None = None,
    mixture: str = "distribution",
    **options,
) -> torch.Tensor:
    """soft_weight * KD(student, teachers) + hard_weight * CE(student, labels) against several teachers.

    mixture="distribution" (the default): D(S, P) against the mixture P = sum_j w_j P_j (`log_teacher_mixture`).
    mixture="loss": sum_j w_j D(S, P_j), the mixture of the losses. The two agree on routed (one-hot) rows. For
    forward KL they differ by a constant only (sum_j w_j KL(P_j||S) = KL(P||S) + the teachers' JSD), so same
    gradient. For reverse KL, sum_j w_j KL(S||P_j) = KL(S||G) + const with G the normalised geometric mean
    prod_j P_j^w_j: a product of experts that is small wherever any one teacher is, so the student is pushed off
    every token only one teacher knows. The mixture of distributions is the default because it is the
    distribution of the ensemble the user describes ("30 % math, 70 % code"), whatever beta is.
    `config.vocab_size` restricts every head to ids [0, vocab_size) first (heads padded to different sizes); the
    student's soft-cap is `config.softcap`, each
    teacher's `teacher_softcaps[j]`."""
    cfg = KDLossConfig.build(config, **options)
    if mixture not in MIXTURES:
        raise ValueError(f"mixture must be one of {MIXTURES}; got mixture={mixture!r}")
    vocab = min(resolve_vocab(student_logits.shape[-1], z.shape[-1], cfg.vocab_size) for z in teacher_logits)
    student = apply_softcap(upcast_logits(student_logits[..., :vocab]), cfg.softcap)
    teachers = [z[..., :vocab] for z in teacher_logits]
    caps = teacher_softcaps or [cfg.teacher_softcap] * len(teachers)
    log_s = F.log_softmax(student / cfg.temperature, dim=-1)
    weights = weights.to(log_s.dtype)  # a mixture: weights within the fused loss's tolerance of 1 are normalised
    weights = weights / weights.sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)
    if mixture == "distribution":
        log_p = log_teacher_mixture(teachers, weights, temperature=cfg.temperature, softcaps=caps)
        soft = generalized_jsd_of_logprobs(log_s, log_p, cfg.beta)
    else:
        w = weights.expand(*student.shape[:-1], len(teachers)).to(log_s.dtype)
        per_teacher = [
            generalized_jsd_of_logprobs(log_s, tempered_logprobs(z, c, cfg.temperature), cfg.beta)
            for z, c in zip(teachers, caps)
        ]
        soft = sum(w[..., j] * d for j, d in enumerate(per_teacher))
    return weigh_and_reduce(soft, student, labels, cfg, num_items_in_batch)
