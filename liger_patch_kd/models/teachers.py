"""Several live teachers in one KD forward: each row scored against its own teacher (routing, one-hot weights) or
against a mixture of them. This module holds the set and its logged figures; its loss is the TeacherMix signal's
(models/signals/), fused (losses.fused_linear_multi_teacher_jsd on every teacher's last hidden states) or on
materialised logits (reference.multi_teacher_kd_loss).

The teachers run one inside the other's forward (teacher 1's forward asks teacher 2 for its hidden states, ...,
and the innermost computes the loss), so that under FSDP every teacher's lm_head is gathered while the chunk loop
reads them all. Per-teacher figures for logging (`kd_soft_loss/<name>`, `kd_top1_agreement/<name>`) are measured on
up to 256 scored rows that give the teacher a weight > 0: the divergence of the student against that teacher alone
and how often their most likely tokens agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import reference
from ..config import KDLossConfig
from ..conventions import apply_softcap
from ..ops.backend import compute_dtype, logits_fp32, no_autocast

__all__ = ["TeacherSet", "head_logits", "per_teacher_metrics"]

METRIC_ROWS = 256  # rows per teacher the logged figures are measured on (one host sync, logging steps only)


@dataclass
class TeacherSet:
    """The teachers of one call and each row's weights over them.

    models: name -> teacher (a *ForCausalLM sharing the student's tokenizer; heads may be padded differently).
    weights: (J,) one mixture for every row, (B, J) per sequence or (B, T, J) per position; >= 0, summing to 1
        on scored rows; one-hot rows are routed. mixture: "distribution" (P = sum_j w_j P_j, the default) or
        "loss" (sum_j w_j D(S, P_j)); see reference.multi_teacher_kd_loss.
    """

    models: dict[str, nn.Module]
    weights: torch.Tensor
    mixture: str = "distribution"

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("a TeacherSet needs at least one teacher: models={'name': teacher_model, ...}")
        if self.weights.shape[-1] != len(self.models):
            raise ValueError(
                f"teacher weights have {self.weights.shape[-1]} columns but there are {len(self.models)} teachers "
                f"({list(self.models)}); one weight per teacher, in that order"
            )

    def row_weights(self, leading: torch.Size, device: torch.device) -> torch.Tensor:
        """(*leading, J) weights for (B, T) positions."""
        w = self.weights.to(device)
        if w.dim() == 2 and len(leading) == 2:  # per sequence: every position of a row gets its row's weights
            w = w[:, None, :]
        return w.expand(*leading, w.shape[-1])


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias, rows: torch.Tensor) -> torch.Tensor:
    """fp32 logits of `rows`, as the fused losses take them: the product in the hidden states' dtype (the autocast dtype
    under autocast) with an fp32 output, never rounded to bf16 before a softmax."""
    flat = hidden.reshape(-1, hidden.shape[-1])[rows]
    dtype = compute_dtype(flat.device, flat)
    with no_autocast(flat.device):
        return logits_fp32(flat.to(dtype), weight.to(dtype), bias).float()


@torch.no_grad()
def per_teacher_metrics(teachers: TeacherSet, student_rows, teacher_rows, caps, weights, targets, cfg: KDLossConfig):
    """{"kd_soft_loss/<name>": D(S, P_j), "kd_top1_agreement/<name>": top-1 agreement} on up to METRIC_ROWS scored
    rows whose weight for teacher j is > 0 (0 for a teacher no row of this batch uses)."""
    scored = targets.reshape(-1) != cfg.ignore_index
    flat_w = weights.reshape(-1, weights.shape[-1])
    vocab = cfg.vocab_size
    result = {}
    for j, name in enumerate(teachers.models):
        rows = (scored & (flat_w[:, j] > 0)).nonzero().squeeze(-1)[:METRIC_ROWS]
        if rows.numel() == 0:
            zero = torch.zeros((), device=targets.device)
            result[f"kd_soft_loss/{name}"], result[f"kd_top1_agreement/{name}"] = zero, zero
            continue
        student = apply_softcap(student_rows(rows)[:, :vocab], cfg.softcap)
        teacher = apply_softcap(teacher_rows[j](rows)[:, :vocab], caps[j])
        divergence = reference.generalized_jsd_per_row(student, teacher, beta=cfg.beta, temperature=cfg.temperature)
        result[f"kd_soft_loss/{name}"] = divergence.mean()
        result[f"kd_top1_agreement/{name}"] = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
    return result
