"""Batches: the contract (columns.py: the names of a batch's columns and markers, low in the house so that the store
writers, the collators, the teacher sources and the patched forward share one spelling) and the collators and row
checks that need nothing above torch and the contract, one module per kind of rows:

- teacher_data.py: TeacherDataCollator, token rows with their teacher's top-k / sampled tokens (a store's items);
- privileged.py: rows whose teacher sees its own prompt (PrivilegedCollator, the rows' checks);
- prompts.py: TRL's prompt / completion / messages rows, tokenized (PromptCollator);
- routing.py: rows routed to several teachers (their `teacher_mixture`), around any of the others;
- rollout_store.py: a rollout store's items (offline on-policy).

The trainer's rollouts and its teachers both build batches with these, and never import each other
(tools/check_layout.py's APART). The cross-tokenizer collator needs the alignment, so it lives with it
(align/collator.py)."""
