"""Self-distillation: the student is its own teacher, with no second copy of its weights.

`kd_self_distill` chooses which of the student's selves teaches:
- "adapter": a PEFT student's base model, its adapter disabled for the teacher's forward;
- "frozen": the student's own current weights, run under no_grad in eval mode (no dropout): a teacher that moves
  with the student, step by step. It teaches something only when it sees more than the student does: rows with a
  `teacher_prompt` (a hint, a document, the reference answer). With `kd_lmbda=1` (the student generates from its
  own prompt, the teacher scores the completion after its own) this is on-policy self-distillation (OPSD / SDFT);
- True: "adapter" for a PEFT student, "frozen" for any other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ...batch.columns import TEACHER_INPUT_IDS
from ..arguments import SELF_DISTILL_MODES
from .base import KDStepOutput, TeacherSource
from .in_process import InProcessTeacher


@contextlib.contextmanager
def _as_teacher(module: nn.Module) -> Iterator[None]:
    """Eval mode (no dropout: a teacher's distribution, not a sample of it) and no grad; every submodule's train /
    eval mode put back afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training


class AdapterDisabledTeacher(nn.Module):
    """Self-distillation: the PEFT student with its adapter disabled is the teacher (no second copy), run in eval
    mode under no_grad."""

    def __init__(self, peft_model: nn.Module) -> None:
        super().__init__()
        if not hasattr(peft_model, "disable_adapter"):
            raise ValueError(
                "kd_self_distill='adapter' needs a PEFT model (with disable_adapter()) as the student; for the "
                "student's own weights as teacher set kd_self_distill='frozen'"
            )
        object.__setattr__(self, "module", peft_model)  # not a submodule: its parameters stay the student's

    def forward(self, *args, **kwargs):
        with self.module.disable_adapter(), _as_teacher(self.module):
            return self.module(*args, **kwargs)


class FrozenStudentTeacher(nn.Module):
    """Self-distillation: the student's current weights are the teacher, the same module (no copy) run under
    no_grad in eval mode."""

    def __init__(self, student: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "module", student)  # not a submodule: its parameters stay the student's

    def forward(self, *args, **kwargs):
        with _as_teacher(self.module):
            return self.module(*args, **kwargs)


def self_distill_teacher(mode: bool | str, student: nn.Module) -> nn.Module:
    """The teacher module of `kd_self_distill=mode` for `student` (the Trainer's wrapped model)."""
    if mode not in SELF_DISTILL_MODES[1:]:
        raise ValueError(f"kd_self_distill must be one of {SELF_DISTILL_MODES}; got {mode!r}")
    if mode == "adapter" or (mode is True and hasattr(student, "disable_adapter")):
        return AdapterDisabledTeacher(student)
    return FrozenStudentTeacher(student)


def is_self_teacher(teacher: nn.Module | None) -> bool:
    return isinstance(teacher, (AdapterDisabledTeacher, FrozenStudentTeacher))


def require_teacher_prompt(teacher: nn.Module | None, inputs: dict) -> None:
    """The frozen student scoring its own rows is the student itself: loss 0, no gradient, a silent no-op."""
    if isinstance(teacher, FrozenStudentTeacher) and inputs.get(TEACHER_INPUT_IDS) is None:
        raise ValueError(
            "kd_self_distill='frozen' makes the student's own current weights the teacher, which on the student's "
            "own rows gives loss 0: give the rows a 'teacher_prompt' (or teacher_input_ids + teacher_labels) that "
            "the teacher sees and the student does not, or use a PEFT student with kd_self_distill='adapter'"
        )


class SelfDistillTeacher(TeacherSource):
    """The student as its own teacher (kd_self_distill): its teacher module (AdapterDisabledTeacher or
    FrozenStudentTeacher) run by the in-process member (`member`), each batch checked first for the teacher prompt
    the frozen kind needs."""

    def __init__(self, teacher: nn.Module, fused: bool) -> None:
        super().__init__(fused)
        self.member = InProcessTeacher(teacher, fused)

    def prepare(self, inputs: dict) -> dict:
        require_teacher_prompt(self.member.model, inputs)
        return self.member.prepare(inputs)

    def loss(self, model, inputs: dict, num_items_in_batch, cfg, log_now: bool, behaviour=None) -> KDStepOutput:
        return self.member.loss(model, inputs, num_items_in_batch, cfg, log_now, behaviour)
