"""The distillation math, plainly, on materialised logits: the oracle every fused path is tested against.

Shapes: logits (..., V), labels (...). Rows are aligned: row i of the student is scored against row i of the
teacher and label i. Nothing here is optimised; it should read like the formulas in the README.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import KDLossConfig


def apply_softcap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-2 style final-logit soft-capping: tanh(x / c) * c (identity when softcap is None)."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


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
        student_logits.reshape(-1, student_logits.shape[-1]), labels.reshape(-1), ignore_index=ignore_index, reduction="none"
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
    num_items_in_batch when given, else by the number of non-ignored rows (all ignored -> 0, never NaN)."""
    valid = torch.ones_like(per_row, dtype=torch.bool) if labels is None else labels != ignore_index
    per_row = torch.where(valid, per_row, torch.zeros_like(per_row))
    if reduction == "none":
        return per_row
    total = per_row.sum()
    if reduction == "sum":
        return total
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    return total / valid.sum().clamp(min=1)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The generalized JSD distillation loss on materialised logits; see `generalized_jsd_per_row`."""
    KDLossConfig(beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction)  # validates
    per_row = generalized_jsd_per_row(student_logits, teacher_logits, beta=beta, temperature=temperature)
    return reduce_rows(per_row, labels, reduction=reduction, ignore_index=ignore_index, num_items_in_batch=num_items_in_batch)


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    config: KDLossConfig | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """soft_weight * JSD(cap(student) / T, cap(teacher) / T) + hard_weight * CE(cap(student), labels): the full
    objective that `losses.fused_linear_jsd` computes without materialising the logits."""
    cfg = config or KDLossConfig()
    student = apply_softcap(student_logits, cfg.softcap)
    teacher = apply_softcap(teacher_logits, cfg.effective_teacher_softcap)
    per_row = cfg.soft_weight * generalized_jsd_per_row(student, teacher, beta=cfg.beta, temperature=cfg.temperature)
    if cfg.hard_weight:
        if labels is None:
            raise ValueError("hard_weight > 0 needs labels for the cross-entropy term; pass labels or set hard_weight=0")
        per_row = per_row + cfg.hard_weight * cross_entropy_per_row(student, labels, cfg.ignore_index)
    return reduce_rows(
        per_row, labels, reduction=cfg.reduction, ignore_index=cfg.ignore_index, num_items_in_batch=num_items_in_batch
    )
