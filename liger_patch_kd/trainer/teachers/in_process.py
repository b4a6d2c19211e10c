"""A teacher model in this process (KDTrainer(teacher_model=...)): run on each batch under no_grad, inside the
student's patched forward (fused) or beside it (materialised). A batch that carries its teacher's rows anyway
(top-k / samples) is scored against them instead, as the patched forward always did."""

from __future__ import annotations

from torch import nn

from ...config import KDLossConfig
from .base import KDStepOutput, TeacherSource, one_teacher_loss


class InProcessTeacher(TeacherSource):
    in_process = True

    def __init__(self, teacher_model: nn.Module, fused: bool) -> None:
        super().__init__(fused)
        self.model = teacher_model  # frozen and placed by KDTrainer (sharded like the student under FSDP / ZeRO-3)

    def loss(self, model, inputs: dict, num_items_in_batch, cfg: KDLossConfig, log_now: bool,
             behaviour=None) -> KDStepOutput:  # fmt: skip
        return one_teacher_loss(model, self.model, inputs, num_items_in_batch, cfg, log_now, self.fused, behaviour)
