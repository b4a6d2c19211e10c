"""How KDTrainer's in-process teacher computes: FP8 decoder products (`kd_teacher_precision`), its decoder replayed
from CUDA graphs (`kd_teacher_cuda_graphs`); each refused with the reason where there is no in-process teacher to
change."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers.utils import logging

from ...distributed import spread_as
from ...models import apply_teacher_precision, disable_captured_backbone, enable_captured_backbone

logger = logging.get_logger(__name__)


def prepare_teacher_compute(args: Any, teacher_model: nn.Module | None, members: tuple[nn.Module, ...] = ()) -> None:
    """Apply the teacher options of `args` to the frozen in-process teacher (`teacher_model`; the CUDA graphs also to
    a teacher set's in-process `members`). A served teacher, offline data or self-distillation has no teacher here
    to change: asking for FP8 or CUDA graphs then is an error, not a no-op."""
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
    models = tuple(m for m in (teacher_model, *members) if m is not None)
    if args.kd_teacher_cuda_graphs:
        capture_teachers(args, models)
    else:  # a teacher another run captured runs eagerly here, as this run's options say
        for model in models:
            disable_captured_backbone(model)


def capture_teachers(args: Any, models: tuple[nn.Module, ...]) -> None:
    """kd_teacher_cuda_graphs: each frozen in-process teacher's decoder replayed from CUDA graphs
    (models.captured_backbone)."""
    if not models or args.kd_self_distill:
        raise ValueError(
            "kd_teacher_cuda_graphs replays an in-process teacher_model's forward; this run has none (offline data, "
            "a teacher server or self-distillation): pass teacher_model, or leave kd_teacher_cuda_graphs=False"
        )
    if not args.use_kd_patch or not (args.kd_patch_config or {}).get("fused_linear_jsd", True):
        raise ValueError(
            "kd_teacher_cuda_graphs replays the teacher's decoder inside the fused loss; without it (use_kd_patch="
            "False, or kd_patch_config fused_linear_jsd=False) the teacher runs its own forward for its logits: set "
            "use_kd_patch=True, or leave kd_teacher_cuda_graphs=False"
        )
    sharded = [spread_as(model) for model in models]
    if args.fsdp or args.deepspeed or any(way in ("FSDP1", "FSDP2", "ZeRO-3") for way in sharded):
        raise ValueError(
            f"kd_teacher_cuda_graphs cannot replay a teacher sharded by FSDP / DeepSpeed (here: "
            f"{[w for w in sharded if w] or 'fsdp / deepspeed options'}; its weights are gathered by hooks at every "
            f"forward): leave kd_teacher_cuda_graphs=False with FSDP / DeepSpeed"
        )
    captures = [enable_captured_backbone(model).capture for model in models]
    if "eager" in captures:
        logger.warning("kd_teacher_cuda_graphs: %d of %d teachers are not on a CUDA device: their forward runs eagerly",
                       captures.count("eager"), len(captures))  # fmt: skip
