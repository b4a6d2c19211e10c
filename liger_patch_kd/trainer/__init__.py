"""Distillation through the Hugging Face Trainer. Three rooms:

- here: the arguments (arguments.py, plain data: each feature registers its own checks of them), the trainer
  (trainer.py: KDTrainer, whose compute_loss is one journey, batch -> teacher signal -> loss -> figures) and the
  dataset checks made before any long work (dataset_setup.py);
- rollouts/: the completions generated steps train on (planning, in-process decoding, an engine client,
  asynchronous rollouts, weight sync);
- teachers/: the teacher-signal interface (teachers/base.py) and one file per kind of teacher (in process, the
  student itself, stored rows, served, routed by name, several in process, of another tokenizer).

rollouts/ and teachers/ never import each other; the collators both use are liger_patch_kd/batch/'s.
"""

from ..batch.privileged import PrivilegedCollator
from .arguments import PATCH_TOGGLES, KDTrainingArguments
from .teachers.self_distill import AdapterDisabledTeacher, FrozenStudentTeacher
from .trainer import KD_COLUMNS, KDTrainer

__all__ = [
    "KD_COLUMNS", "PATCH_TOGGLES", "AdapterDisabledTeacher", "FrozenStudentTeacher", "KDTrainer", "KDTrainingArguments",
    "PrivilegedCollator",
]  # fmt: skip
