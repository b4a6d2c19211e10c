"""The teacher-signal interface: what KDTrainer.compute_loss asks of a batch's teacher, whatever kind it is.

KDTrainer resolves one TeacherSource when it is built (plan.py: resolve_teacher) and every batch takes one journey:
the Trainer prepares it (its own markers popped, labels checked), then

    inputs = source.prepare(inputs)                        # the teacher side of the batch checked (or popped)
    step = source.loss(model, inputs, num_items_in_batch, cfg, log_now, behaviour)   # signal + the one loss call
    -> KDStepOutput(loss, soft, hard, agreement, outputs, teacher_metrics)

and a source that fetches its signal ahead (a served teacher) also wraps the training DataLoader:
`source.dataloader(dataloader, student_vocab_size)` returns what the Trainer iterates (`source.eval_dataloader` the
same for evaluation and prediction DataLoaders), and `source.prefetcher`
(a TeacherPrefetcher, or None) is asked about generated rows too (on-policy steps attach the teacher's reply to
rows made during the step); a source that learns the vocabulary there (a served head) sets `source.vocab_size`.
Member kinds, a file each: in process (in_process.py), the student itself (self_distill.py), rows that carry their
teacher's data (a store or a dataset: stored.py; served top-k / samples: served.py), a served teacher's hidden
states and head (served_hidden.py), and a wrapper making any of the in-process, stored or served ones a teacher of
another tokenizer (other_tokenizer.py). Several members by name are one MemberSet (member_set.py), itself a
TeacherSource. A new kind is a new file with a TeacherSource subclass, chosen in plan.py (KINDS, kind_of).

A teacher that sees its own prompt (rows with teacher_input_ids: batch/privileged.py's collator) needs no source of its
own: the batch's teacher_input_ids / teacher_labels travel to the loss, which pairs completion tokens
(models/privileged.py), for every single-teacher kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...batch.columns import (
    BEHAVIOUR,
    TEACHER_SAMPLE_IDS,
    TEACHER_TOKEN_IDS,
)
from ...config import KDLossConfig
from ...models import unwrap_model
from ...models.kd_io import targets_of
from ...models.materialised import materialised_kd
from ...models.privileged import PrivilegedInputs
from ...models.signals import SIGNAL_COLUMNS, Scored, bind_rows, parse_signal


@dataclass
class KDStepOutput:
    """One batch's loss and the figures KDTrainer logs: the KD (soft) and CE (hard) terms, the top-1 agreement
    (logging steps only, else None), the model's outputs (compute_loss(return_outputs=True)) and per-teacher
    figures ({'kd_soft_loss/<name>': ...}; None when this step measured none)."""

    loss: torch.Tensor
    soft: torch.Tensor
    hard: torch.Tensor
    agreement: torch.Tensor | None
    outputs: Any
    teacher_metrics: dict[str, torch.Tensor] | None = None
    metric_tokens: torch.Tensor | None = None  # teacher_metrics are means over this many tokens: a step's add up


class StepMetrics(dict):
    """The teacher figures of one logging step's micro-batches (gradient accumulation: several per optimizer step),
    name -> value as they stand: a figure a micro-batch measured as a mean over `metric_tokens` tokens is the
    token-weighted mean over the step's micro-batches so far (the whole step's value at the log); any other is the
    latest micro-batch's. Sums stay on the device: no host sync per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, torch.Tensor] = {}

    def add(self, metrics: dict[str, torch.Tensor], tokens: torch.Tensor | None) -> None:
        for key, value in metrics.items():
            if tokens is None:  # not a mean over tokens: the latest figure
                self[key] = value
                continue
            value = torch.as_tensor(value).detach().double()
            weight = torch.as_tensor(tokens, device=value.device).double()
            self.sums[key] = self.sums.get(key, 0.0) + value * weight
            self.tokens[key] = self.tokens.get(key, 0.0) + weight
            self[key] = self.sums[key] / self.tokens[key].clamp(min=1)  # no token measured: the figure is 0


@dataclass
class Member:
    """One teacher's own arguments, from which plan.py's KINDS builds its TeacherSource: a model in process (frozen
    before its source is made), a server (`url`, `protocol`), or neither (stored rows). `xtok`: the
    CrossTokenizerSetup of a teacher of another tokenizer, whose source wraps the member's (other_tokenizer.py)."""

    model: nn.Module | None = None
    url: str | None = None
    protocol: str | None = None
    xtok: Any = None


class TeacherSource:
    """One kind of teacher: how a batch gets its teacher signal and its loss. Subclasses override `loss` and, when
    they need it, `prepare` (checks before any forward) and `dataloader` (a signal fetched ahead of the batch)."""

    in_process = False  # a teacher model run in this process (`model`): a set mixes such members per row
    fetches = False  # asks a server about each batch ahead of the step: a set asks it about its own rows
    prefetcher = None  # a served source's TeacherPrefetcher: generated rows ask it about themselves too
    from_rows = False  # the teacher's signal is the rows' own data (a store): evaluation rows must carry it too
    vocab_size = None  # the loss's vocabulary when the source learns it in `dataloader` (a served head), else None

    def __init__(self, fused: bool) -> None:
        self.fused = fused  # use_kd_patch: the patched forward's fused loss, else the loss on materialised logits

    def dataloader(self, dataloader: Any, student_vocab_size: Callable[[], int]) -> Any:
        """The training DataLoader the Trainer iterates (a served source wraps it to ask its server ahead)."""
        return dataloader

    def eval_dataloader(self, dataloader: Any, student_vocab_size: Callable[[], int]) -> Any:
        """An evaluation (or prediction) DataLoader, its batches given their teacher signal as training's are (a
        served source asks its server about them too, over the client training uses)."""
        return dataloader

    def prepare(self, inputs: dict) -> dict:
        """The batch with its teacher side checked: a ValueError here, before any forward, names what is missing."""
        return inputs

    def loss(self, model: nn.Module, inputs: dict, num_items_in_batch, cfg: KDLossConfig, log_now: bool,
             behaviour: torch.Tensor | None = None) -> KDStepOutput:  # fmt: skip
        raise NotImplementedError


def has_teacher_rows(inputs: dict) -> bool:
    """The batch carries its teacher's data (top-k and / or sampled tokens: a store, a dataset, a server's reply)."""
    return inputs.get(TEACHER_TOKEN_IDS) is not None or inputs.get(TEACHER_SAMPLE_IDS) is not None


def require_teacher(inputs: dict, has_model: bool) -> None:
    if not has_model and not has_teacher_rows(inputs):
        raise ValueError(
            "no teacher: pass teacher_model=..., set kd_self_distill=True with a PEFT student, or give batches "
            "teacher_token_ids / teacher_logprobs (see liger_patch_kd.teacher)"
        )


def one_teacher_loss(model: nn.Module, teacher_model: nn.Module | None, inputs: dict, num_items_in_batch,
                     cfg: KDLossConfig, log_now: bool, fused: bool, behaviour=None) -> KDStepOutput:  # fmt: skip
    """The loss against one teacher: the batch's teacher rows when it carries them (they win over a model), else
    `teacher_model` run here; through the patched forward (fused) or on materialised logits (reference/)."""
    offline = has_teacher_rows(inputs)
    if fused:
        extra = {} if behaviour is None else {BEHAVIOUR: behaviour}
        outputs = model(
            **inputs, teacher_model=None if offline else teacher_model,
            num_items_in_batch=num_items_in_batch, kd_log_agreement=log_now, kd_config=cfg, **extra,
        )  # fmt: skip
        agreement = getattr(outputs, "kd_top1_agreement", None)
        return KDStepOutput(outputs.loss, outputs.kd_soft_loss, outputs.kd_hard_loss, agreement, outputs)
    columns = {name: inputs.pop(name, None) for name in SIGNAL_COLUMNS}
    signal = parse_signal(columns, model=None if offline else teacher_model)
    if signal is None:
        raise ValueError("no teacher: this batch has no teacher signal and the run no teacher_model")
    given_shift = inputs.pop("shift_labels", None)
    targets = targets_of(inputs.pop("labels"), given_shift, cfg.ignore_index)
    signal = bind_rows(signal, targets, cfg.ignore_index, behaviour=behaviour, given_shift=given_shift,
                       privileged=PrivilegedInputs.pop(inputs))  # fmt: skip
    scored = Scored(targets, cfg, num_items_in_batch, log_now)
    outputs = materialised_kd(unwrap_model(model), model, signal, scored, inputs)
    return KDStepOutput(outputs.loss, outputs.kd_soft_loss, outputs.kd_hard_loss, outputs.kd_top1_agreement, outputs)


def score_rows(model: nn.Module, inputs: dict, cfg: KDLossConfig, fused: bool, log_now: bool):
    """(KD term, top-1 agreement) of one batch of teacher rows under no_grad: a logging step's per-teacher figures."""
    with torch.no_grad():
        if fused:
            out = model(**inputs, kd_log_agreement=True, kd_config=cfg)
            return out.kd_soft_loss, out.kd_top1_agreement
        step = one_teacher_loss(model, None, dict(inputs), None, cfg, log_now, fused=False)
        return step.soft, step.agreement
