"""Rollouts scored as a rollout store holds them (teacher/store/rollouts.py): per row its tokens (prompt +
completion), labels on the completion only, the generating student's log-prob of each sampled token (the
behaviour), the teacher's log-prob of it, and the teacher's top-k and / or sampled tokens at every position, as
`precompute` computes them. The same function scores a store's rows when they are written and when a slice of them
is refreshed during training, so the two cannot drift apart."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...batch.columns import BEHAVIOUR_LOGPROBS, TEACHER_TOKEN_LOGPROBS
from ...teacher.precompute import teacher_samples, teacher_topk, teacher_topk_and_next
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


def right_padded(sequences: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids right-padded with 0 (never read: masked) and their attention mask."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
    mask = (torch.arange(width)[None] < torch.tensor([len(s) for s in sequences])[:, None]).long()
    return ids.to(device), mask.to(device)


def label_aligned(next_logprobs: torch.Tensor) -> torch.Tensor:
    """(B, T) log-probs of the token after each position -> of each position's own token (position 0: 0)."""
    return F.pad(next_logprobs[:, :-1], (1, 0), value=0.0)


@torch.no_grad()
def score_rollouts(
    student: nn.Module, teacher: nn.Module, rollouts: list[Rollout], options: ScoreOptions
) -> list[ScoredRow]:
    """Each rollout scored by `teacher` (top-k / samples and its log-prob of every completion token) and by
    `student` (the behaviour log-prob of every completion token: the log-prob under the weights that sampled it,
    when they are the ones passed). Both models run in eval mode and are put back in their mode."""
    sequences = [list(r.prompt) + list(r.completion) for r in rollouts]
    modes = (student.training, teacher.training)
    student.eval()
    teacher.eval()
    try:
        ids, mask = right_padded(sequences, next(teacher.parameters()).device)
        k = options.top_k
        if options.samples:
            generators = [sequence_generator(options.seed, s, ids.device) for s in sequences]
            *draws, top_ids, top_lp = teacher_samples(teacher, ids, mask, options.samples, k, options.temperature,
                                                      generators)  # fmt: skip
            _, _, teacher_next, _ = teacher_topk_and_next(teacher, ids, mask, 1)
        elif options.temperature == 1.0:
            top_ids, top_lp, teacher_next, _ = teacher_topk_and_next(teacher, ids, mask, k)
        else:
            top_ids, top_lp = teacher_topk(teacher, ids, mask, k, options.temperature)
            _, _, teacher_next, _ = teacher_topk_and_next(teacher, ids, mask, 1)
        s_ids, s_mask = right_padded(sequences, next(student.parameters()).device)
        _, _, student_next, _ = teacher_topk_and_next(student, s_ids, s_mask, 1)
    finally:
        student.train(modes[0])
        teacher.train(modes[1])
    teacher_own, student_own = label_aligned(teacher_next).cpu(), label_aligned(student_next).cpu()
    out = []
    for row, (r, seq) in enumerate(zip(rollouts, sequences)):
        n, p = len(seq), len(r.prompt)
        labels = torch.tensor([IGNORE_INDEX] * p + list(r.completion), dtype=torch.int32)
        completion = labels != IGNORE_INDEX
        columns = {
            "labels": labels,
            BEHAVIOUR_LOGPROBS: torch.where(completion, student_own[row, :n], 0.0).float(),
            TEACHER_TOKEN_LOGPROBS: torch.where(completion, teacher_own[row, :n], 0.0).float(),
        }
        top_i, top_v = top_ids[row, :n].cpu().clone(), top_lp[row, :n].cpu().float().clone()
        top_i[-1], top_v[-1] = -1, -math.inf  # the last position predicts nothing in this sequence
        samples = None
        if options.samples:
            d_ids, d_counts, d_lp = (d[row, :n].cpu().clone() for d in draws)
            d_ids[-1], d_counts[-1], d_lp[-1] = -1, 0, -math.inf
            samples = (d_ids, d_counts, d_lp)
        out.append(ScoredRow(torch.tensor(seq, dtype=torch.long), top_i.long(), top_v, samples, columns))
    return out
