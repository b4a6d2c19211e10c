"""Offline on-policy distillation: the student's own rollouts, sampled once, scored by the teacher once, trained on
many times (Lightning OPD), with an optional refresh of part of them by the current student.

- scoring.py: rollouts scored as a rollout store holds them (teacher top-k / samples, teacher and behaviour
  log-probs of the sampled tokens);
- store.py: precompute_rollouts, writing a resumable rollout store (`liger-kd precompute --rollouts-from`);
  engine_student.py: its completions and behaviour log-probs from an engine serving the student (a URL);
  served_teacher.py: its scores from a served teacher (top-k, sampled tokens or hidden states);
- source.py: the teacher source of such rows (the divergence, or the sampled-token estimators on stored log-probs;
  kd_behaviour_kl); their batches are batch/rollout_store.py's; refresh.py: part of a step's rows regenerated in
  memory;
- setup.py: what KDTrainer does on a rollout store (checks, teacher consistency, collator, refresh).
"""

from ...batch.rollout_store import RolloutStoreCollator
from ..rollouts.generate import RolloutSettings
from .engine_student import EngineStudent
from .scoring import ScoreOptions, score_rollouts
from .served_teacher import ServedTeacher
from .setup import OfflineRollouts
from .source import BEHAVIOUR_KL, StoredRolloutsTeacher
from .store import precompute_rollouts

__all__ = [
    "BEHAVIOUR_KL",
    "EngineStudent",
    "OfflineRollouts",
    "RolloutSettings",
    "RolloutStoreCollator",
    "ScoreOptions",
    "ServedTeacher",
    "StoredRolloutsTeacher",
    "precompute_rollouts",
    "score_rollouts",
]
