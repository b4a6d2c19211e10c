"""Several live teachers in one KD forward: each row scored against its own teacher (routing, one-hot weights) or
against a mixture of them, fused (`teacher_set_forward`: losses.fused_linear_multi_teacher_jsd on every teacher's
last hidden states) or on materialised logits (`materialised_teacher_set`: reference.multi_teacher_kd_loss).

The teachers run one inside the other's forward (teacher 1's forward asks teacher 2 for its hidden states, ...,
and the innermost computes the loss), so that under FSDP every teacher's lm_head is gathered while the chunk loop
reads them all. Per-teacher figures for logging (`kd_soft_loss/<name>`, `kd_top1_agreement/<name>`) are measured on
up to 256 scored rows that give the teacher a weight > 0: the divergence of the student against that teacher alone
and how often their most likely tokens agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import reference
from ..config import KDLossConfig
from ..conventions import apply_softcap
from ..distributed import gathered_weights
from ..losses import fused_linear_multi_teacher_jsd
from .backbone import (
    backbone_masks,
    router_aux_loss,
    run_backbone,
    teacher_vision_inputs,
    with_router_aux_loss,
)
from .heads import output_head
from .kd_io import KDCausalLMOutput, kd_output
from .materialised import TEACHER_INPUT_KEYS
from .transforms import scaled_head_inputs

__all__ = ["TeacherSet", "materialised_teacher_set", "teacher_set_forward"]

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


TeacherCall = Callable[..., Any]  # models.kd_forward.call_teacher, passed in (this module sits below kd_forward)


def teacher_set_forward(
    model: nn.Module,
    input_ids,
    attention_mask,
    labels,
    targets: torch.Tensor,
    cfg: KDLossConfig,
    num_items_in_batch,
    kwargs: dict,
    teachers: TeacherSet,
    log_metrics: bool,
    call_teacher: TeacherCall,
) -> KDCausalLMOutput:
    """The fused KD forward against several teachers; `call_teacher(teacher, ids, mask, kwargs, loss_on)` runs
    `loss_on(hidden, weight, bias, softcap)` inside a teacher's own forward (models.kd_forward.call_teacher)."""
    models = list(teachers.models.values())
    student_mask, *masks = backbone_masks([model, *models], attention_mask, targets, cfg.ignore_index, kwargs)
    decoder_out = run_backbone(model, input_ids, student_mask, kwargs, labels)
    hidden = decoder_out.last_hidden_state
    grad_enabled = torch.is_grad_enabled()
    with gathered_weights(model.get_output_embeddings(), owner=model):
        head = output_head(model, "student")
        hidden, student_bias = scaled_head_inputs(model, hidden, head.bias)
        weights = teachers.row_weights(targets.shape, hidden.device)
        measured: dict[str, torch.Tensor] = {}

        def loss_on(gathered: list[tuple]):
            if log_metrics:
                student_rows = lambda rows: head_logits(hidden, head.weight, student_bias, rows)  # noqa: E731
                teacher_rows = [lambda rows, t=t: head_logits(t[0], t[1], t[2], rows) for t in gathered]
                caps = [t[3] for t in gathered]
                measured.update(per_teacher_metrics(teachers, student_rows, teacher_rows, caps, weights, targets, cfg))
            with torch.set_grad_enabled(grad_enabled):
                return fused_linear_multi_teacher_jsd(
                    hidden, head.weight, [t[0] for t in gathered], [t[1] for t in gathered], weights, targets,
                    num_items_in_batch=num_items_in_batch, student_bias=student_bias,
                    teacher_biases=[t[2] for t in gathered], teacher_softcaps=[t[3] for t in gathered],
                    mixture=teachers.mixture, config=cfg, return_components=True,
                )  # fmt: skip

        out = _nested(models, call_teacher, input_ids, masks, kwargs, loss_on)
    aux_loss = router_aux_loss(model, decoder_out, attention_mask)
    return kd_output(
        decoder_out, loss=with_router_aux_loss(model, out.loss, aux_loss), logits=None, kd_soft_loss=out.soft,
        kd_hard_loss=out.hard, aux_loss=aux_loss, kd_teacher_metrics=measured or None,
    )  # fmt: skip


def _nested(models, call_teacher, input_ids, masks, kwargs, loss_on, gathered=()):
    """Teacher k's forward (with attention mask masks[k]) calls teacher k + 1's; the innermost runs `loss_on` with
    every teacher's head inputs."""
    if len(gathered) == len(models):
        return loss_on(list(gathered))

    def next_teacher(h_t, w_t, b_t, cap_t):
        return _nested(models, call_teacher, input_ids, masks, kwargs, loss_on, (*gathered, (h_t, w_t, b_t, cap_t)))

    k = len(gathered)
    return call_teacher(models[k], input_ids, masks[k], kwargs, next_teacher)


def materialised_teacher_set(
    student: nn.Module,
    student_forward: Callable[..., Any],
    teachers: TeacherSet,
    targets: torch.Tensor,
    cfg: KDLossConfig,
    num_items_in_batch,
    model_inputs: dict[str, Any],
    log_metrics: bool = False,
) -> KDCausalLMOutput:
    """Every model's logits, scored by reference.multi_teacher_kd_loss: the baseline of `teacher_set_forward`
    (use_kd_patch=False). The models' forwards apply their own soft-caps."""
    model_inputs = {**model_inputs, "use_cache": False}
    out = student_forward(**model_inputs)
    student_logits = reference.upcast_logits(out.logits)
    teacher_logits = []
    for teacher in teachers.models.values():
        inputs = {k: model_inputs[k] for k in TEACHER_INPUT_KEYS if model_inputs.get(k) is not None}
        inputs.update(teacher_vision_inputs(teacher, model_inputs))
        with torch.no_grad():
            teacher_logits.append(reference.upcast_logits(teacher(**inputs, use_cache=False).logits))
    weights = teachers.row_weights(targets.shape, student_logits.device)
    cfg = cfg.replace(softcap=None, teacher_softcap=None)

    def term(soft_weight: float, hard_weight: float) -> torch.Tensor:
        return reference.multi_teacher_kd_loss(
            student_logits, teacher_logits, weights, targets, cfg.replace(soft_weight=soft_weight,
            hard_weight=hard_weight), num_items_in_batch, mixture=teachers.mixture,
        )  # fmt: skip

    soft = term(1.0, 0.0)
    hard = term(0.0, 1.0) if cfg.hard_weight else torch.zeros_like(soft)
    aux_loss = out.get("aux_loss")
    loss = with_router_aux_loss(student, cfg.soft_weight * soft + cfg.hard_weight * hard, aux_loss)
    measured = None
    if log_metrics:
        flat_s = student_logits.reshape(-1, student_logits.shape[-1])
        flat_t = [z.reshape(-1, z.shape[-1]) for z in teacher_logits]
        student_rows = lambda rows: flat_s[rows]  # noqa: E731
        teacher_rows = [lambda rows, z=z: z[rows] for z in flat_t]
        measured = per_teacher_metrics(
            teachers, student_rows, teacher_rows, [None] * len(flat_t), weights, targets, cfg
        )
    return kd_output(
        out, loss=loss, logits=out.logits, kd_soft_loss=soft.detach(), kd_hard_loss=hard.detach(),
        aux_loss=aux_loss, kd_teacher_metrics=measured,
    )  # fmt: skip


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias, rows: torch.Tensor) -> torch.Tensor:
    flat = hidden.reshape(-1, hidden.shape[-1])[rows]
    return F.linear(flat.to(weight.dtype), weight, bias).float()


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
