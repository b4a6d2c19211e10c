"""Batching a rollout store's rows: TeacherDataCollator's columns (input_ids, the stored labels that ignore the
prompt, the teacher's top-k / samples), plus the label-aligned behaviour and teacher log-probs of the sampled
tokens, and the mark of generated rows (so compute_loss takes kd_onpolicy_loss for them); and the way back, from a
collated batch to its rows (a refresh replaces some of them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .columns import GENERATED, ROLLOUT_LOGPROB_COLUMNS
from .teacher_data import TeacherDataCollator, pad_rows, refuse_other_lengths


@dataclass
class RolloutStoreCollator:
    """Right-pads a rollout store's items (TeacherDataCollator's columns) and adds BEHAVIOUR and TEACHER_TOKEN,
    (B, T) float32, 0 on the prompt and padding, and GENERATED: the rows are the student's own samples."""

    pad_token_id: int = 0
    ignore_index: int = -100

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = TeacherDataCollator(pad_token_id=self.pad_token_id, ignore_index=self.ignore_index)(features)
        length = batch["input_ids"].shape[1]
        lengths = np.fromiter((len(f["input_ids"]) for f in features), dtype=np.int64, count=len(features))
        for column, key in ROLLOUT_LOGPROB_COLUMNS.items():
            rows = [f[column] for f in features]
            refuse_other_lengths(column, rows, lengths)
            batch[key] = pad_rows(rows, length, 0.0, torch.float32, ndim=1)
        batch[GENERATED] = True
        return batch


def rows_of(batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """The items a RolloutStoreCollator batch was made of (right-padded rows cut at their attention mask's length),
    on the CPU, under the store's item names."""
    names = {value: key for key, value in ROLLOUT_LOGPROB_COLUMNS.items()}
    lengths = batch["attention_mask"].sum(-1).tolist()
    rows = []
    for row, n in enumerate(lengths):
        item = {}
        for key, value in batch.items():
            if torch.is_tensor(value) and value.dim() >= 2 and key != "attention_mask":
                item[names.get(key, key)] = value[row, :n].cpu()
        rows.append(item)
    return rows
