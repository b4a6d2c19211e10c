"""The core of the oracle: the generalized JSD and KL on full logits, the hard term, reductions, the top-k teacher.

Shapes: logits (..., V), labels (...). Rows are aligned: row i of the student is scored against row i of the
teacher and label i. Nothing here is optimised; it should read like the formulas in docs/loss-contract.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import KDLossConfig, require_full_teacher
from ..conventions import (  # noqa: F401 (re-exported: the oracle's public names)
    LOGPROB_PLACEHOLDER,
    TAIL_FLOOR,
    apply_softcap,
    require_sampled_objective,
    resolve_vocab,
    tempered_topk_teacher,
    topk_valid_slots,
)
from .estimators import kl_estimator_terms, policy_gradient_terms


def upcast_logits(logits: torch.Tensor) -> torch.Tensor:
    """Softmax math in fp32 at least: 16-bit logits are upcast, fp32 and fp64 stay as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def generalized_jsd_per_row(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, beta: float = 0.5, temperature: float = 1.0
) -> torch.Tensor:
    """Generalized JSD of each row, summed over the vocabulary (TRL / Liger beta convention).

    beta == 0: KL(P || S) (forward KL); beta == 1: KL(S || P) (reverse KL); otherwise
    beta * KL(P || M) + (1 - beta) * KL(S || M), M = beta * P + (1 - beta) * S. Note the jump at both ends:
    as beta -> 0 the JSD itself tends to 0, but beta == 0 is defined as forward KL, as TRL does.
    """
    log_s = F.log_softmax(student_logits / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits / temperature, dim=-1)
    return generalized_jsd_of_logprobs(log_s, log_p, beta)


def generalized_jsd_of_logprobs(log_s: torch.Tensor, log_p: torch.Tensor, beta: float) -> torch.Tensor:
    """`generalized_jsd_per_row` on normalised log-probabilities (..., V): S = exp(log_s), P = exp(log_p)."""
    if beta == 0:
        per_vocab = F.kl_div(log_s, log_p, reduction="none", log_target=True)  # P (log P - log S)
    elif beta == 1:
        per_vocab = F.kl_div(log_p, log_s, reduction="none", log_target=True)  # S (log S - log P)
    else:
        log_m = torch.logaddexp(log_s + math.log(1 - beta), log_p + math.log(beta))
        kl_p_m = F.kl_div(log_m, log_p, reduction="none", log_target=True)
        kl_s_m = F.kl_div(log_m, log_s, reduction="none", log_target=True)
        per_vocab = beta * kl_p_m + (1 - beta) * kl_s_m
    return per_vocab.sum(-1)


def cross_entropy_per_row(student_logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """-log softmax(logits)[label] per row; 0 where the label is ignore_index."""
    flat = F.cross_entropy(
        student_logits.reshape(-1, student_logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
    )
    return flat.reshape(labels.shape)


def reduce_rows(
    per_row: torch.Tensor,
    labels: torch.Tensor | None,
    *,
    reduction: str = "batchmean",
    ignore_index: int = -100,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Zero the ignored rows, then reduce: "none" keeps rows, "sum" adds, "batchmean" divides the sum by
    num_items_in_batch when given, else by the number of non-ignored rows. No items at all (every row ignored,
    or num_items_in_batch == 0, as the Trainer passes for a micro-batch without labels) gives 0, never 0 / 0."""
    valid = torch.ones_like(per_row, dtype=torch.bool) if labels is None else labels != ignore_index
    per_row = torch.where(valid, per_row, torch.zeros_like(per_row))
    if reduction == "none":
        return per_row
    total = per_row.sum()
    if reduction == "sum":
        return total
    count = valid.sum() if num_items_in_batch is None else num_items_in_batch
    count = torch.as_tensor(count, dtype=total.dtype, device=total.device)
    return torch.where(count > 0, total / torch.where(count > 0, count, 1), 0)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    config: KDLossConfig | None = None,
    beta: float | None = None,
    temperature: float | None = None,
    ignore_index: int | None = None,
    reduction: str | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The generalized JSD distillation loss on materialised logits; see `generalized_jsd_per_row`. The options
    come from `config` and / or the keywords (None: not given), merged by `KDLossConfig.build` (a keyword that
    conflicts with `config` is a ValueError); only beta, temperature, ignore_index and reduction are read."""
    cfg = KDLossConfig.build(config, beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction)
    per_row = generalized_jsd_per_row(student_logits, teacher_logits, beta=cfg.beta, temperature=cfg.temperature)
    return reduce_rows(
        per_row, labels, reduction=cfg.reduction, ignore_index=cfg.ignore_index, num_items_in_batch=num_items_in_batch
    )


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    config: KDLossConfig | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    **options,
) -> torch.Tensor:
    """soft_weight * JSD(cap(student) / T, cap(teacher) / T) + hard_weight * CE(cap(student), labels): the full
    objective that `losses.fused_linear_jsd` computes without materialising the logits. With `config.vocab_size`
    both logits are restricted to ids [0, vocab_size) first (heads padded to different sizes). `options` are
    KDLossConfig fields as keywords, merged with `config` by `KDLossConfig.build` (a conflict is a ValueError).
    `behaviour_logprobs` (shaped like labels; estimator "pg" only): the log-prob of each label under the policy
    that sampled it, for the importance ratio (policy_gradient_terms)."""
    cfg = KDLossConfig.build(config, **options)
    vocab = resolve_vocab(student_logits.shape[-1], teacher_logits.shape[-1], cfg.vocab_size)
    student = apply_softcap(student_logits[..., :vocab], cfg.softcap)
    teacher = apply_softcap(teacher_logits[..., :vocab], cfg.teacher_softcap)
    if cfg.estimator is not None:
        soft = sampled_token_per_row(
            student, teacher, labels, cfg.estimator, cfg.ignore_index, behaviour_logprobs, cfg.importance_cap
        )
    else:
        if behaviour_logprobs is not None:
            raise ValueError(
                "behaviour_logprobs importance-correct the sampled-token policy gradient: set estimator='pg'"
            )
        soft = generalized_jsd_per_row(student, teacher, beta=cfg.beta, temperature=cfg.temperature)
    return weigh_and_reduce(soft, student, labels, cfg, num_items_in_batch)


def sampled_token_per_row(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None,
    kind: str,
    ignore_index: int,
    behaviour_logprobs: torch.Tensor | None = None,
    importance_cap: float | None = None,
) -> torch.Tensor:
    """Per row, the `kind` estimator of KL(student || teacher) at the row's label (a token sampled from the
    student, or from the behaviour policy whose log-probs `behaviour_logprobs` gives, "pg" only, its importance
    ratio truncated at `importance_cap`): log q and log p are minus the two cross-entropies there; 0 on ignored
    rows."""
    if labels is None:
        raise ValueError(f"estimator={kind!r} scores each row's label (the sampled token): pass labels")
    log_q = -cross_entropy_per_row(upcast_logits(student_logits), labels, ignore_index)
    log_p = -cross_entropy_per_row(upcast_logits(teacher_logits), labels, ignore_index)
    if behaviour_logprobs is None:
        return kl_estimator_terms(log_q, log_p, kind)
    if kind != "pg":
        raise ValueError(f"behaviour_logprobs importance-correct the policy gradient: estimator 'pg', not {kind!r}")
    if behaviour_logprobs.shape != labels.shape:
        raise ValueError(
            f"behaviour_logprobs {tuple(behaviour_logprobs.shape)} must have the labels' shape {tuple(labels.shape)}"
        )
    behaviour = torch.where(labels == ignore_index, log_q.detach(), behaviour_logprobs.to(log_q.dtype))
    return policy_gradient_terms(log_q, log_p, behaviour, importance_cap=importance_cap)


def require_real_ids(name: str, ids: torch.Tensor, vocab: int) -> None:
    """Every id must be a real token: in [0, vocab)."""
    if ids.numel() and not bool(((ids >= 0) & (ids < vocab)).all()):
        raise ValueError(
            f"{name} holds ids outside [0, {vocab}) (min {int(ids.min())}, max {int(ids.max())}); with "
            f"vocab_size={vocab} every id must be a real token of the tokenizer"
        )


def require_labels_for_hard_term(cfg: KDLossConfig, labels) -> None:
    if cfg.hard_weight and labels is None:
        raise ValueError("hard_weight > 0 needs labels for the cross-entropy term; pass labels or set hard_weight=0")


def weigh_and_reduce(
    soft_per_row: torch.Tensor,
    capped_student_logits: torch.Tensor,
    labels: torch.Tensor | None,
    cfg: KDLossConfig,
    num_items_in_batch: int | torch.Tensor | None,
) -> torch.Tensor:
    """soft_weight * KD + hard_weight * CE(student at T = 1) per row, then the reduction."""
    require_labels_for_hard_term(cfg, labels)
    if labels is not None and cfg.vocab_size is not None:
        require_real_ids("labels", labels[labels != cfg.ignore_index], capped_student_logits.shape[-1])
    per_row = cfg.soft_weight * soft_per_row
    if cfg.hard_weight:
        per_row = per_row + cfg.hard_weight * cross_entropy_per_row(capped_student_logits, labels, cfg.ignore_index)
    return reduce_rows(
        per_row, labels, reduction=cfg.reduction, ignore_index=cfg.ignore_index, num_items_in_batch=num_items_in_batch
    )


# ------------------------------------------------------------------------------------------- top-k teacher
def divergence_terms(log_s: torch.Tensor, log_p: torch.Tensor, beta: float, present: torch.Tensor) -> torch.Tensor:
    """Per-class generalized-JSD terms between two (sub-)distributions; 0 where a class is not present."""
    s, p = log_s.exp(), log_p.exp()
    if beta == 0:
        terms = p * (log_p - log_s)
    elif beta == 1:
        terms = s * (log_s - log_p)
    else:
        log_m = torch.logaddexp(log_p + math.log(beta), log_s + math.log(1 - beta))
        terms = beta * p * (log_p - log_m) + (1 - beta) * s * (log_s - log_m)
    return torch.where(present, terms, torch.zeros_like(terms))


def topk_kd_per_row(
    student_logits: torch.Tensor,
    teacher_token_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    tail: str = "bucket",
) -> torch.Tensor:
    """Distillation loss per row against top-k teacher log-probs; student logits (..., V), ids/log-probs (..., K).

    tail="bucket": the K top-k classes plus one class for everything else, on both sides (student tail mass is
    exact: 1 - its mass on the teacher's ids). tail="renormalize": both distributions restricted to the
    teacher's top-k and renormalised. tail="none": the terms on the top-k only, the student normalised over the
    full vocabulary. beta as in `generalized_jsd_per_row`.
    """
    vocab = student_logits.shape[-1]
    valid, log_p, log_p_tail = tempered_topk_teacher(teacher_token_ids, teacher_logprobs, vocab, temperature)
    log_s_full = F.log_softmax(student_logits / temperature, dim=-1)
    safe_ids = torch.where(valid, teacher_token_ids, torch.zeros_like(teacher_token_ids)).long()
    log_s = torch.where(valid, log_s_full.gather(-1, safe_ids), -math.inf)
    if tail == "renormalize":
        log_s = torch.where(valid, log_s - torch.logsumexp(log_s, -1, keepdim=True), -math.inf)
        log_p = torch.where(valid, log_p - torch.logsumexp(log_p, -1, keepdim=True), -math.inf)
        return divergence_terms(log_s, log_p, beta, valid).sum(-1)
    loss = divergence_terms(log_s, log_p, beta, valid).sum(-1)
    if tail == "bucket":
        has_tail = torch.isfinite(log_p_tail)
        log_s_tail = (1 - log_s.exp().sum(-1)).clamp(min=TAIL_FLOOR).log()
        loss = loss + divergence_terms(log_s_tail, log_p_tail, beta, has_tail)
    return loss


def topk_kd_loss(
    student_logits: torch.Tensor,
    teacher_token_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    labels: torch.Tensor | None = None,
    config: KDLossConfig | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    **options,
) -> torch.Tensor:
    """soft_weight * top-k KD(cap(student) / T, teacher) + hard_weight * CE(cap(student), labels); with
    `config.vocab_size` the student is restricted to ids [0, vocab_size) first. `options` as in `kd_loss`."""
    cfg = KDLossConfig.build(config, **options)
    require_full_teacher(cfg)
    vocab = resolve_vocab(student_logits.shape[-1], None, cfg.vocab_size)
    if cfg.vocab_size is not None:
        present = topk_valid_slots(teacher_token_ids, teacher_logprobs)
        require_real_ids("teacher_token_ids", teacher_token_ids[present], vocab)
    student = apply_softcap(student_logits[..., :vocab], cfg.softcap)
    soft = topk_kd_per_row(
        student, teacher_token_ids, teacher_logprobs, beta=cfg.beta, temperature=cfg.temperature, tail=cfg.tail
    )
    return weigh_and_reduce(soft, student, labels, cfg, num_items_in_batch)
