"""Rollouts scored as a rollout store holds them (teacher/store/rollouts.py): per row its tokens (prompt +
completion), labels on the completion only, the generating student's log-prob of each sampled token (the
behaviour), the teacher's log-prob of it, and the teacher's top-k and / or sampled tokens at every position, as
`precompute` computes them. The same function scores a store's rows when they are written and when a slice of them
is refreshed during training, so the two cannot drift apart."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
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
class ScoredRollouts:
    """Scored rollouts as a store's shard holds them: the rows' positions end to end (N, the sum of their lengths),
    row b at positions [offsets[b], offsets[b + 1]), each array as ScoredRow has it for one row. Built and written a
    call at a time as whole tensors (no work per row); a ScoredRow of one row is a view (`rows[b]`, iteration)."""

    offsets: torch.Tensor  # (B + 1,) int64
    input_ids: torch.Tensor  # (N,) int64
    topk_ids: torch.Tensor  # (N, k) int64
    topk_logprobs: torch.Tensor  # (N, k) float32
    samples: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (N, m) each
    columns: dict[str, torch.Tensor]  # (N,) each

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, row: int) -> ScoredRow:
        if not -len(self) <= row < len(self):
            raise IndexError(f"row {row} of {len(self)} scored rollouts")
        row %= len(self)
        at = slice(int(self.offsets[row]), int(self.offsets[row + 1]))
        samples = None if self.samples is None else tuple(d[at] for d in self.samples)
        return ScoredRow(self.input_ids[at], self.topk_ids[at], self.topk_logprobs[at], samples,
                         {name: column[at] for name, column in self.columns.items()})  # fmt: skip

    def __iter__(self) -> Iterator[ScoredRow]:
        return (self[row] for row in range(len(self)))

    @property
    def lengths(self) -> list[int]:
        return self.offsets.diff().tolist()

    @classmethod
    def cat(cls, parts: Sequence[ScoredRollouts]) -> ScoredRollouts:
        """The rows of `parts`, in order, as one."""
        ends = torch.cat([p.offsets[1:] + p.offsets.new_tensor(sum(len(q.input_ids) for q in parts[:i]))
                          for i, p in enumerate(parts)])  # fmt: skip
        samples = None
        if parts[0].samples is not None:
            samples = tuple(torch.cat([p.samples[i] for p in parts]) for i in range(3))
        return cls(torch.cat([ends.new_zeros(1), ends]), torch.cat([p.input_ids for p in parts]),
                   torch.cat([p.topk_ids for p in parts]), torch.cat([p.topk_logprobs for p in parts]), samples,
                   {name: torch.cat([p.columns[name] for p in parts]) for name in parts[0].columns})  # fmt: skip


@dataclass
class RowScores:
    """What a teacher says about one sequence of n tokens: (n, k) top-k ids and log-probs at the options'
    temperature, the samples' (n, m) ids, counts and log-probs or None, and (n,) the log-prob at temperature 1 of
    the token after each position (row t: token t + 1; the last row is never read). A served teacher's replies
    (served_teacher.py), one per sequence; TeacherScores.of_rows joins them."""

    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    samples: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    next_logprobs: torch.Tensor


@dataclass
class TeacherScores:
    """RowScores of B sequences with their positions end to end (N, the sum of their lengths, in sequence order):
    (N, k) top-k ids and log-probs, the samples' (N, m) arrays or None, (N,) next-token log-probs. In process
    (teacher_rows) or served (served_teacher.py)."""

    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    samples: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    next_logprobs: torch.Tensor

    @classmethod
    def of_rows(cls, rows: Sequence[RowScores]) -> TeacherScores:
        samples = None
        if rows[0].samples is not None:
            samples = tuple(torch.cat([r.samples[i] for r in rows]) for i in range(3))
        return cls(torch.cat([r.topk_ids for r in rows]), torch.cat([r.topk_logprobs for r in rows]), samples,
                   torch.cat([r.next_logprobs for r in rows]))  # fmt: skip


def right_padded(sequences: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids right-padded with 0 (never read: masked) and their attention mask."""
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    ids = torch.tensor([list(s) + [0] * (width - n) for s, n in zip(sequences, lengths)], dtype=torch.long)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return ids.to(device), mask.to(device)


def label_aligned(next_logprobs: torch.Tensor) -> torch.Tensor:
    """(..., T) log-probs of the token after each position -> of each position's own token (position 0: 0)."""
    return F.pad(next_logprobs[..., :-1], (1, 0), value=0.0)


def flat_label_aligned(next_logprobs: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """label_aligned of each row of rows laid end to end ((N,), rows beginning at `starts`)."""
    out = F.pad(next_logprobs[:-1], (1, 0), value=0.0)
    out[starts] = 0.0
    return out


def rows_of_chunks(chunks: LogprobChunks, ids: torch.Tensor, mask: torch.Tensor, options: ScoreOptions,
                   sequences: list[list[int]] | None = None) -> TeacherScores:  # fmt: skip
    """The teacher's TeacherScores of right-padded (B, T) `ids` (`sequences` unpadded: the samples' seeds) from its
    log-prob chunks (a model's, or a served teacher's hidden states and head): one computation for both, so the two
    give the same store. Each array leaves the device once, its padding dropped there."""
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
    kept = mask.bool()
    samples = None if draws is None else tuple(d[kept].cpu() for d in draws)
    return TeacherScores(top_ids[kept].cpu(), top_lp[kept].float().cpu(), samples, teacher_next[kept].float().cpu())


def tempered_topk_of(chunks: LogprobChunks, k: int, temperature: float, shape: torch.Size):
    """(B, T, k) top-k ids and log-probs at `temperature` of the log-probs `chunks` yields (teacher_topk's)."""
    ids, values = [], []
    for _, _, logprobs in chunks(temperature, None):
        v, i = logprobs.topk(k, dim=-1)
        ids.append(i)
        values.append(v)
    return torch.cat(ids).reshape(*shape, k), torch.cat(values).reshape(*shape, k)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[torch.device]:
    """`model` in eval mode (dropout off: its log-probs are the policy's own) for the block, then put back in the
    mode it was in; yields the device of its weights."""
    mode = model.training
    model.eval()
    try:
        yield next(model.parameters()).device
    finally:
        model.train(mode)


@torch.no_grad()
def teacher_rows(teacher: nn.Module, sequences: list[list[int]], options: ScoreOptions,
                 padded: tuple[torch.Tensor, torch.Tensor] | None = None) -> TeacherScores:  # fmt: skip
    """An in-process teacher's TeacherScores of `sequences` (`padded`: their right_padded ids and mask, on any
    device), in eval mode (put back in its mode after)."""
    with _eval_mode(teacher) as device:
        ids, mask = right_padded(sequences, device) if padded is None else (t.to(device) for t in padded)
        return rows_of_chunks(model_chunks(teacher, ids, mask), ids, mask, options, sequences)


@torch.no_grad()
def student_next_logprobs(student: nn.Module, padded: tuple[torch.Tensor, torch.Tensor],
                          vocab_size: int | None) -> torch.Tensor:  # fmt: skip
    """(B, T) the student's log-prob of each next token of right-padded `padded` (ids, mask), at temperature 1 over
    its head's first `vocab_size` rows (the ids it samples from; None: all), in eval mode (put back after)."""
    with _eval_mode(student) as device:
        ids, mask = (t.to(device) for t in padded)
        return topk_and_next_of(model_chunks(student, ids, mask, vocab_size=vocab_size), ids, 1)[2]


@torch.no_grad()
def score_rollouts(
    student: nn.Module | None, teacher: nn.Module | TeacherRows, rollouts: list[Rollout], options: ScoreOptions,
    vocab_size: int | None = None, teacher_precision: Callable[[], AbstractContextManager] = contextlib.nullcontext,
) -> ScoredRollouts:
    """Each rollout scored by `teacher` (top-k / samples and its log-prob of every completion token), in process or
    served (a TeacherRows: served_teacher.ServedTeacher), and by `student` (the behaviour log-prob of every
    completion token: the log-prob under the weights that sampled it, when they are the ones passed); with no
    `student`, the behaviour log-probs are the rollouts' own, an engine's (Rollout.logprobs). A model runs in eval
    mode and is put back in its mode. The rows come back together (ScoredRollouts; a row of it is a ScoredRow).
    `vocab_size`: the ids the student sampled from (RolloutSettings.vocab_size, a head padded past its tokenizer:
    its extra rows are never drawn), so the behaviour log-probs are normalised over those alone.
    `teacher_precision()`: the context an in-process teacher scores in (a refresh: the Trainer's autocast, as its
    live forward); the student's behaviour log-probs are taken outside it, as the rollouts were sampled."""
    sequences = [list(r.prompt) + list(r.completion) for r in rollouts]
    lengths = [len(s) for s in sequences]
    padded = right_padded(sequences, torch.device("cpu"))
    if isinstance(teacher, nn.Module):
        with teacher_precision():
            scores = teacher_rows(teacher, sequences, options, padded)
    else:
        scores = teacher.rows(sequences, options)
    ends = torch.tensor(lengths).cumsum(0)
    starts, last = ends - torch.tensor(lengths), ends - 1
    offsets = F.pad(ends, (1, 0))
    within = torch.arange(int(ends[-1])) - starts.repeat_interleave(torch.tensor(lengths))
    completion = within >= torch.tensor([len(r.prompt) for r in rollouts]).repeat_interleave(torch.tensor(lengths))
    kept = padded[1].bool()
    input_ids = padded[0][kept]
    if student is not None:
        student_next = student_next_logprobs(student, padded, vocab_size)
        behaviour = label_aligned(student_next)[kept.to(student_next.device)].cpu()
    else:
        for row, (r, n) in enumerate(zip(rollouts, lengths)):
            if r.logprobs is None or len(r.logprobs) != n - len(r.prompt):
                raise ValueError(f"rollout {row} carries no log-prob of each of its {n - len(r.prompt)} tokens "
                                 f"(Rollout.logprobs), and no student was given to compute them: pass the student "
                                 f"that sampled it")  # fmt: skip
        behaviour = torch.zeros(len(input_ids), dtype=torch.float64)
        behaviour[completion] = torch.tensor([v for r in rollouts for v in r.logprobs], dtype=torch.float64)
    columns = {
        "labels": torch.where(completion, input_ids, IGNORE_INDEX).to(torch.int32),
        BEHAVIOUR_LOGPROBS: torch.where(completion, behaviour, 0.0).float(),
        TEACHER_TOKEN_LOGPROBS: torch.where(completion, flat_label_aligned(scores.next_logprobs, starts), 0.0).float(),
    }
    top_i, top_v = scores.topk_ids.long().clone(), scores.topk_logprobs.float().clone()
    top_i[last], top_v[last] = -1, -math.inf  # a row's last position predicts nothing in its sequence
    samples = None
    if options.samples:
        d_ids, d_counts, d_lp = (d.clone() for d in scores.samples)
        d_ids[last], d_counts[last], d_lp[last] = -1, 0, -math.inf
        samples = (d_ids, d_counts, d_lp)
    return ScoredRollouts(offsets, input_ids, top_i, top_v, samples, columns)


class TeacherRows(Protocol):
    """A teacher that is no model of this process (served_teacher.ServedTeacher): its RowScores of sequences."""

    def rows(self, sequences: list[list[int]], options: ScoreOptions) -> TeacherScores: ...
