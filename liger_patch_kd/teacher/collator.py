"""Batching sequences with their teacher top-k."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TeacherDataCollator:
    """Right-pads a batch: input_ids (pad_token_id), attention_mask, labels (given labels, else input_ids;
    ignore_index on padding) and, when the features carry them, the teacher's top-k (id -1, log-prob -inf on
    padding), row-aligned with the positions. Works for plain {"input_ids", "labels"} features too."""

    pad_token_id: int = 0
    ignore_index: int = -100

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seqs = [torch.as_tensor(f["input_ids"], dtype=torch.long) for f in features]
        length, batch = max(len(s) for s in seqs), len(features)
        out = {
            "input_ids": torch.full((batch, length), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((batch, length), dtype=torch.long),
            "labels": torch.full((batch, length), self.ignore_index, dtype=torch.long),
        }
        has_teacher = "teacher_token_ids" in features[0]
        if has_teacher:
            k = features[0]["teacher_token_ids"].shape[-1]
            out["teacher_token_ids"] = torch.full((batch, length, k), -1, dtype=torch.int32)
            out["teacher_logprobs"] = torch.full(
                (batch, length, k), -math.inf, dtype=features[0]["teacher_logprobs"].dtype
            )
        for row, (f, seq) in enumerate(zip(features, seqs)):
            n = len(seq)
            out["input_ids"][row, :n] = seq
            out["attention_mask"][row, :n] = 1
            out["labels"][row, :n] = torch.as_tensor(f.get("labels", seq), dtype=torch.long)
            if has_teacher:
                out["teacher_token_ids"][row, :n] = f["teacher_token_ids"]
                out["teacher_logprobs"][row, :n] = f["teacher_logprobs"]
        return out
