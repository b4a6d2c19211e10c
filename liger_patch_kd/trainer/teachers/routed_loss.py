"""The loss of a teacher set whose members' signal rides in the rows (stored, served top-k, served hidden): each
row is its own member's, so the batch trains as stored rows do, one pass per kind of signal present.

- Rows of top-k / sampled members (a store's, or a server's reply attached ahead of the step): one pass, as any
  stored rows (its `teacher_mixture` kept for the per-member figures of logging steps).
- Rows of hidden members (a server's final hidden states and head: the exact objective) beside them: one pass per
  hidden member, and one for the top-k members together, each scoring only its own member's tokens (the other
  labels ignored) over the whole batch's token count: the sum is the batch's loss, as one pass over one kind would
  give it.

Logged per member on logging steps, when no hidden member's rows are in the batch (one no-grad forward per member
over its own rows, the other rows' labels ignored): `kd_soft_loss/<name>`, the KD term the run trains on (the
top-k loss of its tail policy: a top-k holds no full distribution, so not the full-vocabulary divergence the live
members' figures measure), averaged over that member's scored tokens; `kd_top1_agreement/<name>`, how often the
student's most likely token is the member's (its top-1 is in its top-k: exact).
"""

from __future__ import annotations

import torch

from ...batch.columns import TEACHER_HEAD_SET, TEACHER_HIDDEN_SET, TEACHER_HIDDEN_STATES, TEACHER_MIXTURE, TOPK_COLUMNS
from ...config import KDLossConfig
from .base import KDStepOutput, one_teacher_loss, score_rows
from .routes import TeacherRoutes
from .served_hidden import HeadOnDevice


def routed_rows_loss(model, inputs: dict, routes: TeacherRoutes, heads: dict[str, HeadOnDevice], num_items_in_batch,
                     cfg: KDLossConfig, log_now: bool, fused: bool, behaviour=None) -> KDStepOutput:  # fmt: skip
    """The batch's loss (see the module docstring); `heads`: each hidden member's head on the student's device."""
    states, served_heads = inputs.pop(TEACHER_HIDDEN_SET, None), inputs.pop(TEACHER_HEAD_SET, None)
    if states:  # a hidden member's rows in this batch
        return passes_loss(model, inputs, routes, states, served_heads, heads, num_items_in_batch, cfg, log_now, fused)
    mixture = inputs.pop(TEACHER_MIXTURE, None)  # each row's member
    scored = dict(inputs) if mixture is not None and log_now else None  # the materialised path pops from inputs
    step = one_teacher_loss(model, None, inputs, num_items_in_batch, cfg, log_now, fused, behaviour)
    if scored is not None:
        step.teacher_metrics = routes.routed_metrics(
            scored, mixture, lambda batch: score_rows(model, batch, cfg, fused, log_now), cfg.ignore_index
        )
    return step


def passes_loss(model, inputs: dict, routes: TeacherRoutes, states: dict, served_heads: dict,
                heads: dict[str, HeadOnDevice], num_items_in_batch, cfg: KDLossConfig, log_now: bool,
                fused: bool) -> KDStepOutput:  # fmt: skip
    """One pass per kind present (the top-k members together, each hidden member alone), each scoring its own
    member's tokens, all over the batch's token count."""
    names = list(routes.names)
    owner = routes.owners(inputs.pop(TEACHER_MIXTURE), inputs["labels"])  # each label's member
    ignore = cfg.ignore_index
    if num_items_in_batch is None:  # each pass's mean would be over its own tokens: give them the batch's count
        scored = inputs["shift_labels"] if "shift_labels" in inputs else inputs["labels"][:, 1:]
        num_items_in_batch = (scored != ignore).sum()
    passes = [([j for j, n in enumerate(names) if n not in states], None)] if TOPK_COLUMNS[0] in inputs else []
    passes += [([names.index(name)], name) for name in states]
    batches = []
    for indices, name in passes:
        mine = torch.isin(owner, torch.tensor(indices, device=owner.device))
        batch = {k: v for k, v in inputs.items() if name is None or k not in TOPK_COLUMNS}
        batch["labels"] = inputs["labels"].masked_fill(~mine, ignore)
        if "shift_labels" in inputs:  # shift_labels[t] is position t + 1's token
            after = torch.cat([mine[:, 1:], mine[:, -1:]], dim=1)
            batch["shift_labels"] = inputs["shift_labels"].masked_fill(~after, ignore)
        batches.append((batch, name, int((batch["labels"] != ignore).sum())))
    # a kind with no token in the batch makes no pass; a batch with no token at all makes the first (loss 0)
    batches = [b for b in batches if b[2]] or batches[:1]
    total, parts = None, []
    for batch, name, count in batches:
        pass_cfg = cfg
        if name is not None:
            batch[TEACHER_HIDDEN_STATES] = states[name]
            pass_cfg = heads[name].put(batch, served_heads[name], cfg)
        step = one_teacher_loss(model, None, batch, num_items_in_batch, pass_cfg, log_now, fused)
        parts.append((step, count))
        total = step.loss if total is None else total + step.loss
    first = parts[0][0]
    agreement = None
    if log_now and all(step.agreement is not None for step, _ in parts):  # per token, over every pass's tokens
        count = sum(n for _, n in parts)
        agreement = sum(step.agreement * n for step, n in parts) / max(1, count)
    soft = sum(step.soft for step, _ in parts)
    hard = sum(step.hard for step, _ in parts)
    return KDStepOutput(total, soft, hard, agreement, first.outputs)
