"""The signals a batch carries: a teacher's hidden states and head, its top-k log-probs, its sampled tokens (with
or without the top-k). Nothing runs a teacher here."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ... import reference
from ...batch.columns import (
    TEACHER_HIDDEN_STATES,
    TEACHER_LOGPROBS,
    TEACHER_SAMPLE_COUNTS,
    TEACHER_SAMPLE_IDS,
    TEACHER_SAMPLE_LOGPROBS,
    TEACHER_TOKEN_IDS,
)
from ...losses import fused_linear_sampled_kd, fused_linear_topk_kd
from .base import (
    TeacherSignal,
    Terms,
    linear_terms,
    logits_terms,
    soft_only,
    stored_paired,
    top1_agreement,
)


@dataclass(frozen=True)
class TopKTeacher(TeacherSignal):
    token_ids: torch.Tensor  # (B, T, K), positions aligned like logits
    logprobs: torch.Tensor  # (B, T, K), log-probs at temperature 1 over the full vocabulary

    def paired(self, privileged, targets, ignore_index):
        names = {"token_ids": TEACHER_TOKEN_IDS, "logprobs": TEACHER_LOGPROBS}
        return stored_paired(self, names, privileged, targets, ignore_index)

    def top1(self):
        """rows -> the teacher's most likely token on those rows."""
        k = self.token_ids.shape[-1]
        flat_ids, flat_lp = self.token_ids.reshape(-1, k), self.logprobs.reshape(-1, k)
        return lambda rows: flat_ids[rows].gather(-1, flat_lp[rows].float().argmax(-1, keepdim=True)).squeeze(-1)

    def fused(self, student, scored, rows):
        out = fused_linear_topk_kd(
            student.hidden, student.head.weight, self.token_ids, self.logprobs, scored.targets,
            student_bias=student.bias, num_items_in_batch=scored.num_items_in_batch, config=scored.cfg,
            return_components=True,
        )  # fmt: skip
        agreement = top1_agreement(student, scored, self.top1()) if scored.log_agreement else None
        return Terms(out=out, agreement=agreement)

    def materialised(self, student_logits, scored, model_inputs):
        soft = reference.topk_kd_loss(
            student_logits, self.token_ids, self.logprobs, scored.targets, soft_only(scored.cfg),
            scored.num_items_in_batch,
        )  # fmt: skip
        top1 = self.token_ids.gather(-1, self.logprobs.float().argmax(-1, keepdim=True)).squeeze(-1)
        return Terms(soft=soft, teacher_top1=top1)


@dataclass(frozen=True)
class SampledTeacher(TeacherSignal):
    """Sampled teacher tokens (B, T, m): ids, how often each was drawn, their log-probs; with the hybrid's top-k."""

    sample_ids: torch.Tensor
    sample_counts: torch.Tensor
    sample_logprobs: torch.Tensor
    topk: TopKTeacher | None = None

    def paired(self, privileged, targets, ignore_index):
        names = {"sample_ids": TEACHER_SAMPLE_IDS, "sample_counts": TEACHER_SAMPLE_COUNTS,
                 "sample_logprobs": TEACHER_SAMPLE_LOGPROBS}  # fmt: skip
        topk = None if self.topk is None else self.topk.paired(privileged, targets, ignore_index)
        return replace(stored_paired(self, names, privileged, targets, ignore_index), topk=topk)

    def _topk(self) -> dict:
        if self.topk is None:
            return {TEACHER_TOKEN_IDS: None, TEACHER_LOGPROBS: None}
        return {TEACHER_TOKEN_IDS: self.topk.token_ids, TEACHER_LOGPROBS: self.topk.logprobs}

    def fused(self, student, scored, rows):  # no agreement measured
        out = fused_linear_sampled_kd(
            student.hidden, student.head.weight, self.sample_ids, self.sample_counts, self.sample_logprobs,
            scored.targets, **self._topk(), student_bias=student.bias, num_items_in_batch=scored.num_items_in_batch,
            config=scored.cfg, return_components=True,
        )  # fmt: skip
        return Terms(out=out)

    def materialised(self, student_logits, scored, model_inputs):
        topk = self._topk()
        soft = reference.sampled_kd_loss(
            student_logits, self.sample_ids, self.sample_counts, self.sample_logprobs, scored.targets,
            soft_only(scored.cfg), scored.num_items_in_batch, topk_ids=topk[TEACHER_TOKEN_IDS],
            topk_logprobs=topk[TEACHER_LOGPROBS],
        )  # fmt: skip
        return Terms(soft=soft)


@dataclass(frozen=True)
class HiddenTeacher(TeacherSignal):
    """A teacher's last hidden states (B, T, H_t) and its lm_head (its soft-cap is the options' teacher_softcap)."""

    hidden_states: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    behaviour: torch.Tensor | None = None

    def paired(self, privileged, targets, ignore_index):
        return stored_paired(self, {"hidden_states": TEACHER_HIDDEN_STATES}, privileged, targets, ignore_index)

    def with_behaviour(self, behaviour):
        return replace(self, behaviour=behaviour)

    def fused(self, student, scored, rows):
        return linear_terms(student, scored, self.behaviour, None, self.hidden_states, self.weight, self.bias,
                            scored.cfg.teacher_softcap)  # fmt: skip

    def materialised(self, student_logits, scored, model_inputs):
        teacher_logits = F.linear(self.hidden_states, self.weight, self.bias)
        return logits_terms(student_logits, teacher_logits, scored, scored.cfg, self.behaviour)
