"""The distillation objective on materialised logits, through reference/: the baseline that the fused path
is checked against, and what runs with `fused_linear_jsd=False`, `return_logits=True` or
`KDTrainer(use_kd_patch=False)`. One implementation for the three, so they cannot drift apart."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import reference
from ..config import KDLossConfig
from .backbone import teacher_vision_inputs, with_router_aux_loss
from .kd_io import KDCausalLMOutput, TeacherInputs, kd_output
from .privileged import PrivilegedInputs

# What a live teacher gets of the student's inputs: the tokens and how they are laid out (padding, packing).
# Anything else (pixel_values of a VLM student, labels) is the student's own.
TEACHER_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


def materialised_kd(
    student: nn.Module,
    student_forward: Callable[..., Any],
    teacher: TeacherInputs,
    targets: torch.Tensor,
    cfg: KDLossConfig,
    num_items_in_batch: int | torch.Tensor | None,
    model_inputs: dict[str, Any],
    log_agreement: bool = False,
    behaviour_logprobs: torch.Tensor | None = None,
    privileged: PrivilegedInputs | None = None,
) -> KDCausalLMOutput:
    """Run the student (and a live teacher) for their logits and score them with reference/.

    `student` is the unwrapped *ForCausalLM (its router-loss settings count); `student_forward(**model_inputs)`
    (its forward, or a wrapper's) must return the model's output with `.logits` (soft-capped by the model
    itself, as every HF forward does). `targets` are row-aligned (already shifted). Both models run without a
    KV cache: besides saving memory, transformers only keeps packed sequences (position_ids restarting, no
    attention mask) apart when no cache is in use. `behaviour_logprobs` (row-aligned like `targets`): the "pg"
    estimator's behaviour policy (reference.kd_loss). With `privileged` the live teacher reads its own rows and its
    logits are gathered into the student's positions (models/privileged.py).
    """
    align = None
    if privileged is not None:  # the pairing checked before either model runs
        teacher, align = privileged.prepare(teacher, targets, cfg.ignore_index)
    model_inputs = {**model_inputs, "use_cache": False}
    out = student_forward(**model_inputs)
    student_logits = reference.upcast_logits(out.logits)
    cfg = cfg.replace(softcap=None)  # the model's forward has applied its own soft-capping already
    soft_only = cfg.replace(soft_weight=1.0, hard_weight=0.0)
    teacher_top1 = None
    if teacher.sample_ids is not None:
        soft = reference.sampled_kd_loss(
            student_logits, teacher.sample_ids, teacher.sample_counts, teacher.sample_logprobs, targets, soft_only,
            num_items_in_batch, topk_ids=teacher.token_ids, topk_logprobs=teacher.logprobs,
        )  # fmt: skip
    elif teacher.token_ids is not None:
        soft = reference.topk_kd_loss(
            student_logits, teacher.token_ids, teacher.logprobs, targets, soft_only, num_items_in_batch
        )
        teacher_top1 = teacher.token_ids.gather(-1, teacher.logprobs.float().argmax(-1, keepdim=True)).squeeze(-1)
    else:
        if teacher.model is not None:
            if privileged is None:
                teacher_inputs = {k: model_inputs[k] for k in TEACHER_INPUT_KEYS if model_inputs.get(k) is not None}
                teacher_inputs.update(teacher_vision_inputs(teacher.model, model_inputs))  # a VLM teacher's image
            else:  # the teacher's own prompt: its own rows, nothing of the student's
                teacher_inputs = {"input_ids": privileged.input_ids, "attention_mask": privileged.attention_mask,
                                  **privileged.teacher_kwargs()}  # fmt: skip
            with torch.no_grad():
                teacher_logits = teacher.model(**{"use_cache": False, **teacher_inputs}).logits
                teacher_logits = teacher_logits if align is None else align(teacher_logits)  # a live teacher's own rows
            soft_only = soft_only.replace(teacher_softcap=None)  # likewise already in the teacher's logits
        else:
            teacher_logits = F.linear(teacher.hidden_states, teacher.weight, teacher.bias)
        teacher_logits = reference.upcast_logits(teacher_logits)
        soft = reference.kd_loss(
            student_logits, teacher_logits, targets, soft_only, num_items_in_batch,
            behaviour_logprobs=behaviour_logprobs,
        )  # fmt: skip
        teacher_top1 = _real_vocab(teacher_logits, cfg).argmax(-1)
    hard = torch.zeros_like(soft)
    if cfg.hard_weight:
        ce = reference.cross_entropy_per_row(_real_vocab(student_logits, cfg), targets, cfg.ignore_index)
        hard = reference.reduce_rows(
            ce, targets, reduction=cfg.reduction, ignore_index=cfg.ignore_index, num_items_in_batch=num_items_in_batch
        )
    loss = cfg.soft_weight * soft + cfg.hard_weight * hard
    aux_loss = out.get("aux_loss")  # a mixture of experts' router loss, added as its own forward adds it to CE
    loss = with_router_aux_loss(student, loss, aux_loss)
    agreement = None
    if log_agreement and teacher_top1 is not None:
        valid = targets != cfg.ignore_index
        same = (_real_vocab(student_logits, cfg).argmax(-1) == teacher_top1.to(student_logits.device)) & valid
        agreement = (same.sum() / valid.sum().clamp(min=1)).detach().float()
    return kd_output(
        out, loss=loss, logits=out.logits, kd_soft_loss=soft.detach(), kd_hard_loss=hard.detach(),
        kd_top1_agreement=agreement, aux_loss=aux_loss,
    )  # fmt: skip


def _real_vocab(logits: torch.Tensor, cfg: KDLossConfig) -> torch.Tensor:
    """The columns of real tokens (`vocab_size`); padding rows of a head never count as a prediction."""
    return logits if cfg.vocab_size is None else logits[..., : cfg.vocab_size]
