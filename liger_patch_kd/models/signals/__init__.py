"""The teacher signal of one KD call, parsed from the forward's arguments (or a batch's columns) once: a small frozen
dataclass per kind, each with its loss, fused (`fused`: from the student's last hidden states and lm_head, no
(tokens x vocab) logits) and on materialised logits (`materialised`: reference.py, the baseline the fused loss is
tested against and what `fused_linear_jsd=False` runs).

  LiveTeacher     a teacher model run on the batch, inside the student's forward (its own rows with a teacher prompt)
  HiddenTeacher   a teacher's last hidden states and lm_head (a served exact teacher, precomputed hidden states)
  TopKTeacher     the teacher's top-k ids and log-probs (a store, a dataset, a served top-k)
  SampledTeacher  tokens sampled from the teacher, with or without the hybrid's top-k
  TeacherMix      several live teachers, each row routed to one or scored against a mixture (models/teachers.py)

`parse_signal` (parse.py) makes one from the teacher arguments and `bind_rows` pairs it with the call's rows
(a teacher's own prompt, the behaviour policy's log-probs); the KD forward then runs the backbone, gathers the
head and calls `signal.fused`, or runs the models' forwards and calls `signal.materialised`
(models/materialised.py). A new kind of teacher signal is a dataclass with both methods (stored.py for data a
batch carries, live.py for a model run here) and a line in `parse_signal`.

Files: base.py (the interface and the shared loss calls), stored.py, live.py, host.py (a forward as a host:
HeadRequest), parse.py
"""

from .base import Scored, StudentRows, TeacherSignal, Terms
from .host import HeadRequest, run_teacher_head, teacher_inputs
from .live import LiveTeacher, TeacherMix
from .parse import SIGNAL_COLUMNS, bind_rows, parse_signal
from .stored import HiddenTeacher, SampledTeacher, TopKTeacher

__all__ = [
    "SIGNAL_COLUMNS",
    "HeadRequest",
    "HiddenTeacher",
    "LiveTeacher",
    "SampledTeacher",
    "Scored",
    "StudentRows",
    "TeacherMix",
    "TeacherSignal",
    "Terms",
    "TopKTeacher",
    "bind_rows",
    "parse_signal",
    "run_teacher_head",
    "teacher_inputs",
]
