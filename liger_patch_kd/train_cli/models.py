"""The models of `liger-kd train`: the tokenizers first (cheap, and checked to be one before any weights load),
then the student (with a LoRA adapter under --use_peft) and the teacher."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..cli_checks import looks_like_path
from ..utils.errors import reason_of
from .arguments import DTYPES, LORA_TASK_TYPES, ModelArguments

PEFT_EXTRA = "pip install 'liger_patch_kd[peft]'"
ALL_LINEAR = "all-linear"  # PEFT's shorthand, read only as a string (a list of it names a module "all-linear")


def check_model_options(model: ModelArguments) -> None:
    """The options read here, before anything loads: dtype names, LoRA's numbers, peft importable."""
    if model.model_name_or_path is None:
        raise ValueError("--model_name_or_path is required: the student, a hub name (org/model) or a local folder")
    for option, name in (("--model_name_or_path", model.model_name_or_path),
                         ("--teacher_model_name_or_path", model.teacher_model_name_or_path)):  # fmt: skip
        if name is not None and looks_like_path(name) and not Path(name).expanduser().exists():
            raise ValueError(f"{option} {name}: no such file or directory (a local model folder, or a hub name such "
                             "as org/model)")  # fmt: skip
    for option, value in (("--dtype", model.dtype), ("--teacher_dtype", model.teacher_dtype)):
        if value not in DTYPES:
            raise ValueError(f"{option} {value}: not a dtype; use one of {', '.join(DTYPES)}")
    if model.lora_task_type not in LORA_TASK_TYPES:
        raise ValueError(f"--lora_task_type {model.lora_task_type}: not a PEFT task type; use one of "
                         f"{', '.join(LORA_TASK_TYPES)} (CAUSAL_LM for a student language model)")  # fmt: skip
    if not model.use_peft:
        return
    targets = model.lora_target_modules or []
    if ALL_LINEAR in targets and len(targets) > 1:
        raise ValueError(f"--lora_target_modules {' '.join(targets)}: {ALL_LINEAR} already adapts every linear layer "
                         f"(but the output layer); give {ALL_LINEAR} alone, or module names without it")  # fmt: skip
    for option, value in (("--lora_r", model.lora_r), ("--lora_alpha", model.lora_alpha)):
        if value < 1:
            raise ValueError(f"{option} {value}: must be >= 1")
    if not 0 <= model.lora_dropout < 1:
        raise ValueError(f"--lora_dropout {model.lora_dropout}: must be in [0, 1)")
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ValueError(f"--use_peft trains a LoRA adapter, which needs the peft package: {PEFT_EXTRA}") from None


def _common(model: ModelArguments) -> dict[str, Any]:
    return {"trust_remote_code": model.trust_remote_code}


def load_tokenizer(name: str, model: ModelArguments, option: str, revision: str | None = None):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, revision=revision, **_common(model))
    except (OSError, ValueError) as e:
        raise ValueError(f"{option} {name}: no tokenizer loads from there ({reason_of(e)})") from None


def check_same_tokenizer(student: Any, teacher: Any, model: ModelArguments) -> None:
    """The teacher scores the student's token ids, so the two must map text to the same ids: one vocabulary."""
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours == theirs:
        return
    token = min(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])[0]
    example = f"; e.g. {token!r} is {_where(token, ours, 'student')} and {_where(token, theirs, 'teacher')}"
    raise ValueError(
        f"--teacher_model_name_or_path {model.teacher_model_name_or_path}: its tokenizer ({len(theirs)} tokens) is "
        f"not the student's ({len(ours)} tokens){example}. Distil a teacher that shares the student's tokenizer, "
        f"or give --kd_teacher_tokenizer {model.teacher_model_name_or_path} to distil across tokenizers"
    )


def _where(token: str, vocab: dict[str, int], whose: str) -> str:
    """How a tokenizer's vocabulary holds `token`, for check_same_tokenizer's example."""
    if token not in vocab:
        return f"absent from the {whose}'s vocabulary"
    return f"id {vocab[token]} in the {whose}'s"


def _dtype(name: str):
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


def load_model(name: str, dtype: str, model: ModelArguments, revision: str | None = None):
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": model.attn_implementation} if model.attn_implementation else {}
    return AutoModelForCausalLM.from_pretrained(name, dtype=_dtype(dtype), revision=revision, **_common(model), **extra)


def with_lora(student: Any, model: ModelArguments) -> Any:
    from peft import LoraConfig, get_peft_model

    targets = model.lora_target_modules
    config = LoraConfig(
        r=model.lora_r, lora_alpha=model.lora_alpha, lora_dropout=model.lora_dropout,
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets, modules_to_save=model.lora_modules_to_save,
        task_type=model.lora_task_type, use_rslora=model.use_rslora, use_dora=model.use_dora,
    )  # fmt: skip
    return get_peft_model(student, config)
