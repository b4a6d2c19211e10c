"""Distillation through the Hugging Face Trainer: the arguments (arguments.py), the trainer (trainer.py), and
what it calls for on-policy rollouts (rollouts.py), a served teacher (served.py) and a teacher with another
tokenizer (cross_tokenizer.py)."""

from .arguments import PATCH_TOGGLES, KDTrainingArguments
from .trainer import KD_COLUMNS, AdapterDisabledTeacher, KDTrainer

__all__ = ["KD_COLUMNS", "PATCH_TOGGLES", "AdapterDisabledTeacher", "KDTrainer", "KDTrainingArguments"]
