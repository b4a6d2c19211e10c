"""Offline rows that name their teacher (teacher.RoutedTeacherData: one store per teacher, or any offline dataset
with a `teacher` column): each row's top-k is already its own teacher's, so they train as any offline data; the
names are kept only for the per-teacher figures of logging steps, as for several served teachers, whose batches
are offline data by the time they train (trainer/teachers/served_several.py).

Logged per teacher on logging steps (one no-grad forward per teacher over its own rows of the batch, the other
rows' labels ignored): `kd_soft_loss/<name>`, the KD term the run trains on (the top-k loss of its tail policy:
a top-k holds no full distribution, so not the full-vocabulary divergence the live teachers' figures measure),
averaged over that teacher's scored tokens; `kd_top1_agreement/<name>`, how often the student's most likely token
is the teacher's (its top-1 is in its top-k: exact).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers.utils import logging

from ...batch.columns import OFFLINE_MARK_COLUMNS, TEACHER_MIXTURE
from ...batch.routing import NamesIfGivenCollator
from ...config import KDLossConfig
from .base import KDStepOutput, TeacherSource, score_rows
from .several import TeacherSetSetup
from .stored import StoredTeacher

logger = logging.get_logger(__name__)


def teacher_names_of(dataset: Any) -> list[str] | None:
    """The teacher names a dataset's rows may carry, in a fixed order: RoutedTeacherData's `names`, a datasets
    Dataset's distinct `teacher` values (sorted), a list's (in order of first appearance); None when they cannot be
    listed without reading every row (any other dataset) or are not all str."""
    names = getattr(dataset, "names", None)
    if names is None and callable(getattr(dataset, "unique", None)) and "teacher" in (dataset.column_names or ()):
        names = sorted(dataset.unique("teacher"), key=str)
    elif names is None and isinstance(dataset, Sequence):
        names = list(dict.fromkeys(row.get("teacher") for row in dataset if isinstance(row, Mapping)))
    if not names or not all(isinstance(n, str) and n for n in names):
        return None
    return list(names)


def offline_routed_setup(args: Any, dataset: Any, first_row: Any, teacher_model: Any) -> TeacherSetSetup | None:
    """The teacher set of offline rows that name their teachers (only for logging), or None: the rows are not
    offline rows with a `teacher` column, or another teacher source is in play (a live teacher_model, a server,
    self-distillation, another tokenizer), or the names cannot be listed (logged as a warning)."""
    row = first_row if isinstance(first_row, Mapping) else {}
    if row.get("teacher") is None or not any(row.get(c) is not None for c in OFFLINE_MARK_COLUMNS):
        return None
    if teacher_model is not None or args.kd_teacher_url or args.kd_self_distill or args.kd_teacher_tokenizer:
        return None
    names = teacher_names_of(dataset)
    if names is None:
        logger.warning(
            "the offline rows name their teacher (a 'teacher' column) but the dataset does not list the names (use "
            "liger_patch_kd.teacher.RoutedTeacherData, a datasets.Dataset or a list of str names): no per-teacher "
            "kd_soft_loss/<name> figures are logged"
        )
        return None
    # no models: each row's data comes with it, as a served teacher set's (TeacherSetSetup's served=True)
    return OfflineRoutedSetup(dict.fromkeys(names), args, served=True)


class OfflineRoutedSetup(TeacherSetSetup):
    """TeacherSetSetup for logging only: batches whose rows name no teacher (an evaluation store, say) are
    collated as they would be without it (no per-teacher figures then), not refused."""

    def collator(self, inner) -> NamesIfGivenCollator:
        return NamesIfGivenCollator(self, inner)


class RoutedRowsTeacher(TeacherSource):
    """Stored rows routed to named teachers (each row's own teacher's data, its `teacher_mixture` one-hot): trained
    by the stored member (`rows`), and on logging steps scored again per teacher on its own rows
    (kd_soft_loss/<name>)."""

    from_rows = True

    def __init__(self, teachers: TeacherSetSetup, fused: bool) -> None:
        super().__init__(fused)
        self.teachers = teachers
        self.rows = StoredTeacher(fused)

    def prepare(self, inputs: dict) -> dict:
        return self.rows.prepare(inputs)

    def loss(self, model, inputs: dict, num_items_in_batch, cfg: KDLossConfig, log_now: bool,
             behaviour=None) -> KDStepOutput:  # fmt: skip
        routes = inputs.pop(TEACHER_MIXTURE, None)  # each row's teacher
        scored = dict(inputs) if routes is not None and log_now else None  # the materialised path pops from inputs
        step = self.rows.loss(model, inputs, num_items_in_batch, cfg, log_now, behaviour)
        if scored is not None:
            step.teacher_metrics = self.teachers.routed_metrics(
                scored, routes, lambda batch: score_rows(model, batch, cfg, self.fused, log_now), cfg.ignore_index
            )
        return step
