"""Rollouts scored as a rollout store holds them (teacher/store/rollouts.py): per row its tokens (prompt +
completion), labels on the completion only, the generating student's log-prob of each sampled token (the
behaviour), the teacher's log-prob of it, and the teacher's top-k and / or sampled tokens at every position, as
`precompute` computes them. The same function scores a store's rows when they are written and when a slice of them
is refreshed during training, so the two cannot drift apart."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ...batch.columns import BEHAVIOUR_LOGPROBS, TEACHER_TOKEN_LOGPROBS
from ...teacher.precompute import (
    LogprobChunks,
    model_chunks,
    samples_of_chunks,
    teacher_topk_and_next,
    topk_and_next_of,
)
from ...teacher.sampling import sequence_generator
from ...teacher.store.rollouts import IGNORE_INDEX
from ..rollouts.generate import Rollout


@dataclass(frozen=True)
class ScoreOptions:
    """What the teacher writes per position: `top_k` log-probs (0: none, with samples), `samples` draws seeded from
    `seed` and each sequence's tokens, both at `temperature` (keep 1: tempering top-k later is exact); the log-probs
    of the sampled tokens themselves (teacher and behaviour) are always at temperature 1."""

    top_k: int = 64
    samples: int = 0
    temperature: float = 1.0
    seed: int = 0


@dataclass
class ScoredRow:
    """One rollout as a store row: (n,) input_ids; (n, k) top-k ids and log-probs (row t: the token after t; the last
    row padding); the samples' (n, m) ids, counts and log-probs or None; and the (n,) label-aligned rollout columns
    {labels, behaviour_logprobs, teacher_token_logprobs}."""

    input_ids: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    samples: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    columns: dict[str, torch.Tensor]


@dataclass
class RowScores:
    """What a teacher says about one sequence of n tokens: (n, k) top-k ids and log-probs at the options'
    temperature, the samples' (n, m) ids, counts and log-probs or None, and (n,) the log-prob at temperature 1 of
    the token after each position (row t: token t + 1; the last row -inf). In process (teacher_rows) or served
    (served_teacher.py)."""

    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    samples: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    next_logprobs: torch.Tensor


def right_padded(sequences: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids right-padded with 0 (never read: masked) and their attention mask."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    mask = (torch.arange(width)[None] < torch.tensor([len(s) for s in sequences])[:, None]).long()
    return ids.to(device), mask.to(device)


def label_aligned(next_logprobs: torch.Tensor) -> torch.Tensor:
    """(..., T) log-probs of the token after each position -> of each position's own token (position 0: 0)."""
    return F.pad(next_logprobs[..., :-1], (1, 0), value=0.0)


def rows_of_chunks(chunks: LogprobChunks, sequences: list[list[int]], ids: torch.Tensor, mask: torch.Tensor,
                   options: ScoreOptions) -> list[RowScores]:  # fmt: skip
    """The teacher's RowScores of right-padded (B, T) `ids` from its log-prob chunks (a model's, or a served
    teacher's hidden states and head): one computation for both, so the two give the same store."""
    k = options.top_k
    draws = None
    if options.samples:
        generators = [sequence_generator(options.seed, s, ids.device) for s in sequences]
        *draws, top_ids, top_lp = samples_of_chunks(chunks, ids, mask, options.samples, k, options.temperature,
                                                    generators)  # fmt: skip
        _, _, teacher_next, _ = topk_and_next_of(chunks, ids, 1)
    elif options.temperature == 1.0:
        top_ids, top_lp, teacher_next, _ = topk_and_next_of(chunks, ids, k)
    else:
        top_ids, top_lp = tempered_topk_of(chunks, k, options.temperature, ids.shape)
        _, _, teacher_next, _ = topk_and_next_of(chunks, ids, 1)
    out = []
    for row, seq in enumerate(sequences):
        n = len(seq)
        samples = None if draws is None else tuple(d[row, :n].cpu() for d in draws)
        out.append(RowScores(top_ids[row, :n].cpu(), top_lp[row, :n].cpu().float(), samples,
                             teacher_next[row, :n].cpu().float()))  # fmt: skip
    return out


def tempered_topk_of(chunks: LogprobChunks, k: int, temperature: float, shape: torch.Size):
    """(B, T, k) top-k ids and log-probs at `temperature` of the log-probs `chunks` yields (teacher_topk's)."""
    ids, values = [], []
    for _, _, logprobs in chunks(temperature, None):
        v, i = logprobs.topk(k, dim=-1)
        ids.append(i)
        values.append(v)
    return torch.cat(ids).reshape(*shape, k), torch.cat(values).reshape(*shape, k)


@torch.no_grad()
def teacher_rows(teacher: nn.Module, sequences: list[list[int]], options: ScoreOptions) -> list[RowScores]:
    """An in-process teacher's RowScores of `sequences`, in eval mode (put back in its mode after)."""
    mode = teacher.training
    teacher.eval()
    try:
        ids, mask = right_padded(sequences, next(teacher.parameters()).device)
        return rows_of_chunks(model_chunks(teacher, ids, mask), sequences, ids, mask, options)
    finally:
        teacher.train(mode)


@torch.no_grad()
def score_rollouts(
    student: nn.Module | None, teacher: nn.Module | TeacherRows, rollouts: list[Rollout], options: ScoreOptions
) -> list[ScoredRow]:
    """Each rollout scored by `teacher` (top-k / samples and its log-prob of every completion token), in process or
    served (a TeacherRows: served_teacher.ServedTeacher), and by `student` (the behaviour log-prob of every
    completion token: the log-prob under the weights that sampled it, when they are the ones passed); with no
    `student`, the behaviour log-probs are the rollouts' own, an engine's (Rollout.logprobs). A model runs in eval
    mode and is put back in its mode."""
    sequences = [list(r.prompt) + list(r.completion) for r in rollouts]
    if isinstance(teacher, nn.Module):
        rows = teacher_rows(teacher, sequences, options)
    else:
        rows = teacher.rows(sequences, options)
    if student is not None:
        mode = student.training
        student.eval()
        try:
            s_ids, s_mask = right_padded(sequences, next(student.parameters()).device)
            _, _, student_next, _ = teacher_topk_and_next(student, s_ids, s_mask, 1)
        finally:
            student.train(mode)
        student_own = label_aligned(student_next).cpu()
    out = []
    for row, (r, seq, scores) in enumerate(zip(rollouts, sequences, rows)):
        n, p = len(seq), len(r.prompt)
        labels = torch.tensor([IGNORE_INDEX] * p + list(r.completion), dtype=torch.int32)
        completion = labels != IGNORE_INDEX
        if student is not None:
            behaviour = student_own[row, :n]
        elif r.logprobs is not None and len(r.logprobs) == n - p:
            behaviour = torch.tensor([0.0] * p + list(r.logprobs), dtype=torch.float64)
        else:
            raise ValueError(f"rollout {row} carries no log-prob of each of its {n - p} tokens (Rollout.logprobs), "
                             f"and no student was given to compute them: pass the student that sampled it")
        columns = {
            "labels": labels,
            BEHAVIOUR_LOGPROBS: torch.where(completion, behaviour, 0.0).float(),
            TEACHER_TOKEN_LOGPROBS: torch.where(completion, label_aligned(scores.next_logprobs), 0.0).float(),
        }
        top_i, top_v = scores.topk_ids.clone(), scores.topk_logprobs.float().clone()
        top_i[-1], top_v[-1] = -1, -math.inf  # the last position predicts nothing in this sequence
        samples = None
        if options.samples:
            d_ids, d_counts, d_lp = (d.clone() for d in scores.samples)
            d_ids[-1], d_counts[-1], d_lp[-1] = -1, 0, -math.inf
            samples = (d_ids, d_counts, d_lp)
        out.append(ScoredRow(torch.tensor(seq, dtype=torch.long), top_i.long(), top_v, samples, columns))
    return out


class TeacherRows(Protocol):
    """A teacher that is no model of this process (served_teacher.ServedTeacher): its RowScores of sequences."""

    def rows(self, sequences: list[list[int]], options: ScoreOptions) -> list[RowScores]: ...
