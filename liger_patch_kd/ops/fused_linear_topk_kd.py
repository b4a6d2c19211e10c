"""Fused linear top-k distillation: the student against precomputed teacher log-probs (top-k or full vocab),
without materialising the student's logits beyond one chunk.

Per row the student is normalised over its full vocabulary (one pass), compared with the teacher on the
teacher's K ids, and its gradient written in a second pass. The terms and a_j = dL/dS_j * S_j per class are
divergence.py's (`terms_and_a`); the gradient is its dL/du = a - S * sum(a) with the tail bucket chained in.
With S_j the student's probability of id j and r = dL/dS_tail for the tail bucket:
    dL/du_v = [v in ids] (a_v - r S_v) - c S_v,   c = sum_j a_j - r sum_j S_j
(the tail's mass is 1 - sum_j S_j, hence the -r S terms). Renormalised top-k has no dense term:
    dL/du_v = [v in ids] (a'_v - S'_v sum_j a'_j).
    a_j:  forward KL -P_j;  reverse KL S_j (log S_j - log P_j + 1);  JSD (1 - beta) S_j (log S_j - log M_j)
Teacher ids must be unique within a row (as top-k ids are).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import KDLossConfig
from ..conventions import LOGPROB_PLACEHOLDER, TAIL_FLOOR, apply_softcap, tempered_topk_teacher
from .backend import triton_available
from .chunked import finish_chunk
from .divergence import softmax_grad, terms_and_a

TAILS = {"bucket": 0, "renormalize": 1, "none": 2}


def _mode(beta: float) -> int:
    return 0 if beta == 0 else 1 if beta == 1 else 2


# --------------------------------------------------------------------------------------------- PyTorch chunk
def topk_chunk_torch(student_logits, teacher, labels, w_soft, w_hard, grad_dtype, cfg: KDLossConfig, grad_out=None):
    """The per-chunk math in PyTorch: (soft rows, hard rows, weighted dLoss/dlogits or None; into `grad_out` when
    given)."""
    ids, logprobs = teacher
    vocab, beta, inv_t = student_logits.shape[-1], cfg.beta, 1.0 / cfg.temperature
    capped = apply_softcap(student_logits, cfg.softcap)
    log_s_full = F.log_softmax(capped * inv_t, dim=-1)
    valid, log_p, log_p_tail = tempered_topk_teacher(ids, logprobs, vocab, cfg.temperature)
    log_p = log_p.to(log_s_full.dtype)
    safe = torch.where(valid, ids, torch.zeros_like(ids)).long()
    log_s = torch.where(valid, log_s_full.gather(-1, safe), -math.inf)
    s = log_s.exp()
    dense_c = torch.zeros_like(s[:, 0])
    if cfg.tail == "renormalize":
        log_s_r = torch.where(valid, log_s - torch.logsumexp(log_s, -1, keepdim=True), -math.inf)
        log_p_r = torch.where(valid, log_p - torch.logsumexp(log_p, -1, keepdim=True), -math.inf)
        terms, a = terms_and_a(log_s_r, log_p_r, beta, valid)
        soft = terms.sum(-1)
        sparse = softmax_grad(a, log_s_r.exp())  # the renormalised S' is a softmax over the valid ids
    else:
        terms, a = terms_and_a(log_s, log_p, beta, valid)
        soft = terms.sum(-1)
        r = torch.zeros_like(soft)
        if cfg.tail == "bucket":
            raw_tail = 1 - s.sum(-1)
            log_s_tail = raw_tail.clamp(min=TAIL_FLOOR).log()
            has_tail = torch.isfinite(log_p_tail)
            log_p_tail = log_p_tail.to(soft.dtype)
            tail_term, tail_a = terms_and_a(log_s_tail, log_p_tail, beta, has_tail)
            soft = soft + tail_term
            # dL/dS_tail; no gradient where the tail is at its floor (as clamp's own gradient)
            r = torch.where(has_tail & (raw_tail > TAIL_FLOOR), tail_a / log_s_tail.exp(), 0.0)
        sparse = a - r[:, None] * s
        dense_c = a.sum(-1) - r * s.sum(-1)

    def grad_u():
        grad = -dense_c[:, None] * log_s_full.exp()
        return grad.scatter_add_(-1, safe, torch.where(valid, sparse, 0.0))

    return finish_chunk(soft, grad_u, capped, labels, w_soft, w_hard, grad_dtype, cfg, grad_out)


# ---------------------------------------------------------------------------------------------- Triton chunk
if triton_available():
    import triton
    import triton.language as tl

    from .triton_utils import finish_grad, lse_finish, online_lse_update, row_label_and_ce, row_lse, softcap

    @triton.jit
    def _load_slots(zs_row, ids_row, lp_row, off, ck, K, placeholder, cap_s, CAP_S: tl.constexpr):
        """One tile of a row's teacher slots [off, off + BLOCK_K): (ids, log-probs, valid, the student's capped
        logit at each id). Padding slots (past K, negative id, log-prob at or below the placeholder) are not
        valid; their log-prob lanes hold 0 so they compute on finite values (no -inf - -inf), then are dropped."""
        kmask = off + ck < K
        ids = tl.load(ids_row + off + ck, mask=kmask, other=-1).to(tl.int64)
        lp = tl.load(lp_row + off + ck, mask=kmask, other=float("-inf")).to(zs_row.dtype.element_ty)
        valid = kmask & (ids >= 0) & (lp > placeholder)
        lp = tl.where(valid, lp, 0.0)
        x = softcap(tl.load(zs_row + ids, mask=valid, other=0.0), cap_s, CAP_S)
        return ids, lp, valid, x

    @triton.jit
    def _class_term_and_a(log_s, log_p, beta, log_beta, log_1m_beta, MODE: tl.constexpr):
        """divergence.terms_and_a for one tile of classes: (term, a = S dL/dS), same formulas (ops/divergence.py);
        log M by a stable log-add-exp of the two log-probabilities."""
        s = tl.exp(log_s)
        if MODE == 0:
            p = tl.exp(log_p)
            term = p * (log_p - log_s)
            a = -p
        elif MODE == 1:
            term = s * (log_s - log_p)
            a = s * (log_s - log_p + 1.0)
        else:
            x = log_p + log_beta
            y = log_s + log_1m_beta
            log_m = tl.maximum(x, y) + tl.log(1.0 + tl.exp(-tl.abs(x - y)))
            term = beta * tl.exp(log_p) * (log_p - log_m) + (1.0 - beta) * s * (log_s - log_m)
            a = (1.0 - beta) * s * (log_s - log_m)
        return term, a

    @triton.jit
    def _topk_chunk_kernel(
        # pointers
        zs_ptr,  # (rows, V) student logits, fp32 (fp64 in tests)
        ids_ptr,  # (rows, K) teacher ids, negative on padding slots
        lp_ptr,  # (rows, K) teacher log-probs at T = 1
        grad_ptr,  # (rows, V) dLoss/dlogits out, in the input dtype (unused without COMPUTE_GRAD)
        labels_ptr,  # (rows,) int64
        w_soft_ptr,  # (rows,) each row's weight of the KD term
        w_hard_ptr,  # (rows,) each row's weight of the CE term
        soft_ptr,  # (rows,) out: the KD term per row
        hard_ptr,  # (rows,) out: the CE term per row
        # strides and shapes
        stride_zs,
        stride_ids,
        stride_lp,
        stride_g,
        V,
        K,
        # loss options and conventions
        inv_temp,
        beta,
        cap_s,  # the student's soft-cap (read when CAP_S)
        ignore_index,
        placeholder,  # conventions.LOGPROB_PLACEHOLDER: a log-prob at or below it is a padding slot
        tail_floor,  # conventions.TAIL_FLOOR
        # meta-parameters
        MODE: tl.constexpr,  # 0 forward KL, 1 reverse KL, 2 generalized JSD
        TAIL: tl.constexpr,  # TAILS: 0 bucket, 1 renormalize, 2 none
        HAS_HARD: tl.constexpr,  # the CE term is wanted
        UNIT_TEMP: tl.constexpr,  # T == 1: the CE term's log-sum-exp is the KD one
        CAP_S: tl.constexpr,
        COMPUTE_GRAD: tl.constexpr,
        BLOCK_V: tl.constexpr,  # vocabulary tile
        BLOCK_K: tl.constexpr,  # teacher-slot tile
    ):
        """One program per row: student log-sum-exp over V; three short passes over the K teacher slots
        (normalisers, loss and the dense coefficient, then the sparse gradient); one dense gradient pass.
        The gradient is divergence.py's dL/du = a - S * sum(a) with the tail bucket chained in, as in
        `topk_chunk_torch`."""
        row = tl.program_id(0).to(tl.int64)
        zs_row = zs_ptr + row * stride_zs
        ids_row = ids_ptr + row * stride_ids
        lp_row = lp_ptr + row * stride_lp
        acc_ty = zs_ptr.dtype.element_ty
        cv = tl.arange(0, BLOCK_V)
        ck = tl.arange(0, BLOCK_K)

        # pass V1: student log-sum-exp at T (and at 1 for the CE term); 1/T is one fp32 scalar here (no low half)
        lse_s, lse_1 = row_lse(zs_row, V, inv_temp, 0.0, cap_s, CAP_S, HAS_HARD, UNIT_TEMP, BLOCK_V)

        # pass K1: teacher normalisers, student mass on the ids (and its own normaliser for "renormalize")
        neg_k = tl.full([BLOCK_K], float("-inf"), acc_ty)
        zero_k = tl.zeros([BLOCK_K], acc_ty)
        m_p, d_p, m_q, d_q = neg_k, zero_k, neg_k, zero_k
        n_valid = tl.zeros([BLOCK_K], tl.int32)
        mass_vec = zero_k
        s_sum_vec = zero_k
        for off in range(0, K, BLOCK_K):
            ids, lp, valid, x = _load_slots(zs_row, ids_row, lp_row, off, ck, K, placeholder, cap_s, CAP_S)
            u = x * inv_temp
            n_valid += valid.to(tl.int32)
            mass_vec += tl.where(valid, tl.exp(lp), 0.0)
            s_sum_vec += tl.where(valid, tl.exp(u - lse_s), 0.0)
            m_p, d_p = online_lse_update(m_p, d_p, tl.where(valid, lp * inv_temp, float("-inf")))
            m_q, d_q = online_lse_update(m_q, d_q, tl.where(valid, u, float("-inf")))
        lse_pk = lse_finish(m_p, d_p)  # -inf when no slot is valid
        lse_qk = lse_finish(m_q, d_q)
        s_sum = tl.sum(s_sum_vec, axis=0)
        n_tail = V - tl.sum(n_valid, axis=0)
        has_tail = n_tail > 0
        tail_mass = tl.maximum(1.0 - tl.sum(mass_vec, axis=0), tail_floor)
        log_n = tl.log(tl.maximum(n_tail, 1).to(acc_ty))
        log_tail_t = tl.where(has_tail, log_n + (tl.log(tail_mass) - log_n) * inv_temp, float("-inf"))
        big = tl.maximum(lse_pk, log_tail_t)
        log_z = big + tl.log(tl.exp(lse_pk - big) + tl.exp(log_tail_t - big))
        if TAIL == 1:  # renormalize: both sides over the valid slots only
            log_z = lse_pk
        # a row without valid slots has log_z (renormalize) and lse_qk at -inf; its lanes are all dropped, so any
        # finite stand-in keeps them free of inf - inf
        log_z = tl.where(log_z == float("-inf"), 0.0, log_z)
        lse_qk = tl.where(lse_qk == float("-inf"), 0.0, lse_qk)

        log_beta = 0.0
        log_1m_beta = 0.0
        if MODE == 2:
            log_beta = tl.log(beta)
            log_1m_beta = tl.log(1.0 - beta)

        # pass K2: the loss and the sum of a over the slots
        loss_vec = zero_k
        a_vec = zero_k
        for off in range(0, K, BLOCK_K):
            ids, lp, valid, x = _load_slots(zs_row, ids_row, lp_row, off, ck, K, placeholder, cap_s, CAP_S)
            u = x * inv_temp
            log_s = u - (lse_qk if TAIL == 1 else lse_s)
            log_p = lp * inv_temp - log_z
            term, a = _class_term_and_a(log_s, log_p, beta, log_beta, log_1m_beta, MODE)
            loss_vec += tl.where(valid, term, 0.0)
            a_vec += tl.where(valid, a, 0.0)
        row_loss = tl.sum(loss_vec, axis=0)
        a_sum = tl.sum(a_vec, axis=0)
        r = 0.0
        dense_c = 0.0
        if TAIL == 0:
            raw_tail = 1.0 - s_sum
            log_s_tail = tl.log(tl.maximum(raw_tail, tail_floor))
            log_p_tail = tl.where(has_tail, log_tail_t, log_z) - log_z  # no tail: a dropped, finite stand-in
            t_term, t_a = _class_term_and_a(log_s_tail, log_p_tail, beta, log_beta, log_1m_beta, MODE)
            row_loss += tl.where(has_tail, t_term, 0.0)
            r = tl.where(has_tail & (raw_tail > tail_floor), t_a / tl.exp(log_s_tail), 0.0)
        if TAIL != 1:
            dense_c = a_sum - r * s_sum
        tl.store(soft_ptr + row, row_loss)

        label, valid_row = row_label_and_ce(zs_row, labels_ptr, hard_ptr, row, lse_1, ignore_index, V, cap_s, CAP_S,
                                            HAS_HARD)  # fmt: skip

        if COMPUTE_GRAD:
            w_soft = tl.load(w_soft_ptr + row) * inv_temp
            w_hard = tl.load(w_hard_ptr + row)
            g_row = grad_ptr + row * stride_g
            # pass V2: the dense part, -c S_v (+ the CE gradient)
            for off in range(0, V, BLOCK_V):
                mask = off + cv < V
                x = softcap(tl.load(zs_row + off + cv, mask=mask, other=0.0), cap_s, CAP_S)
                grad = -dense_c * tl.exp(x * inv_temp - lse_s) * w_soft
                grad = finish_grad(grad, x, off + cv, label, valid_row, w_hard, lse_1, cap_s, HAS_HARD, CAP_S)
                tl.store(g_row + off + cv, grad.to(grad_ptr.dtype.element_ty), mask=mask)
            tl.debug_barrier()  # the sparse pass overwrites values other warps wrote above
            # pass K3: the complete gradient at the teacher's ids
            for off in range(0, K, BLOCK_K):
                ids, lp, valid, x = _load_slots(zs_row, ids_row, lp_row, off, ck, K, placeholder, cap_s, CAP_S)
                u = x * inv_temp
                log_s = u - (lse_qk if TAIL == 1 else lse_s)
                log_p = lp * inv_temp - log_z
                _, a = _class_term_and_a(log_s, log_p, beta, log_beta, log_1m_beta, MODE)
                s_full = tl.exp(u - lse_s)
                if TAIL == 1:
                    sparse = a - tl.exp(log_s) * a_sum
                else:
                    sparse = a - r * s_full - dense_c * s_full
                grad = finish_grad(sparse * w_soft, x, ids, label, valid_row, w_hard, lse_1, cap_s, HAS_HARD, CAP_S)
                tl.store(g_row + ids, grad.to(grad_ptr.dtype.element_ty), mask=valid)


def slots_launch_config(vocab: int, slots: int) -> tuple[int, int, int]:
    """(BLOCK_V, BLOCK_S, num_warps) of the kernels that score a few slots per row (top-k ids, sampled ids): vocab
    tiles as in the JSD kernel; every slot in one tile, up to 1024 (a power of two, at least 16)."""
    return min(4096, 1 << (vocab - 1).bit_length()), min(1024, 1 << (max(slots, 16) - 1).bit_length()), 8


def topk_chunk_triton(student_logits, teacher, labels, w_soft, w_hard, grad_dtype, cfg: KDLossConfig, grad_out=None):
    """Launch `_topk_chunk_kernel`; same contract as `topk_chunk_torch`."""
    ids, logprobs = teacher
    rows, vocab = student_logits.shape
    soft = torch.empty(rows, dtype=student_logits.dtype, device=student_logits.device)
    hard = torch.zeros_like(soft)
    grad = soft
    if grad_dtype:
        grad = grad_out if grad_out is not None else torch.empty((rows, vocab), dtype=grad_dtype, device=soft.device)
    block_v, block_k, num_warps = slots_launch_config(vocab, ids.shape[1])
    _topk_chunk_kernel[(rows,)](
        # pointers
        student_logits, ids, logprobs, grad, labels, w_soft, w_hard, soft, hard,
        # strides and shapes
        student_logits.stride(0), ids.stride(0), logprobs.stride(0), grad.stride(0) if grad_dtype else 0,
        vocab, ids.shape[1],
        # loss options and conventions
        1.0 / cfg.temperature, float(cfg.beta), float(cfg.softcap or 1.0), cfg.ignore_index,
        LOGPROB_PLACEHOLDER, TAIL_FLOOR,
        # meta-parameters
        MODE=_mode(cfg.beta), TAIL=TAILS[cfg.tail], HAS_HARD=bool(cfg.hard_weight), UNIT_TEMP=cfg.temperature == 1.0,
        CAP_S=cfg.softcap is not None, COMPUTE_GRAD=grad_dtype is not None, BLOCK_V=block_v, BLOCK_K=block_k,
        num_warps=num_warps,
    )  # fmt: skip
    return soft, hard, grad if grad_dtype else None


CHUNK_KERNELS = {"torch": topk_chunk_torch, "triton": topk_chunk_triton}
