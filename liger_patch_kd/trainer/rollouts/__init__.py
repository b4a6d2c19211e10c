"""Rollouts: the completions a generated step trains on, and how the generator gets them.

- generate.py: the rollout as data (RolloutSettings, Rollout) and in-process sampling with transformers' generate;
  rollout_batch turns rollouts into training rows (labels on the completion only).
- decode.py: the lean in-process decode loop used where it applies (same tokens as generate()).
- onpolicy.py: OnPolicySteps, the plan of an optimizer step (which steps generate, kd_lmbda / kd_seq_kd) and its
  micro-batches; asynchronous.py requests the next steps' rollouts ahead on a worker thread.
- engine.py: rollouts from an inference engine speaking vLLM's /v1/completions; weight_sync.py pushes the student's
  weights (or adapter) to it every kd_sync_steps; weight_sender.py is the trainer's end of the broadcast weight
  transfer (the server's end is server/weight_receiver.py).
- retokenized.py: generated rows re-tokenized for a teacher of another tokenizer.

Prompt rows (TRL's prompt / completion / messages) are tokenized by batch/prompts.py's PromptCollator; rollouts
never import the teachers (trainer/teachers/), nor they rollouts: both build batches with batch/'s collators.
Nothing here reads KDTrainingArguments' class: functions take the values (or an `args` object) they need.
"""
