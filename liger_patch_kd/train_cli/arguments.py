"""The options of `liger-kd train` besides KDTrainingArguments, named as TRL's scripts name them (ScriptArguments
and ModelConfig), so that a TRL command line or YAML file carries over. Standard library only."""

from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "bfloat16", "float16", "float32")
# PEFT's TaskType values (peft is optional: checked here before it is imported)
LORA_TASK_TYPES = ("CAUSAL_LM", "SEQ_CLS", "SEQ_2_SEQ_LM", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION")
NO_SPLIT = "none"  # --dataset_test_split none: no evaluation, even when the dataset has a test split

# TRL's GKDConfig / DistillationConfig names that mean exactly one of ours (docs/coming-from-trl.md lists them)
TRL_ALIASES = {"lmbda": "kd_lmbda", "beta": "kd_beta", "seq_kd": "kd_seq_kd", "max_new_tokens": "kd_max_new_tokens",
               "max_completion_length": "kd_max_new_tokens"}  # fmt: skip
# TRL names that mean different things in its two trainers, or something else here: refused with the fix
TRL_AMBIGUOUS = {
    "temperature": "TRL's `temperature` is the sampling temperature of generated completions (GKDConfig) or that "
    "and the loss's softmax temperature at once (DistillationConfig); here they are two options: "
    "--kd_generation_temperature (sampling) and --kd_temperature (the loss's softmax)",
    "max_length": "TRL's `max_length` truncates the tokenized rows; here that is --kd_max_length (text rows, and "
    "prompt + completion of prompt rows), with --kd_max_prompt_length to keep a long prompt's last tokens (a prompt "
    "that fills --kd_max_length would leave no completion token, and is refused)",
}
# TRL names with no option of that name here, each with what to do instead (docs/coming-from-trl.md's tables)
DROPOUT_AS_CONFIGURED = (
    "dropout is as the model's config says (0 in Llama's and Qwen's attention; the teacher runs in eval mode, no "
    "dropout); to turn the student's off, set its config's dropout fields to 0 (attention_dropout: 0 in its "
    "config.json, or from_pretrained(..., attention_dropout=0.0) in Python); drop disable_dropout"
)
TRL_WITHOUT_OPTION = {
    "disable_dropout": DROPOUT_AS_CONFIGURED,
    "model_init_kwargs": "--dtype, --model_revision, --trust_remote_code, --attn_implementation",
    "teacher_model_init_kwargs": "--teacher_dtype, --teacher_model_revision, --trust_remote_code, "
    "--attn_implementation",
    "dataset_text_field": "none: the text column is `text`; rename yours",
    "dataset_num_proc": "none: rows are tokenized when KDTrainer is built; drop it",
    "completion_only_loss": "none: always on (prompt rows score the completion only); drop it",
    "assistant_only_loss": "none: `messages` rows score the last assistant turn only; drop it",
    "loss_type": "--kd_hard_weight (cross-entropy on the labels) beside --kd_soft_weight",
    "packing": "none on the command line (in Python: data_collator=DataCollatorWithFlattening())",
    "padding_free": "none on the command line (in Python: data_collator=DataCollatorWithFlattening())",
    "shuffle_dataset": "none: the Trainer's sampler shuffles; drop it",
    "top_p": "none: rollouts sample the full distribution at --kd_generation_temperature; drop it",
    "top_k": "none: rollouts sample the full distribution at --kd_generation_temperature; drop it",
    "chat_template_path": "none: the tokenizer's chat template is used; drop it",
}


@dataclass
class ScriptArguments:
    """Which data to train on (TRL's ScriptArguments names)."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "A local .jsonl / .json / .parquet file, a folder of them (one file per split: train.jsonl, "
                  "test.jsonl, or HF's train-00000-of-00001.parquet), a teacher store (`liger-kd precompute`'s "
                  "folder), or a Hugging Face hub dataset (needs the datasets package: the `formats` extra). Rows "
                  "in TRL's formats: text, prompt (+ completion), messages, or input_ids. Required."},
    )  # fmt: skip
    dataset_config: str | None = field(
        default=None, metadata={"help": "The hub dataset's configuration (its subset name)."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "The split to train on."})
    dataset_test_split: str | None = field(
        default=None,
        metadata={"help": "The split evaluated at the end (and every eval_steps with --eval_strategy steps). Default: "
                  "'test' when the dataset has one, else no evaluation (or --eval_fraction). A split named here "
                  "that the dataset lacks is an error; 'none': no test split (no evaluation, or --eval_fraction's "
                  "held-out rows)."},
    )  # fmt: skip
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Save into --output_dir even when it is the student's or teacher's own folder, or holds "
                  "model or tokenizer files that no earlier `liger-kd train` run wrote there (they are "
                  "overwritten)."},
    )  # fmt: skip
    eval_fraction: float | None = field(
        default=None,
        metadata={"help": "A dataset without a test split: hold out this fraction of the train split (in (0, 1), "
                  "chosen with --seed) to evaluate on."},
    )  # fmt: skip


@dataclass
class ModelArguments:
    """Which models (TRL's ModelConfig names, plus the teacher's and trust_remote_code)."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "The student: a hub name (org/model) or a local folder. Required."}
    )
    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "The teacher, loaded in this process and frozen; it must share the student's tokenizer "
                  "unless --kd_teacher_tokenizer names its own. Leave it out for a served teacher "
                  "(--kd_teacher_url), a teacher store as --dataset_name, or --kd_self_distill."},
    )  # fmt: skip
    model_revision: str = field(default="main", metadata={"help": "The student's revision (branch, tag or commit)."})
    teacher_model_revision: str = field(default="main", metadata={"help": "The teacher's revision."})
    dtype: str = field(
        default="float32",
        metadata={"help": f"The student's weights: {', '.join(DTYPES)} (auto: the checkpoint's). float32 keeps full "
                  "precision master weights; --bf16 then trains in mixed precision.", "aliases": ["--torch_dtype"]},
    )  # fmt: skip
    teacher_dtype: str = field(
        default="auto",
        metadata={"help": f"The teacher's weights: {', '.join(DTYPES)} (auto: the checkpoint's, bfloat16 for most "
                  "released models: half the memory of float32, and the teacher is never trained)."},
    )  # fmt: skip
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow models and tokenizers that ship their own code (both models)."}
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "sdpa, eager, flash_attention_2, ... (both models); None: transformers'."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of the whole student."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(
        default=0.05, metadata={"help": "LoRA dropout (must be 0 when lm_head is a target: the fused loss reads it)."}
    )
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Module names to adapt (e.g. q_proj v_proj, or all-linear); None: PEFT's choice for the "
                  "architecture."},
    )  # fmt: skip
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained in full and saved with the adapter."}
    )
    lora_task_type: str = field(
        default="CAUSAL_LM", metadata={"help": f"PEFT task type: {', '.join(LORA_TASK_TYPES)}."}
    )
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA (scaling alpha / sqrt(r))."})
    use_dora: bool = field(default=False, metadata={"help": "DoRA (weight-decomposed LoRA); refused on lm_head."})
