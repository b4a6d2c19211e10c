"""Distillation through the Hugging Face Trainer: the arguments (arguments.py), the trainer (trainer.py), and
what it calls for on-policy rollouts (rollouts.py), a served teacher (served.py) and a teacher with another
tokenizer (cross_tokenizer.py); a teacher that sees its own prompt (privileged.py) and the student as its own
teacher (self_distill.py)."""

from .arguments import PATCH_TOGGLES, KDTrainingArguments
from .teachers.privileged import PrivilegedCollator
from .teachers.self_distill import AdapterDisabledTeacher, FrozenStudentTeacher
from .trainer import KD_COLUMNS, KDTrainer

__all__ = [
    "KD_COLUMNS", "PATCH_TOGGLES", "AdapterDisabledTeacher", "FrozenStudentTeacher", "KDTrainer", "KDTrainingArguments",
    "PrivilegedCollator",
]  # fmt: skip
