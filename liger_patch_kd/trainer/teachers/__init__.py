"""Teachers: the sources of a batch's teacher signal, one file per member kind, and one set of members.

KDTrainer resolves its teacher once when it is built (plan.py: resolve_teacher, the one place a kind is chosen, its
collator, columns, vocabulary checks and model preparation with it), and compute_loss asks the resulting
TeacherSource, for every batch, to prepare the batch's teacher side and to give the loss (base.py: the interface,
KDStepOutput and the one-teacher loss). The member kinds:

- in_process.py: a teacher model in this process; self_distill.py: the student as its own teacher (its adapter
  off, or its frozen weights on a teacher prompt).
- stored.py: rows carrying their teacher's data (a store, a dataset's columns); served.py: a teacher behind
  kd_teacher_url (top-k, sampled tokens), asked ahead by a prefetcher, with its argument checks; served_hidden.py:
  a teacher served as its final hidden states and head (kd_teacher_protocol='hidden'), the exact objective.
- other_tokenizer.py (+ other_tokenizer_loss.py): a wrapper making a member (in process, stored, served top-k) a
  teacher of another tokenizer, its tokens aligned to the student's.

A run's members form a set (one member is the usual set); several by name are member_set.py's MemberSet, whatever
their kind: routes.py (which member each row learns from), mixture_loss.py (members in process, mixed per row;
set_text_rows.py collates the text rows of members of other tokenizers), routed_loss.py (members whose signal rides
in the rows: stored, served), set_fetch.py (served members asked about their own rows).

Beside them: sampled_data.py (datasets of sampled teacher tokens, checked), compute.py (an in-process teacher's
precision, FP8). Rows where the teacher sees its own prompt need no source of their own (batch/privileged.py's
collator; every single-teacher kind pairs the completion tokens); the collators of every kind of rows are batch/'s,
and nothing here imports trainer/rollouts/.

A new member kind is a new file: a TeacherSource subclass, its entry in plan.py's KINDS (chosen in plan.kind_of and
plan.member_kind); a set takes it as a member with no new file.
"""
