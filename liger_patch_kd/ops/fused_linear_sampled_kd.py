"""Fused linear distillation against sampled teacher tokens (reference.sampled_kd_per_row): the student against
an importance-weighted estimate of the teacher, without materialising its logits beyond one chunk.

A row's teacher data become slots: (id, estimated mass P^_j, log P_T(id)). A sampled id drawn c_j times out of m
stands for R c_j / m of the teacher (R = 1, or the rest mass outside the top-k in the hybrid); a hybrid top-k id
for its exact P_T. With a_j = -P^_j (divergence.estimated_forward_kl) the gradient is divergence.py's
    dL/du_v = a_v - S_v sum_j a_j = S_v sum_j P^_j - [v in slots] P^_v
(sum_j P^_j = 1 whenever the row has draws). Ids must be unique within a row's slots (counts aggregate repeats;
the hybrid's draws are outside its top-k). `sampled_chunk_torch` is the chunk, on every backend (see CHUNK_KERNELS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import KDLossConfig
from ..conventions import apply_softcap, topk_valid_slots
from .chunked import finish_chunk
from .divergence import estimated_forward_kl


def sampled_slots(
    sample_ids: torch.Tensor,
    sample_counts: torch.Tensor,
    sample_logprobs: torch.Tensor,
    topk_ids: torch.Tensor | None,
    topk_logprobs: torch.Tensor | None,
    acc_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, estimated mass, log-probs), each (N, J [+ K]): the slots of `sampled_chunk_torch`; padding slots have
    id -1 and mass 0. A row without draws keeps its top-k and drops the rest mass (its estimate has nothing for it)."""
    present = (sample_ids >= 0) & (sample_counts > 0)
    counts = torch.where(present, sample_counts, 0).to(acc_dtype)
    draws = counts.sum(-1, keepdim=True)
    rest = torch.ones_like(draws)
    ids, logprobs = [sample_ids], [sample_logprobs.to(acc_dtype)]
    masses = []
    if topk_ids is not None:
        valid = topk_valid_slots(topk_ids, topk_logprobs)
        p_top = torch.where(valid, topk_logprobs.to(acc_dtype), -torch.inf).exp()
        rest = (1 - p_top.sum(-1, keepdim=True)).clamp(min=0)
        ids.append(torch.where(valid, topk_ids, -1))
        logprobs.append(torch.where(valid, topk_logprobs.to(acc_dtype), 0.0))
    masses.append(counts * torch.where(draws > 0, rest / draws.clamp(min=1), 0.0))
    if topk_ids is not None:
        masses.append(p_top)
    ids = torch.cat([i.long() for i in ids], -1)
    mass = torch.cat(masses, -1)
    logprobs = torch.cat(logprobs, -1)
    keep = (ids >= 0) & (mass > 0)
    return torch.where(keep, ids, -1), torch.where(keep, mass, 0.0), torch.where(keep, logprobs, 0.0)


def sampled_chunk_torch(student_logits, teacher, labels, w_soft, w_hard, grad_dtype, cfg: KDLossConfig):
    """The per-chunk math: (soft rows, hard rows, weighted dLoss/dlogits or None); `teacher` = the chunk's slots."""
    ids, mass, log_p = teacher
    capped = apply_softcap(student_logits, cfg.softcap)
    log_s_full = F.log_softmax(capped / cfg.temperature, dim=-1)
    present = ids >= 0
    safe = torch.where(present, ids, 0)
    terms, a = estimated_forward_kl(log_s_full.gather(-1, safe), log_p.to(log_s_full.dtype), mass, present)

    def grad_u():
        grad = log_s_full.exp() * (-a.sum(-1, keepdim=True))
        return grad.scatter_add_(-1, safe, a)

    return finish_chunk(terms.sum(-1), grad_u, capped, labels, w_soft, w_hard, grad_dtype, cfg)


# One chunk function for both backends. A Triton kernel of this math (one program per row, two passes over the
# vocabulary and two over the slots) passed every test under the Triton interpreter but failed its first float64
# parity test compiled on an H200 (2026-12-01), so it is not shipped: on every device the loss runs the PyTorch
# chunk (16 bytes per logit, so the chunks are smaller than the top-k kernel's) until a kernel passes on a GPU.
CHUNK_KERNELS = {"torch": sampled_chunk_torch, "triton": sampled_chunk_torch}
