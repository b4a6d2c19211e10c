"""Training rows joined with a store precomputed on the teacher's own sequences: rows whose teacher reads other
tokens than the student (its own prompt before the same completion, `teacher_input_ids`; privileged rows).

Precompute the store on the teacher's sequences, in the rows' order, `precompute(teacher, [r["teacher_input_ids"]
for r in rows], out_dir)`; `JoinedTeacherData(rows, TeacherLogprobsDataset(out_dir))` then gives row i with
store item i's teacher data (top-k, or sampled tokens) laid along `teacher_input_ids`, which KDTrainer (no
teacher_model) pairs with the student's completion positions, as it does a live or served teacher's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..batch.columns import TEACHER_DATA_COLUMNS, TEACHER_INPUT_IDS
from .store.reader import store_meta

__all__ = ["JoinedTeacherData"]


class JoinedTeacherData:
    """Row i of `rows` (dicts) with store item i's teacher columns; the item's input_ids must be the row's
    `ids_column` (checked on each read: a ValueError names the row). Stores are read lazily, as the store reads."""

    def __init__(self, rows: Sequence[dict[str, Any]], store: Any, ids_column: str = TEACHER_INPUT_IDS) -> None:
        if len(rows) != len(store):
            raise ValueError(
                f"{len(rows)} rows but the store holds {len(store)} sequences; precompute it on every row's "
                f"{ids_column}, in order: precompute(teacher, [r[{ids_column!r}] for r in rows], out_dir)"
            )
        self.rows, self.store, self.ids_column = rows, store, ids_column
        self.top_k = getattr(store, "top_k", None)

    @property
    def meta(self) -> dict | None:
        """The store's metadata (a torch Subset's store's too): the draw temperature of sampled teacher tokens, which
        KDTrainer checks against kd_temperature."""
        return store_meta(self.store)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row, item = self.rows[i], self.store[i]
        if self.ids_column not in row:
            raise ValueError(f"row {i} has no {self.ids_column!r}: the store was computed on that column's tokens")
        want = torch.as_tensor(row[self.ids_column]).long().reshape(-1)
        got = torch.as_tensor(item["input_ids"]).long().reshape(-1)
        if not torch.equal(want, got):
            raise ValueError(
                f"row {i}: the store's sequence {i} ({got.numel()} tokens, {got[:8].tolist()}...) is not the row's "
                f"{self.ids_column} ({want.numel()} tokens, {want[:8].tolist()}...); precompute the store on the "
                f"rows' {self.ids_column}, in the rows' order"
            )
        return {**row, **{k: item[k] for k in TEACHER_DATA_COLUMNS if k in item}}
