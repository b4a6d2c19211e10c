"""Fused linear distillation against sampled teacher tokens (reference.sampled_kd_per_row): the student against
an importance-weighted estimate of the teacher, without materialising its logits beyond one chunk.

A row's teacher data become slots: (id, estimated mass P^_j, log P_T(id)). A sampled id drawn c_j times out of m
stands for R c_j / m of the teacher (R = 1, or the rest mass outside the top-k in the hybrid); a hybrid top-k id
for its exact P_T. With a_j = -P^_j (divergence.estimated_forward_kl) the gradient is divergence.py's
    dL/du_v = a_v - S_v sum_j a_j = S_v sum_j P^_j - [v in slots] P^_v
(sum_j P^_j = 1 whenever the row has draws). Ids must be unique within a row's slots (counts aggregate repeats;
the hybrid's draws are outside its top-k). `sampled_chunk_torch` is the PyTorch chunk; `_sampled_chunk_kernel` the
same math in one Triton program per row (two passes over the vocabulary, two over the slots), with no (rows x V)
buffer besides the logits and the gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import KDLossConfig
from ..conventions import apply_softcap, topk_valid_slots
from .backend import triton_available
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


if triton_available():
    import triton
    import triton.language as tl

    from .fused_linear_topk_kd import slots_launch_config
    from .triton_utils import finish_grad, fp32_pair, row_label_and_ce, row_lse, scale_exact, softcap

    @triton.jit
    def _load_slot_tile(zs_row, ids_row, mass_row, lp_row, off, cs, S, V, cap_s, CAP_S: tl.constexpr):
        """One tile of a row's slots [off, off + BLOCK_S): (ids, estimated mass, log P_T, valid, the student's
        capped logit at each id). A slot is valid only with an id in [0, V): padding (-1) and, with
        check_inputs=False, an id past the vocabulary are dropped (mass 0), never read out of the row."""
        smask = off + cs < S
        ids = tl.load(ids_row + off + cs, mask=smask, other=-1).to(tl.int64)
        valid = smask & (ids >= 0) & (ids < V)
        acc_ty = zs_row.dtype.element_ty
        mass = tl.load(mass_row + off + cs, mask=valid, other=0.0).to(acc_ty)
        lp = tl.load(lp_row + off + cs, mask=valid, other=0.0).to(acc_ty)
        x = softcap(tl.load(zs_row + ids, mask=valid, other=0.0), cap_s, CAP_S)
        return ids, mass, lp, valid, x

    @triton.jit
    def _sampled_chunk_kernel(
        # pointers
        zs_ptr,  # (rows, V) student logits, fp32 (fp64 in tests)
        ids_ptr,  # (rows, S) slot ids, int64, -1 on padding
        mass_ptr,  # (rows, S) estimated teacher mass P^ of each slot (0 on padding)
        lp_ptr,  # (rows, S) the teacher's log P_T of each slot
        grad_ptr,  # (rows, V) dLoss/dlogits out, in the input dtype (unused without COMPUTE_GRAD)
        labels_ptr,  # (rows,) int64
        w_soft_ptr,  # (rows,) each row's weight of the KD term
        w_hard_ptr,  # (rows,) each row's weight of the CE term
        soft_ptr,  # (rows,) out: the KD term per row
        hard_ptr,  # (rows,) out: the CE term per row
        # strides and shapes
        stride_zs,
        stride_slots,  # the three slot arrays share one contiguous layout
        stride_g,
        V,
        S,
        # loss options: 1/T as two fp32 halves (triton_utils.fp32_pair), the soft-cap, the ignored label
        inv_temp_hi,
        inv_temp_lo,
        cap_s,
        ignore_index,
        # meta-parameters
        HAS_HARD: tl.constexpr,  # the CE term is wanted
        UNIT_TEMP: tl.constexpr,  # T == 1: the CE term's log-sum-exp is the KD one
        CAP_S: tl.constexpr,
        COMPUTE_GRAD: tl.constexpr,
        BLOCK_V: tl.constexpr,  # vocabulary tile
        BLOCK_S: tl.constexpr,  # slot tile
    ):
        """One program per row: the student's log-sum-exp over V, the loss sum_j P^_j (lp_j - log S_j) over the
        slots, then dL/du = S sum_j P^_j - P^ (`sampled_chunk_torch`'s gradient): a dense pass, then the slots."""
        row = tl.program_id(0).to(tl.int64)
        zs_row = zs_ptr + row * stride_zs
        ids_row = ids_ptr + row * stride_slots
        mass_row = mass_ptr + row * stride_slots
        lp_row = lp_ptr + row * stride_slots
        acc_ty = zs_ptr.dtype.element_ty
        cv = tl.arange(0, BLOCK_V)
        cs = tl.arange(0, BLOCK_S)
        # pass V1: the student's log-sum-exp at T (and at 1 for the CE term)
        lse_s, lse_1 = row_lse(zs_row, V, inv_temp_hi, inv_temp_lo, cap_s, CAP_S, HAS_HARD, UNIT_TEMP, BLOCK_V)

        # pass S1: the loss and the row's total estimated mass
        loss_vec = tl.zeros([BLOCK_S], acc_ty)
        mass_vec = tl.zeros([BLOCK_S], acc_ty)
        for off in range(0, S, BLOCK_S):
            ids, mass, lp, valid, x = _load_slot_tile(zs_row, ids_row, mass_row, lp_row, off, cs, S, V, cap_s, CAP_S)
            log_s = scale_exact(x, inv_temp_hi, inv_temp_lo, True) - lse_s
            loss_vec += tl.where(valid, mass * (lp - log_s), 0.0)
            mass_vec += mass
        tl.store(soft_ptr + row, tl.sum(loss_vec, axis=0))
        mass_sum = tl.sum(mass_vec, axis=0)

        label, valid_row = row_label_and_ce(zs_row, labels_ptr, hard_ptr, row, lse_1, ignore_index, V, cap_s, CAP_S,
                                            HAS_HARD)  # fmt: skip

        if COMPUTE_GRAD:
            w_soft = scale_exact(tl.load(w_soft_ptr + row).to(acc_ty), inv_temp_hi, inv_temp_lo, True)  # du/dx = 1/T
            w_hard = tl.load(w_hard_ptr + row)
            g_row = grad_ptr + row * stride_g
            # pass V2: the dense part, S sum(P^) (+ the CE gradient)
            for off in range(0, V, BLOCK_V):
                mask = off + cv < V
                x = softcap(tl.load(zs_row + off + cv, mask=mask, other=0.0), cap_s, CAP_S)
                grad = mass_sum * tl.exp(scale_exact(x, inv_temp_hi, inv_temp_lo, True) - lse_s) * w_soft
                grad = finish_grad(grad, x, off + cv, label, valid_row, w_hard, lse_1, cap_s, HAS_HARD, CAP_S)
                tl.store(g_row + off + cv, grad.to(grad_ptr.dtype.element_ty), mask=mask)
            tl.debug_barrier()  # the slot pass overwrites values other warps wrote above
            # pass S2: the complete gradient at the slots' ids (unique within a row: one store each)
            for off in range(0, S, BLOCK_S):
                ids, mass, lp, valid, x = _load_slot_tile(
                    zs_row, ids_row, mass_row, lp_row, off, cs, S, V, cap_s, CAP_S
                )
                s_v = tl.exp(scale_exact(x, inv_temp_hi, inv_temp_lo, True) - lse_s)
                grad = finish_grad((mass_sum * s_v - mass) * w_soft, x, ids, label, valid_row, w_hard, lse_1, cap_s,
                                   HAS_HARD, CAP_S)  # fmt: skip
                tl.store(g_row + ids, grad.to(grad_ptr.dtype.element_ty), mask=valid)


def sampled_chunk_triton(student_logits, teacher, labels, w_soft, w_hard, grad_dtype, cfg: KDLossConfig):
    """Launch `_sampled_chunk_kernel`; same contract as `sampled_chunk_torch`."""
    ids, mass, log_p = (t.contiguous() for t in teacher)
    rows, vocab = student_logits.shape
    soft = torch.empty(rows, dtype=student_logits.dtype, device=student_logits.device)
    hard = torch.zeros_like(soft)
    grad = torch.empty((rows, vocab), dtype=grad_dtype, device=soft.device) if grad_dtype else soft
    block_v, block_s, num_warps = slots_launch_config(vocab, ids.shape[1])
    _sampled_chunk_kernel[(rows,)](
        # pointers
        student_logits, ids, mass, log_p, grad, labels, w_soft, w_hard, soft, hard,
        # strides and shapes
        student_logits.stride(0), ids.stride(0), grad.stride(0) if grad_dtype else 0, vocab, ids.shape[1],
        # loss options
        *fp32_pair(1.0 / cfg.temperature), float(cfg.softcap or 1.0), cfg.ignore_index,
        # meta-parameters
        HAS_HARD=bool(cfg.hard_weight), UNIT_TEMP=cfg.temperature == 1.0, CAP_S=cfg.softcap is not None,
        COMPUTE_GRAD=grad_dtype is not None, BLOCK_V=block_v, BLOCK_S=block_s, num_warps=num_warps,
    )  # fmt: skip
    return soft, hard, grad if grad_dtype else None


CHUNK_KERNELS = {"torch": sampled_chunk_torch, "triton": sampled_chunk_triton}
