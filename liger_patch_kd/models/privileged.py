"""A teacher that reads its own prompt (privileged context: a system prompt, a hint, a document, the reference
answer) and scores the same completion as the student: context distillation, on-policy self-distillation.

The batch carries the teacher's own rows beside the student's: `teacher_input_ids` (teacher prompt + completion),
`teacher_labels` (the completion, ignore_index elsewhere) and their layout (`teacher_attention_mask` when padded,
`teacher_position_ids` when packed). Row b of the student and row b of the teacher hold the same completions in
the same order; the k-th scored position of student row b (the k-th position whose shifted label is not
ignore_index) is paired with the k-th scored position of teacher row b, whatever the prompts' lengths and either
side's padding or packing. The teacher's last hidden states (materialised, its logits; offline, its top-k
computed on teacher_input_ids) at the paired positions are gathered into the student's position order, and the
loss is the same fused loss as always: no divergence code of its own, no (tokens x vocab) logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..batch.columns import TEACHER_ATTENTION_MASK, TEACHER_INPUT_IDS, TEACHER_LABELS, TEACHER_POSITION_IDS
from ..losses.checks import run_device_checks
from .kd_io import shift_labels
from .state import unwrap_model

PRIVILEGED_KEYS = (TEACHER_INPUT_IDS, TEACHER_LABELS, TEACHER_ATTENTION_MASK, TEACHER_POSITION_IDS)


@dataclass
class PrivilegedInputs:
    """The teacher's own rows of one call (see the module docstring)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None

    @classmethod
    def pop(cls, kwargs: dict) -> PrivilegedInputs | None:
        """Take the teacher's rows out of a forward's keyword arguments (the student's backbone must not see them);
        None when the batch has none."""
        fields = {key: kwargs.pop(key, None) for key in PRIVILEGED_KEYS}
        if fields[TEACHER_INPUT_IDS] is None:
            given = sorted(k for k, v in fields.items() if v is not None)
            if given:
                raise ValueError(f"{given} came without teacher_input_ids: pass the teacher's own rows whole")
            return None
        if fields[TEACHER_LABELS] is None:
            raise ValueError(
                "teacher_input_ids needs teacher_labels (the completion tokens of the teacher's rows, ignore_index "
                "on the teacher's prompt and padding) to pair its completion tokens with the student's; "
                "liger_patch_kd.trainer.PrivilegedCollator makes them"
            )
        return cls(*(fields[key] for key in PRIVILEGED_KEYS))

    def align_live(self, teacher: nn.Module, student_targets: torch.Tensor, ignore_index: int):
        """`align` for a live teacher, which reads the teacher's rows itself: its outputs (hidden states, logits) go
        through it to the student's positions. The pairing, and every attended teacher id against the teacher's
        embedding, checked here, before either model runs."""
        return self.aligner(student_targets, ignore_index, teacher_vocab=embedding_rows(teacher))

    def align_stored(self, fields: dict[str, torch.Tensor], student_targets: torch.Tensor, ignore_index: int):
        """A stored signal of the teacher's rows (top-k or sampled tokens from a store precomputed on, or a server
        asked about, teacher_input_ids, or hidden states: {"teacher_<name>": (B, T_t, ...)}) gathered into the
        student's positions. The pairing is checked here, before either model runs."""
        align = self.aligner(student_targets, ignore_index)
        for name, value in fields.items():
            if tuple(value.shape[:2]) != tuple(self.input_ids.shape):
                raise ValueError(
                    f"{name} of shape {tuple(value.shape)} must be the teacher's on its own rows, (batch, "
                    f"teacher length) = {tuple(self.input_ids.shape)} leading: precompute a store on "
                    f"teacher_input_ids, or ask a served teacher about them (KDTrainer's kd_teacher_url does)"
                )
        return {name: align(value) for name, value in fields.items()}

    def teacher_kwargs(self) -> dict:
        """The teacher's layout beyond ids and mask: its own position ids (packed rows), no KV cache."""
        out = {"use_cache": False}
        if self.position_ids is not None:
            out["position_ids"] = self.position_ids
        return out

    def aligner(
        self, student_targets: torch.Tensor, ignore_index: int, teacher_vocab: int | None = None
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A function taking the teacher's per-position tensor (B, T_t, D) (hidden states, logits, top-k) to the
        student's positions (B, T_s, D); rows the student does not score get some teacher position's values (never
        scored). Checks the pairing first (ValueError naming the row) and, given `teacher_vocab` (a live teacher's
        embedding rows), that every attended teacher id is one, in the same host sync."""
        teacher_targets = shift_labels(self.labels, ignore_index)
        checks = [] if teacher_vocab is None else [teacher_id_check(self.input_ids, self.attention_mask, teacher_vocab)]
        index = completion_index(student_targets, teacher_targets, ignore_index, checks)
        batch, length = student_targets.shape

        def align(per_position: torch.Tensor) -> torch.Tensor:
            flat = per_position.reshape(-1, per_position.shape[-1])
            return flat[index.to(flat.device).reshape(-1)].reshape(batch, length, -1)

        return align


def embedding_rows(model) -> int | None:
    """How many token ids the model's input embedding holds (None when it does not say)."""
    embedding = unwrap_model(model).get_input_embeddings()
    return getattr(embedding, "num_embeddings", None)


def teacher_id_check(ids: torch.Tensor, mask: torch.Tensor | None, vocab: int):
    """(device flag, message) for attended teacher_input_ids outside [0, vocab): the teacher's embedding would
    raise an IndexError on a CPU (a device-side assert on a GPU, which ends the process) with no word of the fix."""
    bad = (ids < 0) | (ids >= vocab)
    if mask is not None:
        bad = bad & mask.to(device=bad.device, dtype=torch.bool)

    def message() -> str:
        wrong = ids[bad]
        return (
            f"teacher_input_ids hold {wrong.numel()} id(s) outside the teacher's vocabulary [0, {vocab}) (max id "
            f"{int(ids[bad].max())}, e.g. {wrong[:4].tolist()}); tokenize the teacher's rows with the teacher's own "
            f"tokenizer (or give kd_teacher_tokenizer), or drop the rows that hold such ids"
        )

    return bad.any(), message


def completion_index(
    student_targets: torch.Tensor, teacher_targets: torch.Tensor, ignore_index: int, checks: list | None = None
) -> torch.Tensor:
    """(B, T_s) indices into the teacher's flattened (B * T_t) positions: the teacher position that predicts the same
    completion token as each student position (the k-th scored of its row to the k-th scored of the teacher's).

    Shapes stay static (no nonzero()); checking the pairing costs one host sync. Rows the student does not score
    point at some valid teacher position.

    `checks`: more (device flag, message) pairs (losses.checks.run_device_checks) read in the same sync.

    Raises:
        ValueError: the batch sizes differ, or a row scores a different number of tokens, or other tokens, on the
            two sides (naming the first such row); or one of `checks` failed.
    """
    if student_targets.dim() != 2 or teacher_targets.dim() != 2 or student_targets.shape[0] != teacher_targets.shape[0]:
        raise ValueError(
            f"teacher_input_ids / teacher_labels must be (batch, teacher_length) with the student's batch size: got "
            f"student labels {tuple(student_targets.shape)} and teacher labels {tuple(teacher_targets.shape)}; "
            f"row b of the teacher's rows holds row b's completions"
        )
    teacher_targets = teacher_targets.to(student_targets.device)
    batch, t_len = teacher_targets.shape
    scored_s, scored_t = student_targets != ignore_index, teacher_targets != ignore_index
    rank_s, rank_t = scored_s.cumsum(1) - 1, scored_t.cumsum(1) - 1
    # by_rank[b, k]: the position of row b's k-th scored teacher position. Unscored positions go to slots t_len + t,
    # so that no two positions share a slot (scatter_ with duplicate indices is nondeterministic on CUDA)
    by_rank = torch.zeros(batch, 2 * t_len, dtype=torch.long, device=teacher_targets.device)
    positions = torch.arange(t_len, device=teacher_targets.device).expand(batch, t_len)
    by_rank.scatter_(1, torch.where(scored_t, rank_t, t_len + positions), positions)
    local = by_rank.gather(1, torch.where(scored_s, rank_s.clamp(max=t_len), t_len))
    index = local + torch.arange(batch, device=local.device)[:, None] * t_len
    paired = teacher_targets.reshape(-1)[index]
    counts_s, counts_t = scored_s.sum(1), scored_t.sum(1)
    bad_rows = (counts_s != counts_t) | ((paired != student_targets) & scored_s).any(1)

    def mismatch() -> str:
        row = int(bad_rows.nonzero()[0])
        return (
            f"row {row}: the student scores {int(counts_s[row])} completion tokens and the teacher "
            f"{int(counts_t[row])}, or other tokens (student {student_targets[row][scored_s[row]][:8].tolist()}..., "
            f"teacher {teacher_targets[row][scored_t[row]][:8].tolist()}...); the teacher's rows must hold the same "
            f"completion tokens as the student's, in the same order, each after a non-empty prompt"
        )

    flags = [(flag.to(bad_rows.device), message) for flag, message in checks or []]
    run_device_checks([*flags, (bad_rows.any(), mismatch)])  # the one host sync
    return index
