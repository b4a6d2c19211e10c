"""Rows that carry their teacher's signal: top-k log-probs and / or sampled tokens from a store
(teacher.TeacherLogprobsDataset), a dataset's columns, or a server's reply attached by a prefetcher (served.py).
No teacher runs here; a batch without such rows has no teacher at all, refused before any forward."""

from __future__ import annotations

from ...config import KDLossConfig
from .base import KDStepOutput, TeacherSource, one_teacher_loss, require_teacher


class StoredTeacher(TeacherSource):
    from_rows = True

    def prepare(self, inputs: dict) -> dict:
        require_teacher(inputs, has_model=False)
        return inputs

    def loss(self, model, inputs: dict, num_items_in_batch, cfg: KDLossConfig, log_now: bool,
             behaviour=None) -> KDStepOutput:  # fmt: skip
        return one_teacher_loss(model, None, inputs, num_items_in_batch, cfg, log_now, self.fused, behaviour)
