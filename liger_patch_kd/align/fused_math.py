"""Per-group loss and its gradient a = dL/dq * q for the fused cross-tokenizer loss (PyTorch, any device).

With the merged student distribution q over the student vocabulary (align.reference), a_v = q_v dL/dq_v
is all the chunk kernel needs: the row predicting the group's last token gets a - S A (A = sum_v a_v, S its
softmax: ops.divergence.softmax_grad), each earlier row of the group gets A (onehot(y) - S), the gradient of log S(y).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..conventions import TAIL_FLOOR
from ..ops.divergence import terms_and_a
from .config import CrossTokenizerConfig
from .vocab import VocabMap


def uld_and_a(q: torch.Tensor, p: torch.Tensor, top_k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """ULD per row (see reference.sorted_l1) and a = q dL/dq. Sorting is only needed on the student side for
    the permutation; the teacher's sorted values come from topk / sort without indices."""
    v_s, v_t = q.shape[-1], p.shape[-1]
    if top_k is None or top_k >= max(v_s, v_t):
        width = max(v_s, v_t)
        qs, qi = q.sort(-1, descending=True)
        ps = p.sort(-1, descending=True).values
        diff = F.pad(qs, (0, width - v_s)) - F.pad(ps, (0, width - v_t))
        loss = diff.abs().sum(-1)
        return loss, torch.zeros_like(q).scatter_(-1, qi, diff[:, :v_s].sign() * qs)
    qs, qi = q.topk(min(top_k, v_s), dim=-1)
    ps = p.topk(min(top_k, v_t), dim=-1).values
    diff = F.pad(qs, (0, top_k - qs.shape[-1])) - F.pad(ps, (0, top_k - ps.shape[-1]))
    tail_diff = (q.sum(-1) - qs.sum(-1)) - (p.sum(-1) - ps.sum(-1))
    loss = diff.abs().sum(-1) + tail_diff.abs()
    a = q * tail_diff.sign()[:, None]  # every token outside the student's top-k is in its tail
    return loss, a.scatter_(-1, qi, diff[:, : qs.shape[-1]].sign() * qs)


def exact_and_a(
    log_q: torch.Tensor, log_p: torch.Tensor, vocab_map: VocabMap, beta: float, unmatched: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact-token term per row (see reference.exact_terms) and a = q dL/dq over the student vocabulary."""
    lq, lp = log_q[:, vocab_map.student_ids], log_p[:, vocab_map.teacher_ids]
    present = torch.ones_like(lq, dtype=torch.bool)
    terms, a_m = terms_and_a(lq, lp, beta, present)
    loss = terms.sum(-1)
    if unmatched == "bucket":
        q_m = lq.exp()
        raw_tail = 1 - q_m.sum(-1)
        log_tail_q = raw_tail.clamp(min=TAIL_FLOOR).log()
        log_tail_p = (1 - lp.exp().sum(-1)).clamp(min=TAIL_FLOOR).log()
        tail_term, tail_a = terms_and_a(log_tail_q, log_tail_p, beta, torch.ones_like(raw_tail, dtype=torch.bool))
        loss = loss + tail_term
        # dL/d tail_q; none where the tail sits at its floor (as clamp's own gradient); d tail_q / d q_m = -1
        r = torch.where(raw_tail > TAIL_FLOOR, tail_a / log_tail_q.exp(), torch.zeros_like(raw_tail))
        a_m = a_m - r[:, None] * q_m
    a = torch.zeros_like(log_q)
    a[:, vocab_map.student_ids] = a_m
    return loss, a


def group_loss_and_a(
    log_q: torch.Tensor,
    log_p: torch.Tensor,
    vocab_map: VocabMap | None,
    exact_ok: torch.Tensor,
    cfg: CrossTokenizerConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per group, a) for kind uld / exact / hybrid, as reference.group_losses defines them."""
    q, p = log_q.exp(), log_p.exp()
    if cfg.kind == "uld":
        return uld_and_a(q, p, cfg.uld_top_k)
    exact, a_exact = exact_and_a(log_q, log_p, vocab_map, cfg.beta, cfg.unmatched)
    ok = exact_ok[:, None]
    if cfg.kind == "exact":
        return torch.where(exact_ok, exact, 0.0), torch.where(ok, a_exact, 0.0)
    masked_q = q.clone()
    masked_q[:, vocab_map.student_ids] = torch.where(ok, 0.0, q[:, vocab_map.student_ids])
    masked_p = p.clone()
    masked_p[:, vocab_map.teacher_ids] = torch.where(ok, 0.0, p[:, vocab_map.teacher_ids])
    uld, a_uld = uld_and_a(masked_q, masked_p, cfg.uld_top_k)
    loss = torch.where(exact_ok, cfg.exact_weight * exact, 0.0) + cfg.uld_weight * uld
    return loss, torch.where(ok, cfg.exact_weight * a_exact, 0.0) + cfg.uld_weight * a_uld
