"""Sampling as tensors of fixed shape: temperature, top-k, top-p and a Gumbel-max draw, with no host sync, so a
CUDA graph can hold it.

The draw: argmax(scores + Gumbel noise) picks token i with probability softmax(scores)_i (the Gumbel-max trick),
the distribution torch.multinomial would sample, from other random numbers (tests/test_generation.py checks the
frequencies with a chi-square test). Filters follow the rules rollouts and the server have used: top-k keeps the k
highest scores (ties at the k-th kept), top-p keeps the smallest set of most likely tokens whose mass reaches p
(a token stays while the mass above it is < p, so the most likely one always stays).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # vLLM's: a temperature below this samples greedily


@dataclass(frozen=True)
class Sampling:
    """temperature (below GREEDY_BELOW: greedy), top_k (0: off), top_p (1: off), vocab_limit: ids at or above it
    are never drawn (a head padded past the real vocabulary; None: every id)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    vocab_limit: int | None = None

    def __post_init__(self) -> None:
        fields = ("temperature", "top_k", "top_p", "vocab_limit")
        flags = [name for name in fields if isinstance(getattr(self, name), bool)]
        if flags:  # True is an int to Python: top_k=True would keep one token, greedy, without a word
            raise ValueError(f"{flags[0]} must be a number, not a boolean; got {getattr(self, flags[0])!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0; got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an int >= 0 (0: off); got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p!r}")
        if self.vocab_limit is not None and not (isinstance(self.vocab_limit, int) and self.vocab_limit >= 1):
            raise ValueError(f"vocab_limit must be None or an int >= 1; got {self.vocab_limit!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def allowed_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(rows, V') float32: the logits of the ids that may be drawn (the first vocab_limit)."""
    limit = sampling.vocab_limit
    return (logits if limit is None or limit >= logits.shape[-1] else logits[..., :limit]).float()


def filtered_scores(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(rows, V') float32 scores whose softmax is the distribution drawn from: tempered, -inf outside top-k / top-p."""
    scores = allowed_logits(logits, sampling)
    if sampling.temperature != 1.0 and not sampling.greedy:
        scores = scores / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if sampling.top_p < 1.0:
        ordered, order = scores.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        above = probs.cumsum(-1) - probs  # the mass of the tokens more likely than each
        drop = above >= sampling.top_p  # a top_p below float32's least (1e-46) compares as 0: it would drop them all
        drop[..., 0] = False  # the most likely token always stays
        ordered = ordered.masked_fill(drop, -math.inf)
        scores = torch.empty_like(scores).scatter_(-1, order, ordered)
    return scores


def draw(scores: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(rows,) int64: argmax (greedy) or a Gumbel-max draw from softmax(scores) on the default generator."""
    if sampling.greedy:
        return scores.argmax(-1)
    # argmax(scores - log E), E ~ Exp(1), is argmax(scores + Gumbel noise): -log E is Gumbel, and drawing E directly
    # takes two passes over (rows, V) fewer than -log(-log U) (a captured step at 64 rows writes 66 MB a pass).
    # float64: float32's E (from uniforms in steps of 2**-24) would cap the noise at ~16.6, so a token trailing the
    # top score by more than ~21 could never be drawn; float64 moves that to ~37 (a mass below e**-37 per token).
    # E = 0 (log -> -inf, the token drawn whatever its score) is clamped away.
    exponential = torch.empty(scores.shape, dtype=torch.float64, device=scores.device).exponential_()
    return (scores - exponential.clamp_(min=torch.finfo(torch.float64).tiny).log_()).argmax(-1)
