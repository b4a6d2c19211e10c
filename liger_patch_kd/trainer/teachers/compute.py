"""How KDTrainer's in-process teacher computes: FP8 decoder products (`kd_teacher_precision`), refused with the
reason where there is no in-process teacher to change."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers.utils import logging

from ...models import apply_teacher_precision

logger = logging.get_logger(__name__)


def prepare_teacher_compute(args: Any, teacher_model: nn.Module | None) -> None:
    """Apply the teacher options of `args` to the frozen in-process teacher (`teacher_model`). A served teacher,
    offline data or self-distillation has no teacher here to change: asking for FP8 then is an error, not a
    no-op."""
    precision = args.kd_teacher_precision
    if precision != "bf16":
        if teacher_model is None or args.kd_self_distill:
            raise ValueError(
                f"kd_teacher_precision={precision!r} quantises an in-process teacher_model; this run has none "
                f"(offline data, a teacher server or self-distillation): serve the teacher with "
                f"`liger-kd serve --precision {precision}` instead, or leave kd_teacher_precision='bf16'"
            )
        summary = apply_teacher_precision(teacher_model, precision)
        logger.info(
            "FP8 teacher (%s): %d products quantised, %d kept in bf16 (%s); %.2f -> %.2f GiB",
            precision, len(summary.quantized), len(summary.kept), ", ".join(sorted(set(summary.kept.values()))),
            summary.bytes_before / 2**30, summary.bytes_after / 2**30,
        )  # fmt: skip
