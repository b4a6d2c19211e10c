"""One teacher signal from a call's arguments (or a batch's columns), parsed once, and paired with the call's rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...batch.columns import (
    TEACHER_BIAS,
    TEACHER_HIDDEN_STATES,
    TEACHER_LOGPROBS,
    TEACHER_SAMPLE_COUNTS,
    TEACHER_SAMPLE_IDS,
    TEACHER_SAMPLE_LOGPROBS,
    TEACHER_TOKEN_IDS,
    TEACHER_WEIGHT,
)
from ..privileged import PrivilegedInputs
from ..teachers import TeacherSet
from .base import TeacherSignal
from .live import LiveTeacher, TeacherMix
from .stored import HiddenTeacher, SampledTeacher, TopKTeacher

# the forward's teacher arguments that are tensors of the batch (a store's, a dataset's or a server's columns)
SIGNAL_COLUMNS = (
    TEACHER_HIDDEN_STATES, TEACHER_WEIGHT, TEACHER_BIAS, TEACHER_TOKEN_IDS, TEACHER_LOGPROBS,
    TEACHER_SAMPLE_IDS, TEACHER_SAMPLE_COUNTS, TEACHER_SAMPLE_LOGPROBS,
)  # fmt: skip


def parse_signal(
    columns: Mapping[str, Any], model: nn.Module | None = None, teacher_set: TeacherSet | None = None
) -> TeacherSignal | None:
    """The one teacher of a call from its arguments: a live `model`, several (`teacher_set`), or the batch's
    `columns` (SIGNAL_COLUMNS: hidden states + head, top-k, sampled tokens with or without top-k); None when there
    is none. Exactly one source; what a source needs beside it is checked here (ValueError naming it)."""
    get = columns.get
    sources = {
        "teacher_model": model,
        TEACHER_HIDDEN_STATES: get(TEACHER_HIDDEN_STATES),
        TEACHER_TOKEN_IDS: get(TEACHER_TOKEN_IDS) if get(TEACHER_SAMPLE_IDS) is None else None,
        TEACHER_SAMPLE_IDS: get(TEACHER_SAMPLE_IDS),
    }
    given = [name for name, value in sources.items() if value is not None]
    if len(given) > 1:
        raise ValueError(
            f"pass one teacher source, not {given}: a live teacher_model, teacher_hidden_states + teacher_weight, "
            f"or teacher_token_ids + teacher_logprobs"
        )
    if teacher_set is not None:
        if given:
            raise ValueError("pass one teacher (teacher_model, ...) or a kd_teacher_set of several, not both")
        return TeacherMix(teacher_set)
    if get(TEACHER_HIDDEN_STATES) is not None and get(TEACHER_WEIGHT) is None:
        raise ValueError("teacher_hidden_states needs teacher_weight (the teacher's lm_head weight, (vocab, hidden))")
    if get(TEACHER_TOKEN_IDS) is not None and get(TEACHER_LOGPROBS) is None:
        raise ValueError("teacher_token_ids needs teacher_logprobs of the same shape (B, T, K)")
    if get(TEACHER_SAMPLE_IDS) is not None and (
        get(TEACHER_SAMPLE_COUNTS) is None or get(TEACHER_SAMPLE_LOGPROBS) is None
    ):
        raise ValueError("teacher_sample_ids needs teacher_sample_counts and teacher_sample_logprobs (B, T, m)")
    topk = None
    if get(TEACHER_TOKEN_IDS) is not None:
        topk = TopKTeacher(get(TEACHER_TOKEN_IDS), get(TEACHER_LOGPROBS))
    if get(TEACHER_SAMPLE_IDS) is not None:
        return SampledTeacher(get(TEACHER_SAMPLE_IDS), get(TEACHER_SAMPLE_COUNTS), get(TEACHER_SAMPLE_LOGPROBS),
                              topk)  # fmt: skip
    if topk is not None:
        return topk
    if get(TEACHER_HIDDEN_STATES) is not None:
        return HiddenTeacher(get(TEACHER_HIDDEN_STATES), get(TEACHER_WEIGHT), get(TEACHER_BIAS))
    return None if model is None else LiveTeacher(model)


def bind_rows(
    signal: TeacherSignal, targets: torch.Tensor, ignore_index: int, *, behaviour: torch.Tensor | None = None,
    given_shift: torch.Tensor | None = None, privileged: PrivilegedInputs | None = None,
) -> TeacherSignal:  # fmt: skip
    """`signal` paired with the call's rows: label-aligned behaviour log-probs (B, T) shifted to the rows the
    targets score (refused where they cannot be paired: pre-shifted packed labels, a top-k teacher), and a
    teacher prompt of its own (`privileged`: the pairing checked before any model runs)."""
    if behaviour is not None:
        if given_shift is not None:
            raise ValueError("kd_behaviour_logprobs are label-aligned: they cannot be paired with pre-shifted "
                             "shift_labels (packed sequences); generated rollouts are not packed")  # fmt: skip
        signal = signal.with_behaviour(F.pad(behaviour[..., 1:], (0, 1), value=0.0))
    if privileged is not None:
        signal = signal.paired(privileged, targets, ignore_index)
    return signal
