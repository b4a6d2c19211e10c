"""Teachers: the sources of a batch's teacher signal, one file per kind.

KDTrainer resolves its teacher once when it is built (plan.py: resolve_teacher, the one place a kind is chosen, its
collator, columns, vocabulary checks and model preparation with it), and compute_loss asks the resulting
TeacherSource, for every batch, to prepare the
batch's teacher side and to give the loss (base.py: the interface, KDStepOutput and the one-teacher loss). The
kinds:

- in_process.py: a teacher model in this process; self_distill.py: the student as its own teacher (its adapter
  off, or its frozen weights on a teacher prompt).
- stored.py: rows carrying their teacher's data (a store, a dataset's columns); served.py: one teacher behind
  kd_teacher_url (top-k, sampled tokens), asked ahead by a prefetcher, with its argument checks; served_hidden.py:
  one teacher served as its final hidden states and head (kd_teacher_protocol='hidden'), the exact objective.
- routed_offline.py: stored rows naming their teacher (per-teacher figures); served_several.py: several served
  teachers, each row asked of its own.
- several.py: several teachers in process by name (rows routed or mixed), their argument checks and collator;
  several_tokenizers.py (+ several_tokenizers_loss.py) when some have tokenizers of their own.
- other_tokenizer.py (+ other_tokenizer_loss.py): one teacher of another tokenizer, its tokens aligned to the
  student's.

Beside them: sampled_data.py (datasets of sampled teacher tokens, checked),
compute.py (an in-process teacher's precision, FP8). Rows where the teacher sees its own prompt need no source of
their own (batch/privileged.py's collator; every single-teacher kind pairs the completion tokens); the collators
of every kind of rows are batch/'s, and nothing here imports trainer/rollouts/.

A new kind is a new file: a TeacherSource subclass, and its entry in plan.py's KINDS (chosen in plan.kind_of).
"""
