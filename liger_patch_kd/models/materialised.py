"""The distillation objective on materialised logits, through reference/: the baseline that the fused path
is checked against, and what runs with `fused_linear_jsd=False`, `return_logits=True` or
`KDTrainer(use_kd_patch=False)`. One implementation for the three, so they cannot drift apart; each teacher
signal's own term is its `materialised` method (models/signals/)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .. import reference
from ..config import KDLossConfig
from .backbone import with_router_aux_loss
from .kd_io import KDCausalLMOutput, kd_output
from .signals import Scored, TeacherSignal


def materialised_kd(
    student: nn.Module,
    student_forward: Callable[..., Any],
    signal: TeacherSignal,
    scored: Scored,
    model_inputs: dict[str, Any],
) -> KDCausalLMOutput:
    """Run the student (and a live teacher) for their logits and score them with reference/.

    `student` is the unwrapped *ForCausalLM (its router-loss settings count); `student_forward(**model_inputs)`
    (its forward, or a wrapper's) must return the model's output with `.logits` (soft-capped by the model
    itself, as every HF forward does). `signal` is paired with the rows already (models.signals.bind_rows) and
    `scored.targets` are row-aligned (already shifted). Both models run without a KV cache: besides saving memory,
    transformers only keeps packed sequences (position_ids restarting, no attention mask) apart when no cache is
    in use.
    """
    model_inputs = {**model_inputs, "use_cache": False}
    out = student_forward(**model_inputs)
    student_logits = reference.upcast_logits(out.logits)
    cfg = scored.cfg.replace(softcap=None)  # the model's forward has applied its own soft-capping already
    scored = replace(scored, cfg=cfg)
    terms = signal.materialised(student_logits, scored, model_inputs)
    soft, hard = terms.soft, terms.hard
    if hard is None:
        hard = torch.zeros_like(soft)
        if cfg.hard_weight:
            targets = scored.targets
            ce = reference.cross_entropy_per_row(_real_vocab(student_logits, cfg), targets, cfg.ignore_index)
            hard = reference.reduce_rows(
                ce, targets, reduction=cfg.reduction, ignore_index=cfg.ignore_index,
                num_items_in_batch=scored.num_items_in_batch,
            )  # fmt: skip
    loss = cfg.soft_weight * soft + cfg.hard_weight * hard
    aux_loss = out.get("aux_loss")  # a mixture of experts' router loss, added as its own forward adds it to CE
    loss = with_router_aux_loss(student, loss, aux_loss)
    agreement = None
    if scored.log_agreement and terms.teacher_top1 is not None:
        valid = scored.targets != cfg.ignore_index
        same = (_real_vocab(student_logits, cfg).argmax(-1) == terms.teacher_top1.to(student_logits.device)) & valid
        agreement = (same.sum() / valid.sum().clamp(min=1)).detach().float()
    return kd_output(
        out, loss=loss, logits=out.logits, kd_soft_loss=soft.detach(), kd_hard_loss=hard.detach(),
        kd_top1_agreement=agreement, aux_loss=aux_loss, kd_teacher_metrics=terms.metrics,
    )  # fmt: skip


def _real_vocab(logits: torch.Tensor, cfg: KDLossConfig) -> torch.Tensor:
    """The columns of real tokens (`vocab_size`); padding rows of a head never count as a prediction."""
    return logits if cfg.vocab_size is None else logits[..., : cfg.vocab_size]
