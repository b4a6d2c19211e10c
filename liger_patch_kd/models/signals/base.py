"""What every teacher signal shares: the call's scored rows, the student's head inputs, the interface
(`fused`, `materialised`, pairing with a teacher prompt) and the loss calls the kinds have in common."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from ... import reference
from ...config import KDLossConfig
from ...losses import KDLossOutput, fused_linear_jsd
from ..heads import HeadInputs
from ..privileged import PrivilegedInputs


@dataclass(frozen=True)
class Scored:
    """What the loss of one call scores: row-aligned targets, the options, the reduction's count, and whether to
    measure the top-1 agreement (logging steps)."""

    targets: torch.Tensor
    cfg: KDLossConfig
    num_items_in_batch: Any = None
    log_agreement: bool = False


@dataclass(frozen=True)
class StudentRows:
    """The student's batch as a live teacher reads it: its tokens, its attention mask, the check of whether that mask
    only pads the end of rows (models.backbone.PaddingCheck: a teacher's backbone may then drop it) and the other
    keywords of the call."""

    input_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    padding: Any
    kwargs: dict


@dataclass
class Terms:
    """A signal's loss: `out` (fused: loss, soft, hard) or `soft` (and `hard` when the signal makes its own) on
    materialised logits; the teacher's top-1 per position (materialised) or the measured agreement (fused); a
    teacher set's per-teacher figures."""

    out: KDLossOutput | None = None
    soft: torch.Tensor | None = None
    hard: torch.Tensor | None = None
    teacher_top1: torch.Tensor | None = None
    agreement: torch.Tensor | None = None
    metrics: dict | None = None


class TeacherSignal:
    """One kind of teacher signal (see the module docstring)."""

    def paired(self, privileged: PrivilegedInputs, targets: torch.Tensor, ignore_index: int) -> TeacherSignal:
        """This signal at the student's positions, when the teacher read its own rows (a teacher prompt)."""
        raise NotImplementedError

    def with_behaviour(self, behaviour: torch.Tensor) -> TeacherSignal:
        """The "pg" estimator's behaviour log-probs (row-aligned), kept by the kinds whose loss weighs them (a live
        teacher, hidden states). Any other kind refuses them: dropping them would train the uncorrected objective
        on an engine's stale samples without a word."""
        raise ValueError(
            f"kd_behaviour_logprobs (the engine's log-probs of its samples: kd_generation_url with "
            f"kd_onpolicy_loss='pg') importance-correct the policy gradient against one full teacher, and a "
            f"{type(self).__name__} signal cannot weigh them: use one teacher_model or kd_teacher_protocol='hidden', "
            f"or kd_onpolicy_loss='divergence' / 'k1'"
        )

    def fused(self, student: HeadInputs, scored: Scored, rows: StudentRows) -> Terms:
        raise NotImplementedError

    def materialised(self, student_logits: torch.Tensor, scored: Scored, model_inputs: dict) -> Terms:
        """The KD term on the student's logits (soft-capped by its forward: scored.cfg.softcap is None), and the
        CE term when the kind makes its own (a teacher set); otherwise the driver adds CE (models/materialised.py)."""
        raise NotImplementedError


def stored_paired(signal, names: dict[str, str], privileged, targets, ignore_index):
    """A stored signal's per-position tensors (attribute -> column name) gathered to the student's positions."""
    given = {column: getattr(signal, attr) for attr, column in names.items() if getattr(signal, attr) is not None}
    aligned = privileged.align_stored(given, targets, ignore_index)
    return replace(signal, **{attr: aligned[column] for attr, column in names.items() if column in aligned})


def linear_terms(
    student: HeadInputs, scored: Scored, behaviour, align, h_t, w_t, b_t, teacher_softcap: float | None
) -> Terms:
    """The fused loss against a teacher's hidden states and head (live or given; `align` takes a teacher's own rows
    to the student's positions, None when they are the student's), and the agreement if asked. The argument order is
    a HeadRequest's: a live teacher's forward completes the call with its head inputs (h_t, w_t, b_t, soft-cap)."""
    if align is not None:
        h_t = align(h_t)
    cfg = scored.cfg
    if teacher_softcap != cfg.teacher_softcap:
        cfg = cfg.replace(teacher_softcap=teacher_softcap)
    agreement = None
    if scored.log_agreement:
        agreement = top1_agreement(student, scored, linear_top1(h_t, w_t, b_t, cfg.vocab_size))
    out = fused_linear_jsd(
        student.hidden, student.head.weight, h_t, w_t, scored.targets, teacher_bias=b_t, behaviour_logprobs=behaviour,
        student_bias=student.bias, num_items_in_batch=scored.num_items_in_batch, config=cfg, return_components=True,
    )  # fmt: skip
    return Terms(out=out, agreement=agreement)


def soft_only(cfg: KDLossConfig) -> KDLossConfig:
    """The KD term alone: the CE term is the materialised driver's (models/materialised.py)."""
    return cfg.replace(soft_weight=1.0, hard_weight=0.0)


def logits_terms(student_logits, teacher_logits, scored: Scored, cfg: KDLossConfig, behaviour) -> Terms:
    teacher_logits = reference.upcast_logits(teacher_logits)
    soft = reference.kd_loss(student_logits, teacher_logits, scored.targets, soft_only(cfg), scored.num_items_in_batch,
                             behaviour_logprobs=behaviour)  # fmt: skip
    vocab = cfg.vocab_size
    top1 = (teacher_logits if vocab is None else teacher_logits[..., :vocab]).argmax(-1)
    return Terms(soft=soft, teacher_top1=top1)


def linear_top1(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, vocab_size: int | None):
    """rows -> the teacher's most likely real token on those rows (soft-capping is monotone: argmax unchanged)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    weight, bias = weight[:vocab_size], None if bias is None else bias[:vocab_size]
    return lambda rows: F.linear(flat[rows].to(weight.dtype), weight, bias).argmax(-1)


@torch.no_grad()
def top1_agreement(student: HeadInputs, scored: Scored, teacher_top1, max_rows: int = 256):
    """How often the student's most likely real token is the teacher's, on up to `max_rows` scored rows."""
    cfg = scored.cfg
    rows = (scored.targets.reshape(-1) != cfg.ignore_index).nonzero().squeeze(-1)[:max_rows]
    if rows.numel() == 0:
        return torch.zeros((), device=student.hidden.device)
    head = student.head
    weight = head.weight[: cfg.vocab_size]
    bias = None if head.bias is None else head.bias[: cfg.vocab_size]
    flat = student.hidden.reshape(-1, student.hidden.shape[-1])[rows]
    student_top1 = F.linear(flat.to(weight.dtype), weight, bias).argmax(-1)
    return (student_top1 == teacher_top1(rows).to(student_top1.device)).float().mean()
