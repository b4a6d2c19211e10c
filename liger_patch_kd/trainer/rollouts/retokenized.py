"""On-policy steps across tokenizers: the student's rollouts of an optimizer step turned into cross-tokenizer
batches (align.generated.GeneratedRows: the student's sampled ids kept, their text re-tokenized for the teacher
with offsets), which then train through the cross-tokenizer loss like the dataset's batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...align import CrossTokenizerCollator, VocabMap
from ...align.generated import GeneratedRows
from ...batch.columns import TEACHER_INPUT_IDS
from ...models import unwrap_model
from .generate import Rollout
from .onpolicy import special_ids


def teacher_eos_id(teacher_tokenizer: Any, teacher_model: nn.Module | None) -> int | None:
    """The teacher's end of sequence: its tokenizer's eos_token_id, else its model's generation / model config."""
    eos = getattr(teacher_tokenizer, "eos_token_id", None)
    if eos is None and teacher_model is not None:
        inner = unwrap_model(teacher_model)
        for config in (getattr(inner, "generation_config", None), getattr(inner, "config", None)):
            eos = getattr(config, "eos_token_id", None)
            if eos is not None:
                break
    return eos[0] if isinstance(eos, list) and eos else eos


def generated_rows(
    collator: CrossTokenizerCollator, student: nn.Module, student_tokenizer: Any, teacher: nn.Module | None,
    vocab_map: VocabMap,
) -> tuple[GeneratedRows, VocabMap]:  # fmt: skip
    """The run's GeneratedRows (checked now: both EOS ids known) and the vocabulary map with the student's EOS
    ids paired with the teacher's, so that the EOS group's exact term compares the two stopping probabilities."""
    _, student_eos, _ = special_ids(student, student_tokenizer)
    rows = GeneratedRows.build(
        collator, vocab_map.student_vocab_size, student_eos, teacher_eos_id(collator.teacher_tokenizer, teacher)
    )
    pairs = [(s, rows.teacher_eos_id) for s in sorted(student_eos) if s < vocab_map.student_vocab_size]
    if rows.teacher_eos_id < vocab_map.teacher_vocab_size:
        vocab_map = vocab_map.with_pairs(pairs)
    return rows, vocab_map


def rows_maker(rows: GeneratedRows, data_collator: Any) -> Callable[[list[Rollout], dict], dict]:
    """OnPolicySteps.replace's `make_rows`: one micro-batch's rollouts (num_generations adjacent rows per prompt)
    and the batch they replace (its teacher prompts: the collator's teacher_prompt_length column) -> a batch."""
    if isinstance(data_collator, CrossTokenizerCollator) and data_collator is not rows.collator:
        rows = dataclasses.replace(rows, collator=data_collator)  # the user's collator: its prefixes and pads

    def make(rollouts: list[Rollout], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if "teacher_prompt_length" not in batch:
            raise ValueError(
                f"cross-tokenizer on-policy steps take the teacher's prompt tokens from the batch's "
                f"teacher_prompt_length column, which this batch lacks (keys {sorted(batch)}); use "
                f"liger_patch_kd.align.CrossTokenizerCollator (the default) as data_collator"
            )
        lengths, t_ids = batch["teacher_prompt_length"].tolist(), batch[TEACHER_INPUT_IDS]
        per_prompt = len(rollouts) // len(lengths)
        t_prompts = [t_ids[row, :n].tolist() for row, n in enumerate(lengths) for _ in range(per_prompt)]
        return rows([r.prompt for r in rollouts], [r.completion for r in rollouts], t_prompts)

    return make
