"""Choices that the fused kernels and the reference oracle must share because they are conventions, not math:
which top-k slots are padding, the floor of a tail bucket's mass, and which vocabulary ids are real.

Everything else in `reference.py` is written independently of the kernels; only these definitions are imported
by both, so a kernel and the oracle cannot disagree about what the input means.
"""

from __future__ import annotations

import torch

# Inference servers pad missing top-k slots with -inf or a large negative number (vLLM: -9999.0); any log-prob
# at or below this is a padding slot, as is a negative id. exp(-1000) is 0 in every float format anyway.
LOGPROB_PLACEHOLDER = -1e3
# The tail bucket's mass is 1 - sum(top-k probs): rounding noise when the top-k holds nearly all the mass (and
# bf16 log-probs can even sum above 1). Both sides' tail masses are floored here so the loss stays finite.
TAIL_FLOOR = 1e-6


def topk_valid_slots(teacher_token_ids: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """True where a top-k slot carries teacher data (not a padding slot)."""
    return (teacher_token_ids >= 0) & (teacher_logprobs > LOGPROB_PLACEHOLDER) & torch.isfinite(teacher_logprobs)


def resolve_vocab(student_rows: int, teacher_rows: int | None, vocab_size: int | None) -> int:
    """How many leading vocabulary ids both distributions (and the CE term) are taken over.

    Heads padded to different sizes for sharding share their first `vocab_size` rows (the tokenizer's ids);
    the rows past it are never a real token, so both sides are restricted to ids [0, vocab_size). Without
    `vocab_size` the two heads must have one size. `teacher_rows` is None for a teacher given as top-k data.
    """
    if vocab_size is not None:
        for role, rows in (("student", student_rows), ("teacher", teacher_rows)):
            if rows is not None and vocab_size > rows:
                raise ValueError(
                    f"vocab_size={vocab_size} is larger than the {role} lm_head ({rows} rows); vocab_size counts "
                    f"the real token ids, which every head holds: use len(tokenizer)"
                )
        return vocab_size
    if teacher_rows is not None and teacher_rows != student_rows:
        raise ValueError(
            f"the student lm_head has {student_rows} rows and the teacher's {teacher_rows}; distillation compares "
            f"distributions over one vocabulary. If the two share a tokenizer and their heads are padded to "
            f"different sizes (Qwen2.5: 151936 and 152064 rows), pass vocab_size=len(tokenizer) so both are taken "
            f"over the real ids [0, vocab_size); otherwise map the tokenizers first"
        )
    return student_rows
