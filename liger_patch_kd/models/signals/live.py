"""The signals of live teachers: one teacher model, or several (a TeacherSet), run inside the student's forward
(each asked for its head inputs inside its own: host.py) or for their logits beside it (materialised)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ... import reference
from ...losses import fused_linear_multi_teacher_jsd
from ..privileged import PrivilegedInputs
from ..teachers import TeacherSet, head_logits, per_teacher_metrics
from .base import StudentRows, TeacherSignal, Terms, linear_terms, logits_terms
from .host import run_teacher_head, teacher_inputs


@dataclass(frozen=True)
class LiveTeacher(TeacherSignal):
    """A teacher model run on this call's rows (or on its own, `privileged`, paired by `align`).

    With soft_weight 0 (sequence-level KD: cross-entropy on the teacher's own completions) the KD term weighs
    nothing, so the teacher does not run: the student's own detached head inputs (or logits) stand in for its,
    a finite term multiplied by 0, and the agreement is not measured (the student against itself)."""

    model: nn.Module
    privileged: PrivilegedInputs | None = None
    align: Any = None
    behaviour: torch.Tensor | None = None

    def paired(self, privileged, targets, ignore_index):
        return replace(self, privileged=privileged, align=privileged.align_live(self.model, targets, ignore_index))

    def with_behaviour(self, behaviour):
        return replace(self, behaviour=behaviour)

    def fused(self, student, scored, rows):
        if scored.cfg.soft_weight == 0:  # the KD term weighs nothing: no teacher forward (the class docstring)
            bias = None if student.bias is None else student.bias.detach()
            quiet = replace(scored, log_agreement=False)
            return linear_terms(student, quiet, self.behaviour, None, student.hidden.detach(),
                                student.head.weight.detach(), bias, scored.cfg.teacher_softcap)  # fmt: skip
        # completed inside the teacher's forward with its head inputs (h_t, w_t, b_t, soft-cap), its head gathered
        loss_on = functools.partial(linear_terms, student, scored, self.behaviour, self.align)
        if self.privileged is None:
            return run_teacher_head(self.model, rows.input_ids, rows.attention_mask, rows.kwargs, loss_on,
                                    padding=rows.padding)  # fmt: skip
        own = self.privileged
        return run_teacher_head(self.model, own.input_ids, own.attention_mask, own.teacher_kwargs(), loss_on)

    def materialised(self, student_logits, scored, model_inputs):
        if scored.cfg.soft_weight == 0:  # the KD term weighs nothing: no teacher forward (the class docstring)
            terms = logits_terms(student_logits, student_logits.detach(), scored, scored.cfg, self.behaviour)
            return replace(terms, teacher_top1=None)  # no agreement of the student with itself
        if self.privileged is None:
            inputs = teacher_inputs(self.model, model_inputs)
        else:  # the teacher's own prompt: its own rows, nothing of the student's
            own = self.privileged
            inputs = {"input_ids": own.input_ids, "attention_mask": own.attention_mask, **own.teacher_kwargs()}
        with torch.no_grad():
            teacher_logits = self.model(**{"use_cache": False, **inputs}).logits
            teacher_logits = teacher_logits if self.align is None else self.align(teacher_logits)
        cfg = scored.cfg.replace(teacher_softcap=None)  # the teacher's forward applied its own soft-cap
        return logits_terms(student_logits, teacher_logits, scored, cfg, self.behaviour)


@dataclass(frozen=True)
class TeacherMix(TeacherSignal):
    """Several live teachers (models.teachers.TeacherSet): each row routed to one, or scored against a mixture."""

    teachers: TeacherSet

    def paired(self, privileged, targets, ignore_index):
        raise ValueError(
            "teacher_input_ids (a teacher prompt of its own) with several teachers is not supported: give the "
            "rows one teacher, or drop the teacher_prompt / teacher_input_ids column"
        )

    def fused(self, student, scored, rows):
        teachers, cfg, targets = self.teachers, scored.cfg, scored.targets
        weights = teachers.row_weights(targets.shape, student.hidden.device)
        grad_enabled = torch.is_grad_enabled()
        measured: dict[str, torch.Tensor] = {}

        def loss_on(gathered: list[tuple]):  # inside the innermost teacher's forward, every head gathered
            if scored.log_agreement:
                student_rows = lambda r: head_logits(student.hidden, student.head.weight, student.bias, r)  # noqa: E731
                teacher_rows = [lambda r, t=t: head_logits(t[0], t[1], t[2], r) for t in gathered]
                caps = [t[3] for t in gathered]
                measured.update(per_teacher_metrics(teachers, student_rows, teacher_rows, caps, weights, targets, cfg))
            with torch.set_grad_enabled(grad_enabled):
                return fused_linear_multi_teacher_jsd(
                    student.hidden, student.head.weight, [t[0] for t in gathered], [t[1] for t in gathered],
                    weights, targets, num_items_in_batch=scored.num_items_in_batch, student_bias=student.bias,
                    teacher_biases=[t[2] for t in gathered], teacher_softcaps=[t[3] for t in gathered],
                    mixture=teachers.mixture, config=cfg, return_components=True,
                )  # fmt: skip

        out = _nested(list(teachers.models.values()), rows, loss_on)
        return Terms(out=out, metrics=measured or None)

    def materialised(self, student_logits, scored, model_inputs):
        teacher_logits = []
        for teacher in self.teachers.models.values():
            with torch.no_grad():
                logits = teacher(**teacher_inputs(teacher, model_inputs), use_cache=False).logits
            teacher_logits.append(reference.upcast_logits(logits))
        weights = self.teachers.row_weights(scored.targets.shape, student_logits.device)
        cfg = scored.cfg.replace(teacher_softcap=None)  # the models' forwards apply their own soft-caps

        def term(soft_weight: float, hard_weight: float) -> torch.Tensor:
            return reference.multi_teacher_kd_loss(
                student_logits, teacher_logits, weights, scored.targets, cfg.replace(soft_weight=soft_weight,
                hard_weight=hard_weight), scored.num_items_in_batch, mixture=self.teachers.mixture,
            )  # fmt: skip

        soft = term(1.0, 0.0)
        hard = term(0.0, 1.0) if scored.cfg.hard_weight else torch.zeros_like(soft)
        measured = None
        if scored.log_agreement:
            flat_s = student_logits.reshape(-1, student_logits.shape[-1])
            flat_t = [z.reshape(-1, z.shape[-1]) for z in teacher_logits]
            student_rows = lambda rows: flat_s[rows]  # noqa: E731
            teacher_rows = [lambda rows, z=z: z[rows] for z in flat_t]
            measured = per_teacher_metrics(
                self.teachers, student_rows, teacher_rows, [None] * len(flat_t), weights, scored.targets, cfg
            )
        return Terms(soft=soft, hard=hard, metrics=measured)


def _nested(models: list, rows: StudentRows, loss_on, gathered=()):
    """Teacher k's forward asks teacher k + 1's; the innermost runs `loss_on` with every teacher's head inputs, so
    that under FSDP every teacher's lm_head is gathered while it runs."""
    if len(gathered) == len(models):
        return loss_on(list(gathered))

    def next_teacher(h_t, w_t, b_t, cap_t):
        return _nested(models, rows, loss_on, (*gathered, (h_t, w_t, b_t, cap_t)))

    teacher = models[len(gathered)]
    return run_teacher_head(teacher, rows.input_ids, rows.attention_mask, rows.kwargs, next_teacher,
                            padding=rows.padding)  # fmt: skip
