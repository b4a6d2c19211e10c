"""What goes into and comes out of a KD forward: the teacher of one call, label shifting, the output type."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast


@dataclass
class KDCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus the distillation terms as real `ModelOutput` fields.

    They must be fields, not attributes set afterwards: mixed-precision wrappers (accelerate's
    `convert_outputs_to_fp32`, used with `bf16=True`) rebuild the output from its keys and drop the rest.
    kd_soft_loss / kd_hard_loss: the KD and CE terms alone (detached, same reduction as `loss`);
    kd_top1_agreement: how often the student's most likely token is the teacher's (asked for on logging steps).
    kd_teacher_metrics: with several teachers, {"kd_soft_loss/<name>": ..., "kd_top1_agreement/<name>": ...}
    (models/teachers.py; asked for on logging steps).
    aux_loss / router_logits: a mixture-of-experts model's router outputs, passed through.
    """

    kd_soft_loss: torch.FloatTensor | None = None
    kd_hard_loss: torch.FloatTensor | None = None
    kd_top1_agreement: torch.FloatTensor | None = None
    kd_teacher_metrics: dict[str, torch.Tensor] | None = None
    aux_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None


def kd_output(source, **fields) -> KDCausalLMOutput:
    """A KDCausalLMOutput carrying `source`'s fields that it knows (past_key_values, hidden_states, ...)."""
    known = KDCausalLMOutput.__dataclass_fields__
    carried = {k: v for k, v in source.items() if k in known and k not in ("loss", "logits")}
    return KDCausalLMOutput(**{**carried, **fields})


@dataclass
class TeacherInputs:
    """The teacher of one call: a live model, its hidden states and lm_head, or its log-probs (exactly one).
    Log-probs are top-k (token_ids / logprobs), sampled tokens (sample_ids / _counts / _logprobs), or both (the
    hybrid of losses.fused_linear_sampled_kd)."""

    model: nn.Module | None = None
    hidden_states: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sample_ids: torch.Tensor | None = None
    sample_counts: torch.Tensor | None = None
    sample_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        sources = {
            "teacher_model": self.model,
            "teacher_hidden_states": self.hidden_states,
            "teacher_token_ids": self.token_ids if self.sample_ids is None else None,
            "teacher_sample_ids": self.sample_ids,
        }
        given = [name for name, value in sources.items() if value is not None]
        if len(given) > 1:
            raise ValueError(
                f"pass one teacher source, not {given}: a live teacher_model, teacher_hidden_states + teacher_weight, "
                f"or teacher_token_ids + teacher_logprobs"
            )
        if self.hidden_states is not None and self.weight is None:
            raise ValueError(
                "teacher_hidden_states needs teacher_weight (the teacher's lm_head weight, (vocab, hidden))"
            )
        if self.token_ids is not None and self.logprobs is None:
            raise ValueError("teacher_token_ids needs teacher_logprobs of the same shape (B, T, K)")
        if self.sample_ids is not None and (self.sample_counts is None or self.sample_logprobs is None):
            raise ValueError("teacher_sample_ids needs teacher_sample_counts and teacher_sample_logprobs (B, T, m)")

    @property
    def given(self) -> bool:
        return any(t is not None for t in (self.model, self.hidden_states, self.token_ids, self.sample_ids))


def shift_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """HF style: row t is scored against token t + 1; the last position has no target."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def targets_of(labels: torch.Tensor, given_shift: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """The row-aligned targets: transformers' pre-shifted `shift_labels` when it passes them (packed
    sequences, context parallelism), else `labels` shifted here."""
    return given_shift if given_shift is not None else shift_labels(labels, ignore_index)


def behaviour_targets(
    behaviour: torch.Tensor | None, given_shift: torch.Tensor | None, teacher: TeacherInputs
) -> torch.Tensor | None:
    """Label-aligned behaviour log-probs (B, T) (an engine's log b of each label) shifted to the rows the targets
    score; refused where they cannot be paired: pre-shifted packed labels, or a top-k teacher (no sampled-token
    estimator runs on one)."""
    if behaviour is None:
        return None
    if given_shift is not None:
        raise ValueError("kd_behaviour_logprobs are label-aligned: they cannot be paired with pre-shifted shift_labels "
                         "(packed sequences); generated rollouts are not packed")  # fmt: skip
    if teacher.token_ids is not None:
        raise ValueError("kd_behaviour_logprobs weigh the sampled-token policy gradient, which needs a full teacher "
                         "(teacher_model or hidden states), not top-k teacher_token_ids")  # fmt: skip
    return F.pad(behaviour[..., 1:], (0, 1), value=0.0)
