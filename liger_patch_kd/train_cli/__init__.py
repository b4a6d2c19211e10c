"""`liger-kd train`: a distillation run from the command line, the Hugging Face way (TRL's script names).

- arguments.py: the script's own options (the dataset, the models, LoRA), in TRL's names; standard library only;
- parser.py: one parser over them and KDTrainingArguments (every option a flag), a YAML `--config` file whose keys
  are the flags' names (the command line overrides it), TRL's unambiguous option names;
- data.py: the dataset (a local .jsonl / .json / .parquet file or folder, a teacher store, or a hub dataset) and its
  splits, checked before any model loads;
- models.py: the tokenizers (checked to be one), the student (optionally with a LoRA adapter) and the teacher;
- run.py: the run: check, load, train, evaluate, save.
"""
