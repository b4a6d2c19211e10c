"""On-policy steps across tokenizers: the student's rollouts of an optimizer step turned into cross-tokenizer
batches (align.generated.GeneratedRows: the student's sampled ids kept, their text re-tokenized for the teacher
with offsets), which then train through the cross-tokenizer loss like the dataset's batches."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ...align import CrossTokenizerCollator
from ...align.generated import GeneratedRows
from ...batch.columns import TEACHER_INPUT_IDS
from .generate import Rollout


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
