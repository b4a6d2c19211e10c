"""What goes into and comes out of a KD forward: label shifting and the output type (the teacher of one call is
models/signals/'s)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
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


def shift_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """HF style: row t is scored against token t + 1; the last position has no target."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def targets_of(labels: torch.Tensor, given_shift: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """The row-aligned targets: transformers' pre-shifted `shift_labels` when it passes them (packed
    sequences, context parallelism), else `labels` shifted here."""
    return given_shift if given_shift is not None else shift_labels(labels, ignore_index)
