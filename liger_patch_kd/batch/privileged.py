"""Rows whose teacher sees more than the student: the teacher's own prompt, the same completion.

Token-level rows are `{"input_ids", "labels", "teacher_input_ids"}`, optionally with `"teacher_labels"`: the
student's row (its prompt + the completion, labels on the completion) and the teacher's (its prompt + the same
completion). Without teacher_labels the teacher's completion is the last n tokens of teacher_input_ids, n the
number of the student's labelled tokens. Text rows (`{"prompt", "completion", "teacher_prompt"}`) are tokenized by
PromptCollator (prompts.py) into these. PrivilegedCollator batches them: the student's side as always (input_ids,
attention_mask, labels), the teacher's as teacher_input_ids, teacher_attention_mask, teacher_labels, both
right-padded (with the teacher's top-k or sampled tokens when the rows carry them computed on teacher_input_ids:
offline); or, with `packing=True`, every row of the batch in one packed row per side (position_ids /
teacher_position_ids restarting at each sequence, no attention masks). The KD forward pairs completion token t of
the student with completion token t of the teacher (models/privileged.py). A served teacher is asked about the
batch's teacher_input_ids (teacher/client/prefetch.py), its replies laid along them as a store's would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .columns import (
    TEACHER_ATTENTION_MASK,
    TEACHER_DATA_COLUMNS,
    TEACHER_INPUT_IDS,
    TEACHER_LABELS,
    TEACHER_POSITION_IDS,
)
from .teacher_data import TeacherDataCollator


def is_privileged_row(row: Any) -> bool:
    return isinstance(row, dict) and TEACHER_INPUT_IDS in row


def teacher_labels_for(feature: dict[str, Any], row: int, ignore_index: int = -100) -> list[int]:
    """The teacher's labels of one token-level row, checked: its labelled tokens are the student's, in order, each
    side's first one after a prompt of at least one token.

    Raises:
        ValueError: naming the row, when the completions differ or a prompt is empty.
    """
    if "labels" not in feature:
        raise ValueError(
            f"row {row}: a row with teacher_input_ids needs 'labels' (the completion tokens, {ignore_index} on the "
            f"prompt) to say which tokens both sides score"
        )
    s_ids, s_labels = list(feature["input_ids"]), [int(x) for x in feature["labels"]]
    t_ids = [int(x) for x in feature[TEACHER_INPUT_IDS]]
    if len(s_labels) != len(s_ids):
        raise ValueError(f"row {row}: labels has {len(s_labels)} tokens, input_ids {len(s_ids)}; give one per token")
    completion = [x for x in s_labels if x != ignore_index]
    if feature.get(TEACHER_LABELS) is not None:
        t_labels = [int(x) for x in feature[TEACHER_LABELS]]
        if len(t_labels) != len(t_ids):
            raise ValueError(
                f"row {row}: teacher_labels has {len(t_labels)} tokens, teacher_input_ids {len(t_ids)}; "
                f"give one per token"
            )
    else:  # the completion closes the teacher's row
        n = len(completion)
        t_labels = [ignore_index] * (len(t_ids) - n) + t_ids[len(t_ids) - n :] if n <= len(t_ids) else []
    t_completion = [x for x in t_labels if x != ignore_index]
    if t_completion != completion:
        raise ValueError(
            f"row {row}: the teacher's completion ({len(t_completion)} tokens, {t_completion[:8]}...) is not the "
            f"student's ({len(completion)} tokens, {completion[:8]}...); teacher_input_ids must end with (or "
            f"teacher_labels mark) the very tokens the student's labels score"
        )
    for side, labels in (("the student's prompt", s_labels), ("the teacher's prompt", t_labels)):
        if labels and labels[0] != ignore_index:
            raise ValueError(
                f"row {row}: {side} is empty, so no position predicts the completion's first token; start it with "
                f"at least one token (e.g. BOS)"
            )
    return t_labels


@dataclass
class PrivilegedCollator:
    """Batches token-level privileged rows (see the module docstring); other keys of the features are dropped."""

    pad_token_id: int = 0
    ignore_index: int = -100
    packing: bool = False

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        for row, f in enumerate(features):
            if TEACHER_INPUT_IDS not in f:
                raise ValueError(f"row {row} has no teacher_input_ids; a batch of privileged rows needs them in each")
            for key in (k for k in TEACHER_DATA_COLUMNS if k in f and len(f[k]) != len(f[TEACHER_INPUT_IDS])):
                raise ValueError(
                    f"row {row}: {key} has {len(f[key])} positions, teacher_input_ids {len(f[TEACHER_INPUT_IDS])}; "
                    f"the teacher's data must be the teacher's on its own row (a store precomputed on "
                    f"teacher_input_ids)"
                )
        teacher_labels = [teacher_labels_for(f, row, self.ignore_index) for row, f in enumerate(features)]
        student = [{"input_ids": list(f["input_ids"]), "labels": list(f["labels"])} for f in features]
        teacher = [{"input_ids": list(f[TEACHER_INPUT_IDS]), "labels": t,
                    **{k: f[k] for k in TEACHER_DATA_COLUMNS if k in f}}
                   for f, t in zip(features, teacher_labels)]  # fmt: skip
        if self.packing:
            s, t = _packed(student), _packed(teacher)
            return {**s, TEACHER_INPUT_IDS: t.pop("input_ids"), TEACHER_LABELS: t.pop("labels"),
                    TEACHER_POSITION_IDS: t.pop("position_ids"), **t}  # fmt: skip
        pad = TeacherDataCollator(pad_token_id=self.pad_token_id, ignore_index=self.ignore_index)
        s, t = pad(student), pad(teacher)  # the teacher's top-k, when given, padded along the teacher's row
        return {**s, TEACHER_INPUT_IDS: t.pop("input_ids"), TEACHER_ATTENTION_MASK: t.pop("attention_mask"),
                TEACHER_LABELS: t.pop("labels"), **t}  # fmt: skip


def _packed(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """One row of every sequence, position ids restarting at each (transformers keeps them apart then); each
    sequence's first label is its prompt's, ignored, so no sequence is scored on the one before it. Top-k / sampled
    columns, when given, are concatenated alike: (1, total, K)."""
    ids = [t for r in rows for t in r["input_ids"]]
    labels = [t for r in rows for t in r["labels"]]
    positions = [p for r in rows for p in range(len(r["input_ids"]))]
    columns = (("input_ids", ids), ("labels", labels), ("position_ids", positions))
    out = {name: torch.tensor([values]) for name, values in columns}
    for key in TEACHER_DATA_COLUMNS:
        if key in rows[0]:
            out[key] = torch.cat([torch.as_tensor(r[key]) for r in rows])[None]
    return out


def privileged_rollout_batch(rollouts: list[Any], teacher_prompts: list[list[int]], pad_id: int, ignore_index=-100):
    """Generated rows with the teacher's own prompts: the student's row is its prompt + the sampled completion, the
    teacher's is its prompt + the same completion. `teacher_prompts[i]` belongs to `rollouts[i]`."""
    features = [
        {"input_ids": r.prompt + r.completion, "labels": [ignore_index] * len(r.prompt) + r.completion,
         TEACHER_INPUT_IDS: tp + r.completion, TEACHER_LABELS: [ignore_index] * len(tp) + r.completion}
        for r, tp in zip(rollouts, teacher_prompts, strict=True)
    ]  # fmt: skip
    return PrivilegedCollator(pad_token_id=pad_id, ignore_index=ignore_index)(features)
