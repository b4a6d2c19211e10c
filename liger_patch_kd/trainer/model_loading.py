"""Models given by name or path, TRL's convention (`KDTrainer(model="Qwen/Qwen3-0.6B", teacher_model="...")`):
loaded with AutoModelForCausalLM.from_pretrained and KDTrainingArguments' model_init_kwargs /
teacher_model_init_kwargs (dtype, device_map, attn_implementation, ...). As TRL's configs, a dtype is given as
"auto", a torch dtype or its name ("bfloat16"), under transformers' key "dtype" or the older "torch_dtype"; it
defaults to "auto" (the checkpoint's own)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..utils.errors import reason_of

DTYPE_KEYS = ("dtype", "torch_dtype")


def normalized_init_kwargs(value: Any, name: str) -> dict | None:
    """KDTrainingArguments' `name` (model_init_kwargs, teacher_model_init_kwargs) as a dict whose dtype is under
    "dtype" as a name ("auto", "bfloat16", ...; JSON-safe, so the arguments still save), or None; a JSON object in a
    str (the command line) is parsed. Anything else is a one-line ValueError."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise ValueError(f"{name} must be a dict of from_pretrained keyword arguments (or its JSON), e.g. "
                         f'{{"dtype": "bfloat16"}}; got {value!r}')  # fmt: skip
    kwargs = dict(value)
    given = [key for key in DTYPE_KEYS if key in kwargs]
    if len(given) > 1:
        raise ValueError(f"{name} gives both 'dtype' ({kwargs['dtype']!r}) and 'torch_dtype' "
                         f"({kwargs['torch_dtype']!r}): give one, 'dtype' (transformers' name)")  # fmt: skip
    if given:
        kwargs["dtype"] = dtype_name(kwargs.pop(given[0]), f"{name}[{given[0]!r}]")
    return kwargs


def dtype_name(dtype: Any, name: str) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    if isinstance(dtype, str):
        short = dtype.removeprefix("torch.")
        if short == "auto" or isinstance(getattr(torch, short, None), torch.dtype):
            return short
    raise ValueError(f"{name} must be 'auto', a torch dtype or its name ('bfloat16', 'float16', 'float32'); got "
                     f"{dtype!r}")  # fmt: skip


def is_model_name(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike))


def load_named_model(value: Any, init_kwargs: dict | None, role: str) -> nn.Module:
    """`value` (a model id or a directory saved with save_pretrained) loaded as a causal LM with `init_kwargs`
    (normalized_init_kwargs'); a name that loads nothing is one line naming `role` (model, teacher_model, ...)."""
    from transformers import AutoModelForCausalLM

    kwargs = dict(init_kwargs or {})
    dtype = kwargs.get("dtype", "auto")
    kwargs["dtype"] = dtype if dtype == "auto" else getattr(torch, dtype)
    try:
        return AutoModelForCausalLM.from_pretrained(os.fspath(value), **kwargs)
    except (OSError, ValueError) as e:
        raise ValueError(f"{role}={os.fspath(value)!r}: no causal LM loads from there ({reason_of(e)}); give a model "
                         f"id, a directory saved with save_pretrained, or the model itself") from None  # fmt: skip


def loaded_models(model: Any, teacher_model: Any, args: Any) -> tuple[Any, Any]:
    """(model, teacher_model) with any given by name or path loaded (a teacher set's members too), with
    args.model_init_kwargs / args.teacher_model_init_kwargs; init kwargs with nothing to load are refused, as TRL
    refuses them, since they would be ignored."""
    student = model
    if is_model_name(model):
        student = load_named_model(model, args.model_init_kwargs, "model")
    elif args.model_init_kwargs is not None:
        raise ValueError(f"model_init_kwargs={args.model_init_kwargs} is set, but model is already a model "
                         f"({type(model).__name__}): they load a model given by name or path; unset them, or pass "
                         f"the name")  # fmt: skip
    kwargs = args.teacher_model_init_kwargs
    if isinstance(teacher_model, Mapping) and not isinstance(teacher_model, nn.Module):
        named = [name for name, m in teacher_model.items() if is_model_name(m)]
        teacher = {name: load_named_model(m, kwargs, f"teacher_model[{name!r}]") if name in named else m
                   for name, m in teacher_model.items()}  # fmt: skip
    else:
        named = [None] if is_model_name(teacher_model) else []
        teacher = load_named_model(teacher_model, kwargs, "teacher_model") if named else teacher_model
    if kwargs is not None and not named:
        raise ValueError(f"teacher_model_init_kwargs={kwargs} is set, but no teacher_model is given by name or path: "
                         f"they load one; unset them, or pass the teacher's name")  # fmt: skip
    return student, teacher


def tokenizer_of_named(model: Any) -> Any:
    """The tokenizer saved with a model given by name or path (as TRL loads processing_class), or None."""
    if not is_model_name(model):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.fspath(model))
    except (OSError, ValueError):  # weights without a tokenizer: the rows' checks ask for processing_class if needed
        return None


def check_named_teachers_share_the_tokenizer(teacher_model: Any, tokenizer: Any, across_tokenizers: bool) -> None:
    """A teacher given by name or path comes with its tokenizer: one whose vocabulary is not the student's
    (`tokenizer`, processing_class) would score the student's ids as other tokens, silently, when the two
    vocabularies have one size. Refused before any weights load, unless the run distils across tokenizers."""
    if across_tokenizers or not callable(getattr(tokenizer, "get_vocab", None)):
        return
    if isinstance(teacher_model, Mapping) and not isinstance(teacher_model, nn.Module):
        named = [(f"teacher_model[{name!r}]", m) for name, m in teacher_model.items() if is_model_name(m)]
    else:
        named = [("teacher_model", teacher_model)] if is_model_name(teacher_model) else []
    ours = None
    for role, value in named:
        theirs = tokenizer_of_named(value)
        if theirs is None:  # weights without a tokenizer: nothing to compare
            continue
        ours = ours or tokenizer.get_vocab()
        vocab = theirs.get_vocab()
        if vocab != ours:
            token = min(set(ours.items()) ^ set(vocab.items()), key=lambda kv: kv[1])[0]
            raise ValueError(
                f"{role}={os.fspath(value)!r}: its tokenizer ({len(vocab)} tokens) is not processing_class's "
                f"({len(ours)} tokens; e.g. {token!r} is id {ours.get(token, 'absent')} in the student's and "
                f"{vocab.get(token, 'absent')} in the teacher's), so it would score the student's ids as other "
                f"tokens: distil a teacher that shares the student's tokenizer, or set kd_teacher_tokenizer="
                f"{os.fspath(value)!r} to distil across tokenizers"
            )
