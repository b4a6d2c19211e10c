"""Sampled teacher tokens as values: what teacher/sampling.py draws, a store holds (teacher/store/samples.py), the
liger sampled reply carries (sampled_wire.py) and the batch's teacher_sample_* columns are made from."""

from __future__ import annotations

from typing import NamedTuple

import torch

MAX_SAMPLES = 255  # counts are one byte (in a store and on the wire)


class SampledTokens(NamedTuple):
    """(rows, m) each: distinct drawn ids (-1 on padding), their counts (0 on padding, summing to m per row, or
    to 0 for a hybrid row whose top-k holds all the mass), the log-probs of the ids; the hybrid's (rows, k) top-k
    ids and log-probs, or None."""

    ids: torch.Tensor
    counts: torch.Tensor
    logprobs: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
