"""Distillation through the Hugging Face Trainer. Three rooms:

- here: the arguments (arguments.py, plain data: each feature registers its own checks of them), the trainer
  (trainer.py: KDTrainer, whose compute_loss is one journey, batch -> teacher signal -> loss -> figures) and the
  dataset checks made before any long work (dataset_setup.py);
- rollouts/: the completions generated steps train on (planning, in-process decoding, an engine client,
  asynchronous rollouts, weight sync);
- teachers/: the teacher-signal interface (teachers/base.py), one file per member kind (in process, the student
  itself, stored rows, served top-k, served hidden), the wrapper for another tokenizer, and a set of several
  members by name (teachers/member_set.py).

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
