"""Sampled teacher tokens from log-probs (Sparse Logit Sampling, arXiv 2503.16870): m draws per position from
the teacher, kept as distinct ids with counts and the teacher's log-prob of each; optionally after the exact
top-k (the hybrid: the draws then come from the teacher restricted to the ids outside its top-k). The loss that
reads them is `losses.fused_linear_sampled_kd`."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from ..wire.sampled_tokens import SampledTokens


def sample_teacher_tokens(
    logprobs: torch.Tensor, samples: int, *, top_k: int = 0, generator: torch.Generator | None = None
) -> SampledTokens:
    """Draw `samples` tokens per row of `logprobs` (rows, V): the teacher's log-probs at the temperature wanted
    (draws come from exactly this distribution, so make them with log_softmax(logits / T)).

    With top_k > 0 the top_k most likely ids are kept exactly and the draws come from the rest, renormalised.
    The same generator state gives the same draws (on one device type)."""
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise ValueError(f"samples (draws per position) must be an integer >= 1; got {samples!r}")
    rows, vocab = logprobs.shape
    if not isinstance(top_k, int) or not 0 <= top_k < vocab:
        raise ValueError(f"top_k must be an integer in [0, {vocab}) with sampled tokens (the rest is sampled)")
    lp = logprobs.float() if logprobs.dtype in (torch.float16, torch.bfloat16) else logprobs
    top_ids = top_lp = None
    rest = lp
    if top_k:
        top_lp, top_ids = lp.topk(top_k, dim=-1)
        rest = lp.scatter(-1, top_ids, -math.inf)
    has_rest = torch.isfinite(rest).any(-1) & (rest.exp().sum(-1) > 0)
    weights = torch.where(has_rest[:, None], rest.exp(), 1.0)  # a row with nothing left draws anything, then drops
    draws = torch.multinomial(weights, samples, replacement=True, generator=generator)
    dense = torch.zeros(rows, vocab, dtype=torch.int32, device=lp.device)
    dense.scatter_add_(-1, draws, torch.ones_like(draws, dtype=torch.int32))
    dense = torch.where(has_rest[:, None], dense, 0)
    counts, ids = dense.topk(min(samples, vocab), dim=-1)  # the distinct drawn ids first, then zero-count slots
    present = counts > 0
    ids = torch.where(present, ids, -1)
    sample_lp = torch.where(present, lp.gather(-1, torch.where(present, ids, 0)), -math.inf)
    return SampledTokens(ids.to(torch.int32), counts, sample_lp, top_ids, top_lp)


def sequence_generator(
    seed: int, tokens: Sequence[int] | torch.Tensor, device: torch.device | str = "cpu"
) -> torch.Generator:
    """The generator of one sequence's draws, seeded from sha256(seed, its token ids): a sequence's draws depend on
    the seed, its tokens and the teacher only, not on its batch, request, position in the data or order, so
    `precompute(seed=s)` and `liger-kd serve` (a request's sample_seed s) draw the same tokens for it."""
    ids = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1).cpu()
    digest = hashlib.sha256(f"{int(seed)}:".encode() + ids.numpy().tobytes()).hexdigest()
    return torch.Generator(device).manual_seed(int(digest[:8], 16))  # CPU generators keep only 32 bits of a seed
