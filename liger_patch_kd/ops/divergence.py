"""The one home of the divergence terms and their gradient (PyTorch), for every fused path: the dense chunk
(fused_linear_jsd.jsd_chunk_torch), the top-k chunk (fused_linear_topk_kd.topk_chunk_torch), the log-prob
losses (losses.logprob) and the cross-tokenizer loss (align). The Triton kernels compute the same formulas
in-kernel, in the same structure; reference/ keeps its own definition (it is the independent oracle).

Per class j of two (sub-)distributions S (student) and P (teacher), generalized JSD in the TRL / Liger
convention:
    beta == 0 (forward KL(P||S)):  term_j = P_j (log P_j - log S_j)
    beta == 1 (reverse KL(S||P)):  term_j = S_j (log S_j - log P_j)
    otherwise:                     term_j = beta P_j (log P_j - log M_j) + (1 - beta) S_j (log S_j - log M_j),
                                   M = beta P + (1 - beta) S
and a_j = S_j dL/dS_j, the only thing a gradient needs:
    forward KL: a_j = -P_j;  reverse KL: a_j = S_j (log S_j - log P_j + 1);
    JSD: a_j = (1 - beta) S_j (log S_j - log M_j)
For S = softmax(u) the gradient with respect to the (tempered, capped) logits u is then
    dL/du_v = a_v - S_v * sum_j a_j                                                  (`softmax_grad`)
which covers the three at once. Forward KL has sum_j a_j = -1, hence its simpler form S - P (`dense_divergence`
keeps it: one pass fewer over the row). Sub-distributions (a top-k with a tail bucket, a renormalised top-k, a
vocabulary map) chain their extra classes into a before the same formula (see the top-k and align callers).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = [
    "class_a",
    "dense_divergence",
    "divergence_terms",
    "estimated_forward_kl",
    "log_mixture",
    "softmax_grad",
    "terms_and_a",
]


def log_mixture(log_s: torch.Tensor, log_p: torch.Tensor, beta: float) -> torch.Tensor:
    """log M = log(beta P + (1 - beta) S), from the two log-probabilities (0 < beta < 1).

    The Triton kernels take the cheaper route from the probabilities they already hold, log(beta p + (1 - beta) s)
    with a floor at fp32's smallest normal (one transcendental instead of two); equal up to rounding."""
    return torch.logaddexp(log_p + math.log(beta), log_s + math.log(1 - beta))


def _terms(log_s, log_p, s, p, beta, log_m):
    if beta == 0:
        return p * (log_p - log_s)
    if beta == 1:
        return s * (log_s - log_p)
    return beta * p * (log_p - log_m) + (1 - beta) * s * (log_s - log_m)


def class_a(log_s: torch.Tensor, log_p: torch.Tensor, beta: float, log_m: torch.Tensor | None = None) -> torch.Tensor:
    """a_j = S_j dL/dS_j per class (see the module docstring); `log_m` reuses a mixture already computed."""
    if beta == 0:
        return -log_p.exp()
    s = log_s.exp()
    if beta == 1:
        return s * (log_s - log_p + 1)
    log_m = log_mixture(log_s, log_p, beta) if log_m is None else log_m
    return (1 - beta) * s * (log_s - log_m)


def terms_and_a(
    log_s: torch.Tensor, log_p: torch.Tensor, beta: float, present: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(divergence term, a = dL/dS * S) per class, 0 where the class is not `present`."""
    s, p = log_s.exp(), log_p.exp()
    log_m = log_mixture(log_s, log_p, beta) if 0 < beta < 1 else None
    terms = _terms(log_s, log_p, s, p, beta, log_m)
    a = class_a(log_s, log_p, beta, log_m)
    zero = torch.zeros_like(terms)
    return torch.where(present, terms, zero), torch.where(present, a, zero)


def divergence_terms(
    log_s: torch.Tensor, log_p: torch.Tensor, beta: float, present: torch.Tensor | None = None
) -> torch.Tensor:
    """The divergence term per class (no gradient coefficients), 0 where a class is not `present`."""
    s, p = log_s.exp(), log_p.exp()
    log_m = log_mixture(log_s, log_p, beta) if 0 < beta < 1 else None
    terms = _terms(log_s, log_p, s, p, beta, log_m)
    return terms if present is None else torch.where(present, terms, torch.zeros_like(terms))


def softmax_grad(a: torch.Tensor, s: torch.Tensor, a_sum: torch.Tensor | None = None) -> torch.Tensor:
    """dL/du = a - S * sum(a) for S = softmax(u) over the last dim (`a_sum`: that sum, when already known)."""
    a_sum = a.sum(-1, keepdim=True) if a_sum is None else a_sum
    return a - s * a_sum


def dense_divergence(
    log_s: torch.Tensor, log_p: torch.Tensor, beta: float
) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """Full distributions over one vocabulary, rows (N, V): (loss per row, a function giving dL/du).

    The gradient is only built when asked for (the function is called only when a gradient is wanted), so a
    forward without grad holds no extra (N, V) buffer. Forward KL keeps its simpler form S - P."""
    s, p = log_s.exp(), log_p.exp()
    if beta == 0:
        soft = (p * (log_p - log_s)).sum(-1)
        return soft, lambda: s - p  # a - S sum(a) with a = -P, sum(a) = -1
    if beta == 1:
        soft = (s * (log_s - log_p)).sum(-1)
        # a = S (log S - log P + 1), sum(a) = L + 1: a - S sum(a) = S (log S - log P - L)
        return soft, lambda: s * (log_s - log_p - soft[:, None])
    log_m = log_mixture(log_s, log_p, beta)
    soft = _terms(log_s, log_p, s, p, beta, log_m).sum(-1)
    return soft, lambda: softmax_grad(class_a(log_s, log_p, beta, log_m), s)


def estimated_forward_kl(
    log_s: torch.Tensor, log_p: torch.Tensor, mass: torch.Tensor, present: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward KL against an estimated teacher: per slot j with estimated mass P^_j (`mass`, e.g. R c_j / m for a
    sampled token) and the teacher's log P_j, (term P^_j (log P_j - log S_j), a_j = -P^_j); 0 where not present.
    With P^ = P it is the forward-KL row of `terms_and_a`; the sampled-token loss (fused_linear_sampled_kd) uses it."""
    zero = torch.zeros_like(log_s)
    terms = torch.where(present, mass * (log_p - log_s), zero)
    return terms, torch.where(present, -mass, zero)
