"""The loss of a teacher set's members in process, each row scored against its own members (routed: one; mixed:
their weights, the batch's `teacher_mixture`), the student run once. Members of the student's tokenizer go through
the fused several-teacher loss (models.teachers.TeacherSet: the mixture of distributions by default,
kd_teacher_mixture="loss" for the mixture of losses), through the patched forward (fused) or on materialised logits.

With members of other tokenizers (set_text_rows.py collates their rows) the student-tokenizer members' share goes
through losses.fused_linear_multi_teacher_jsd and each other-tokenizer member's through the fused cross-tokenizer
loss (other_tokenizer_loss.live_teacher_loss), one denominator for all. As with one teacher of another tokenizer,
the models' decoders are called directly (not the patched forward), so that path suits DDP / single-device runs;
use_kd_patch does not change it (both parts are fused, no logits).

Logged per member on logging steps: `kd_soft_loss/<name>` and `kd_top1_agreement/<name>`. A student-tokenizer
member's are models.teachers.per_teacher_metrics' (up to 256 of its rows). A member of another tokenizer's
`kd_soft_loss/<name>` is its cross-tokenizer loss per labelled student token of its rows (each row weighted by
its weight for that member: routed rows, the plain mean), read off the training call; its top-1 agreement is
measured on up to 256 one-to-one groups (one token each side, the same text span after the same text), where the
two most likely tokens agree if they are the same string (the vocabulary map's pair; a token outside the map
never agrees). A member no row of the batch uses logs 0 for both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...batch.columns import (
    ALIGN_EXACT_OK,
    STUDENT_ALIGN_GROUPS,
    TEACHER_ALIGN_GROUPS,
    TEACHER_INPUT_IDS,
    TEACHER_SAMPLE_IDS,
    TEACHER_TOKEN_IDS,
    TOKENIZER_TEACHERS,
)
from ...config import KDLossConfig
from ...losses import fused_linear_multi_teacher_jsd
from ...models import unwrap_model
from ...models.kd_io import KDCausalLMOutput, shift_labels, targets_of
from ...models.materialised import materialised_kd
from ...models.registry import softcap_of
from ...models.signals import Scored, TeacherMix
from ...models.teachers import METRIC_ROWS, TeacherSet, head_logits, per_teacher_metrics
from .other_tokenizer_loss import last_hidden_and_head, live_teacher_loss, model_head_inputs
from .set_text_rows import TokenizerTeachers


def live_set_loss(model: nn.Module, teachers: dict[str, nn.Module], tokenizers: TokenizerTeachers | None,
                  mixture: str, inputs: dict, weights: torch.Tensor, num_items_in_batch, cfg: KDLossConfig,
                  fused: bool, log: bool) -> KDCausalLMOutput:  # fmt: skip
    """The KD forward against the in-process members `teachers` (name -> model, in the set's order), `weights` the
    batch's (B, J) mixture: fused through the patched model, else on materialised logits; with members of other
    tokenizers (`tokenizers`), tokenizer_teachers_loss."""
    if tokenizers is not None:  # some members have their own tokenizers
        return tokenizer_teachers_loss(model, teachers, tokenizers, inputs, weights, num_items_in_batch, cfg, log)
    if inputs.get(TEACHER_INPUT_IDS) is not None:  # a teacher's own tokens (other prompt or tokenizer)
        raise ValueError(
            "the batch carries teacher_input_ids (a teacher's own prompt or tokenization), which several "
            "in-process teachers do not read yet: every teacher here scores the student's input_ids"
        )
    if inputs.get(TEACHER_TOKEN_IDS) is not None or inputs.get(TEACHER_SAMPLE_IDS) is not None:
        raise ValueError(
            "batches with teacher_token_ids / teacher_sample_ids (offline data) and several live teachers: pass "
            "one or the other. "
            "Offline rows routed to several teachers are one store whose rows hold each its own teacher's top-k"
        )
    chosen = TeacherSet(teachers, weights, mixture)
    if fused:
        return model(
            **inputs, kd_teacher_set=chosen, num_items_in_batch=num_items_in_batch, kd_log_agreement=log,
            kd_config=cfg,
        )  # fmt: skip
    targets = targets_of(inputs.pop("labels"), inputs.pop("shift_labels", None), cfg.ignore_index)
    scored = Scored(targets, cfg, num_items_in_batch, log)
    return materialised_kd(unwrap_model(model), model, TeacherMix(chosen), scored, inputs)


def tokenizer_teachers_loss(
    model: nn.Module, teachers: dict[str, nn.Module], setup: TokenizerTeachers, inputs: dict, weights: torch.Tensor,
    num_items_in_batch, cfg: KDLossConfig, log: bool,
) -> KDCausalLMOutput:  # fmt: skip
    """soft_weight * KD + hard_weight * CE of the batch, each row against its own members (the module docstring
    of set_text_rows.py); `weights` (B, J) in the order of `setup.names`. The output carries the loss, the two
    terms (detached) and, on logging steps, the per-teacher figures, as the patched forward's."""
    parts = inputs.pop(TOKENIZER_TEACHERS)
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    h_s, head_s = last_hidden_and_head(model, ids, mask)
    h_s, b_s = model_head_inputs(model, h_s, head_s.bias)
    cap = softcap_of(getattr(unwrap_model(model), "config", None))
    ignore = cfg.ignore_index
    targets = shift_labels(inputs["labels"], ignore)
    count = num_items_in_batch if num_items_in_batch is not None else (targets != ignore).sum()
    weights = weights.to(device=h_s.device, dtype=torch.float64 if h_s.dtype == torch.float64 else torch.float32)
    student = (h_s, head_s.weight, b_s)
    loss = h_s[..., :0].sum()  # 0, in the student's graph whatever runs below
    soft, hard = torch.zeros((), device=h_s.device), torch.zeros((), device=h_s.device)
    figures: dict[str, torch.Tensor] = {}
    if setup.same:
        share = weights[:, setup.same].sum(-1)
        if bool((share > 0).any()):
            names = [setup.names[j] for j in setup.same]
            out = _same_tokenizer_part(
                student, {n: teachers[n] for n in names}, ids, mask, targets, weights[:, setup.same], share, count,
                cfg.replace(softcap=cap), setup.mixture, figures if log else None,
            )  # fmt: skip
            loss, soft, hard = loss + out.loss, soft + out.soft, hard + out.hard
    for name, cross in setup.cross.items():
        part = parts.get(name)
        if part is None:  # no row of this batch weighs this teacher
            continue
        share = weights[:, setup.index(name)]
        labels = torch.where(share[:, None] > 0, targets, ignore)
        row_scale = share[:, None].expand_as(targets)
        kept = {} if log else None
        out = live_teacher_loss(
            (*student, labels), teachers[name], part, cross.config.replace(softcap=cap), cross.vocab_map, count,
            row_scale=row_scale, keep=kept,
        )  # fmt: skip
        loss, soft, hard = loss + out.loss, soft + out.soft, hard + out.hard
        if log:
            tokens = (row_scale * (labels != ignore)).sum()
            total = out.soft * torch.as_tensor(count, dtype=out.soft.dtype, device=out.soft.device)
            figures[f"kd_soft_loss/{name}"] = torch.where(tokens > 0, total / tokens.clamp(min=1e-30), 0.0).detach()
            figures[f"kd_top1_agreement/{name}"] = cross_agreement(student, kept, part, cross.vocab_map)
    if log:
        for name in setup.names:  # a teacher no row of this batch uses
            figures.setdefault(f"kd_soft_loss/{name}", torch.zeros((), device=h_s.device))
            figures.setdefault(f"kd_top1_agreement/{name}", torch.zeros((), device=h_s.device))
    return KDCausalLMOutput(loss=loss, kd_soft_loss=soft.detach(), kd_hard_loss=hard.detach(),
                            kd_teacher_metrics=figures or None)  # fmt: skip


def _same_tokenizer_part(student, teachers, ids, mask, targets, weights, share, count, cfg, mixture, figures):
    """The rows' share of the student-tokenizer teachers, `share` (B,) = the sum of their `weights` (B, J_s):
    their (renormalised) mixture through the fused several-teacher loss, each teacher run on its own rows only."""
    h_s, w_s, b_s = student
    hidden, heads, biases, caps = [], [], [], []
    for j, teacher in enumerate(teachers.values()):
        rows = torch.nonzero(weights[:, j] > 0).flatten()
        inner = unwrap_model(teacher)
        head = inner.get_output_embeddings()
        full = torch.zeros((*ids.shape, head.weight.shape[1]), dtype=h_s.dtype, device=h_s.device)
        with torch.no_grad():
            if rows.numel():
                full[rows] = last_hidden_and_head(teacher, ids[rows], None if mask is None else mask[rows])[0].to(
                    full.dtype
                )
            full, bias = model_head_inputs(teacher, full, head.bias)
        hidden.append(full)
        heads.append(head.weight)
        biases.append(bias)
        caps.append(softcap_of(getattr(inner, "config", None)))
    counted = share > 0
    labels = torch.where(counted[:, None], targets, cfg.ignore_index)
    mixture_weights = torch.where(counted[:, None], weights / share.clamp(min=1e-30)[:, None], 1.0 / weights.shape[1])
    mixture_weights = mixture_weights[:, None, :].expand(*targets.shape, weights.shape[1])
    row_scale = share[:, None].expand_as(targets)
    out = fused_linear_multi_teacher_jsd(
        h_s, w_s, hidden, heads, mixture_weights, labels, num_items_in_batch=count, student_bias=b_s,
        teacher_biases=biases, teacher_softcaps=caps, mixture=mixture, row_scale=row_scale, config=cfg,
        return_components=True,
    )  # fmt: skip
    if figures is not None:
        student_rows = lambda rows: head_logits(h_s, w_s, b_s, rows)  # noqa: E731
        teacher_rows = [lambda rows, t=t: head_logits(t[0], t[1], t[2], rows) for t in zip(hidden, heads, biases)]
        chosen = TeacherSet(teachers, mixture_weights, mixture)
        figures.update(per_teacher_metrics(chosen, student_rows, teacher_rows, caps, mixture_weights, labels, cfg))
    return out


@torch.no_grad()
def cross_agreement(student: tuple, teacher: dict[str, Any], part: dict, vocab_map) -> torch.Tensor:
    """Top-1 agreement of the student and a teacher of another tokenizer on up to METRIC_ROWS one-to-one groups of
    `part` (its columns from TokenizerTeachers.collate): the same token string, through `vocab_map`'s pairs."""
    h_s, w_s, b_s = student
    s_groups = part[STUDENT_ALIGN_GROUPS].reshape(-1)
    s_rows = torch.nonzero((s_groups >= 0) & part[ALIGN_EXACT_OK].reshape(-1)).flatten()[:METRIC_ROWS]
    if s_rows.numel() == 0:
        return torch.zeros((), device=h_s.device)
    t_groups = part[TEACHER_ALIGN_GROUPS].reshape(-1)
    in_group = torch.nonzero(t_groups >= 0).flatten()
    row_of_group = torch.full((int(t_groups.max()) + 1,), -1, dtype=torch.long, device=t_groups.device)
    row_of_group[t_groups[in_group]] = in_group  # a one-to-one group has one teacher row
    t_rows = row_of_group[s_groups[s_rows]]
    s_top = head_logits(h_s, w_s, b_s, s_rows).argmax(-1)
    t_top = head_logits(teacher["hidden"], teacher["weight"], teacher["bias"], t_rows).argmax(-1)
    vocab_map = vocab_map.to(s_top.device)
    as_teacher = torch.full((w_s.shape[0],), -1, dtype=torch.long, device=s_top.device)
    as_teacher[vocab_map.student_ids] = vocab_map.teacher_ids
    return (as_teacher[s_top] == t_top).float().mean()
