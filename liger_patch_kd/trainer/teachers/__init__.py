"""Teachers: the sources of a batch's teacher signal, one file per kind.

- served.py: one teacher behind kd_teacher_url (top-k, sampled tokens), fetched ahead by a prefetcher;
  served_several.py: several served teachers, each row routed to its own.
- several.py: several teachers by name (teacher_model={name: model}), rows routed or mixed; routed_offline.py:
  offline rows that name their teacher (per-teacher logs).
- other_tokenizer.py (+ other_tokenizer_loss.py): one teacher of another tokenizer, its tokens aligned to the
  student's; several_tokenizers.py (+ several_tokenizers_loss.py): several teachers with tokenizers of their own.
- privileged.py: a teacher that sees its own prompt (rows with teacher_input_ids); self_distill.py: the student
  as its own teacher; sampled_data.py: datasets of sampled teacher tokens; compute.py: an in-process teacher's
  precision (FP8).
"""
