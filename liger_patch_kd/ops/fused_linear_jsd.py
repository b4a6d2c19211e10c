"""Fused linear generalized JSD: the online-teacher distillation loss without materialised logits.

Per row chunk (see `chunked.py`) the student and teacher logits come from two fp32-output products; then a Triton
kernel or `jsd_chunk_torch` (PyTorch, same math) reads both logit rows, computes both log-sum-exps, the loss and
dLoss/dlogits, and writes the gradient in the input dtype for the backward products. Two Triton walks
(`JSDLaunch`): `_jsd_segment_kernel` splits a row over programs that hold it in registers, read once (large
vocabularies, the default there); `_jsd_chunk_kernel` streams it, one program a row, three passes.

Gradient of the tempered student logits u = cap(z) / T, with S = softmax(u), P = softmax(cap(z_t) / T): the
divergence.py form dL/du = a - S * sum(a), which here reads
    beta == 0 (KL(P||S)):  dL/du = S - P                                  (a = -P, sum(a) = -1)
    beta == 1 (KL(S||P)):  dL/du = S * (log S - log P - L)                (sum(a) = L + 1)
    otherwise:             dL/du = (1 - beta) * S * (g - sum(S * g)),  g = log S - log M
and dL/dz = dL/du / T * cap'(z), cap'(z) = 1 - (cap(z) / c)^2. The hard term adds softmax(cap(z)) - onehot.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import KDLossConfig
from ..conventions import apply_softcap
from .backend import triton_available
from .chunked import finish_chunk
from .divergence import dense_divergence

MODE_FORWARD_KL, MODE_REVERSE_KL, MODE_JSD = 0, 1, 2


def _mode(beta: float) -> int:
    return MODE_FORWARD_KL if beta == 0 else MODE_REVERSE_KL if beta == 1 else MODE_JSD


# --------------------------------------------------------------------------------------------- PyTorch chunk
def jsd_chunk_torch(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    w_soft: torch.Tensor,
    w_hard: torch.Tensor,
    grad_dtype: torch.dtype | None,
    cfg: KDLossConfig,
    grad_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The per-chunk math in PyTorch: (soft rows, hard rows, weighted dLoss/dlogits or None; into `grad_out` when
    given)."""
    inv_t = 1.0 / cfg.temperature
    teacher_logits = teacher_logits.to(student_logits.dtype)  # bf16 teacher logits (FP8 products) in fp32 math
    capped = apply_softcap(student_logits, cfg.softcap)
    log_s = F.log_softmax(capped * inv_t, dim=-1)
    log_p = F.log_softmax(apply_softcap(teacher_logits, cfg.teacher_softcap) * inv_t, dim=-1)
    soft, grad_u = dense_divergence(log_s, log_p, cfg.beta)
    return finish_chunk(soft, grad_u, capped, labels, w_soft, w_hard, grad_dtype, cfg, grad_out)


# ---------------------------------------------------------------------------------------------- Triton chunk
if triton_available():
    import triton
    import triton.language as tl

    from .triton_utils import fp32_pair, lse_finish, online_lse_update, scale_exact, softcap

    @triton.jit
    def _log_mixture(s, p, b_hi, b_lo, omb_hi, omb_lo, PAIR: tl.constexpr):
        """log M = log(beta * P + (1 - beta) * S) from the two probabilities the passes already hold: one
        transcendental where a log-sum-exp of the two log-probabilities takes two. The JSD passes are not purely
        memory-bound (they stream slower than a copy does), so one transcendental fewer shows in the kernel's time
        (benchmarks/loss/bench_loss_breakdown.py). With both probabilities under fp32's smallest normal
        (their terms < 1e-36) the floor keeps log M finite."""
        mix = scale_exact(p, b_hi, b_lo, PAIR) + scale_exact(s, omb_hi, omb_lo, PAIR)
        return tl.log(tl.maximum(mix, 1.1754944e-38))

    @triton.jit
    def _jsd_chunk_kernel(
        # pointers
        zs_ptr,  # (rows, V) student logits, fp32 (fp64 in tests)
        zt_ptr,  # (rows, V) teacher logits, fp32 or bf16 (FP8 products on CUDA); the gradient may overwrite them
        grad_ptr,  # (rows, V) dLoss/dlogits out, in the input dtype (unused without COMPUTE_GRAD)
        labels_ptr,  # (rows,) int64
        w_soft_ptr,  # (rows,) each row's weight of the KD term
        w_hard_ptr,  # (rows,) each row's weight of the CE term
        soft_ptr,  # (rows,) out: the KD term per row
        hard_ptr,  # (rows,) out: the CE term per row
        # strides and shapes
        stride_zs,
        stride_zt,
        stride_g,
        V,
        # loss options: 1/T, beta and 1 - beta as fp32 pairs (triton_utils.fp32_pair; only float64 rows read the
        # low halves, PAIR), so a compiled float64 kernel matches a float64 reference
        inv_hi,
        inv_lo,
        b_hi,
        b_lo,
        omb_hi,
        omb_lo,
        cap_s,  # the student's soft-cap (read when CAP_S)
        cap_t,  # the teacher's soft-cap (read when CAP_T)
        ignore_index,
        # meta-parameters
        MODE: tl.constexpr,  # 0 forward KL, 1 reverse KL, 2 generalized JSD
        HAS_HARD: tl.constexpr,  # the CE term is wanted
        UNIT_TEMP: tl.constexpr,  # T == 1: the CE term's log-sum-exp is the KD one
        CAP_S: tl.constexpr,
        CAP_T: tl.constexpr,
        COMPUTE_GRAD: tl.constexpr,
        PAIR: tl.constexpr,  # float64 rows: the options' low halves count
        BLOCK: tl.constexpr,  # vocabulary tile
        REVERSE_MIDDLE: tl.constexpr,  # pass 2 walks the row right to left (see JSDLaunch)
        KEEP: tl.constexpr,  # eviction hint of the loads passes 1 and 2 read again ("" or "evict_last")
        DROP: tl.constexpr,  # eviction hint of pass 3's loads, the row's last read ("" or "evict_first")
    ):
        """One program per row. Pass 1: both log-sum-exps (and the T=1 one for CE). Pass 2 (reverse KL and
        JSD only): the loss and sum(S * g) the gradient needs. Pass 3: gradient (and the forward-KL loss).
        The terms and the gradient are ops/divergence.py's (`dense_divergence`), in the same structure:
        dL/du = a - S * sum(a), written out per mode as in divergence.py."""
        row = tl.program_id(0).to(tl.int64)
        zs_row = zs_ptr + row * stride_zs
        zt_row = zt_ptr + row * stride_zt
        acc_ty = zs_ptr.dtype.element_ty
        cols = tl.arange(0, BLOCK)
        neg_inf = tl.full([BLOCK], float("-inf"), acc_ty)
        zero = tl.zeros([BLOCK], acc_ty)

        m_s, d_s, m_t, d_t, m_1, d_1 = neg_inf, zero, neg_inf, zero, neg_inf, zero
        for off in range(0, V, BLOCK):
            mask = off + cols < V
            xs = softcap(tl.load(zs_row + off + cols, mask=mask, other=0.0, eviction_policy=KEEP), cap_s, CAP_S)
            xt = tl.load(zt_row + off + cols, mask=mask, other=0.0, eviction_policy=KEEP)
            xt = softcap(xt.to(acc_ty), cap_t, CAP_T)
            m_s, d_s = online_lse_update(m_s, d_s, tl.where(mask, scale_exact(xs, inv_hi, inv_lo, PAIR), float("-inf")))
            m_t, d_t = online_lse_update(m_t, d_t, tl.where(mask, scale_exact(xt, inv_hi, inv_lo, PAIR), float("-inf")))
            if HAS_HARD and not UNIT_TEMP:
                m_1, d_1 = online_lse_update(m_1, d_1, tl.where(mask, xs, float("-inf")))
        lse_s = lse_finish(m_s, d_s)
        lse_t = lse_finish(m_t, d_t)

        label = tl.load(labels_ptr + row).to(tl.int64)
        # a label outside [0, V) (only reachable with check_inputs=False) counts as ignored: never read out of row
        valid = (label != ignore_index) & (label >= 0) & (label < V)
        w_soft = tl.load(w_soft_ptr + row)
        w_hard = tl.load(w_hard_ptr + row)
        if HAS_HARD:
            lse_1 = lse_s if UNIT_TEMP else lse_finish(m_1, d_1)
            safe_label = tl.where(valid, label, 0)
            x_label = softcap(tl.load(zs_row + safe_label), cap_s, CAP_S)
            tl.store(hard_ptr + row, tl.where(valid, lse_1 - x_label, 0.0))

        loss = tl.zeros([BLOCK], acc_ty)
        sum_sg = tl.zeros([BLOCK], acc_ty)
        if MODE != 0:
            n_tiles = tl.cdiv(V, BLOCK)
            for i in range(0, n_tiles):
                off = (n_tiles - 1 - i) * BLOCK if REVERSE_MIDDLE else i * BLOCK
                mask = off + cols < V
                xs = softcap(tl.load(zs_row + off + cols, mask=mask, other=0.0, eviction_policy=KEEP), cap_s, CAP_S)
                log_s = scale_exact(xs, inv_hi, inv_lo, PAIR) - lse_s
                zt = tl.load(zt_row + off + cols, mask=mask, other=0.0, eviction_policy=KEEP).to(acc_ty)
                log_p = scale_exact(softcap(zt, cap_t, CAP_T), inv_hi, inv_lo, PAIR) - lse_t
                s = tl.exp(log_s)
                if MODE == 1:
                    term = s * (log_s - log_p)
                    sum_sg += tl.where(mask, term, 0.0)
                    loss += tl.where(mask, term, 0.0)
                else:
                    p = tl.exp(log_p)
                    log_m = _log_mixture(s, p, b_hi, b_lo, omb_hi, omb_lo, PAIR)
                    sg = s * (log_s - log_m)
                    term = scale_exact(p * (log_p - log_m), b_hi, b_lo, PAIR) + scale_exact(sg, omb_hi, omb_lo, PAIR)
                    sum_sg += tl.where(mask, sg, 0.0)
                    loss += tl.where(mask, term, 0.0)
        row_loss = tl.sum(loss, axis=0)
        row_sg = tl.sum(sum_sg, axis=0)

        if COMPUTE_GRAD or MODE == 0:
            g_row = grad_ptr + row * stride_g
            soft_scale = scale_exact(w_soft, inv_hi, inv_lo, PAIR)
            for off in range(0, V, BLOCK):
                mask = off + cols < V
                xs = softcap(tl.load(zs_row + off + cols, mask=mask, other=0.0, eviction_policy=DROP), cap_s, CAP_S)
                log_s = scale_exact(xs, inv_hi, inv_lo, PAIR) - lse_s
                zt = tl.load(zt_row + off + cols, mask=mask, other=0.0, eviction_policy=DROP).to(acc_ty)
                log_p = scale_exact(softcap(zt, cap_t, CAP_T), inv_hi, inv_lo, PAIR) - lse_t
                s = tl.exp(log_s)
                if MODE == 0:
                    p = tl.exp(log_p)
                    loss += tl.where(mask, p * (log_p - log_s), 0.0)
                    grad = s - p
                elif MODE == 1:
                    grad = s * (log_s - log_p - row_loss)
                else:
                    log_m = _log_mixture(s, tl.exp(log_p), b_hi, b_lo, omb_hi, omb_lo, PAIR)
                    grad = scale_exact(s * (log_s - log_m - row_sg), omb_hi, omb_lo, PAIR)
                if COMPUTE_GRAD:
                    grad = grad * soft_scale
                    if HAS_HARD:
                        q = tl.exp(xs - lse_1)
                        grad += w_hard * (q - tl.where((off + cols == label) & valid, 1.0, 0.0))
                    if CAP_S:
                        grad = grad * (1.0 - (xs / cap_s) * (xs / cap_s))
                    # the gradient may overwrite this row's teacher logits (_grad_view_of): every warp must have
                    # read this tile before any warp writes (writes only reach tiles already read)
                    tl.debug_barrier()
                    tl.store(g_row + off + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)
            if MODE == 0:
                row_loss = tl.sum(loss, axis=0)
        tl.store(soft_ptr + row, row_loss)


    @triton.jit
    def _arrive_and_wait(count_ptr, target):
        """A barrier for the programs of one row: this program's stores before it are seen by every program that
        passes it. Every program of the row must be resident at once (the launcher's persistent grid)."""
        tl.debug_barrier()  # every thread's stores of this program precede the release
        tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _combined_lse(part_row, slot, SEGMENTS: tl.constexpr, SEGMENTS_P2: tl.constexpr, acc_ty: tl.constexpr):
        """The row's log-sum-exp from the segments' (max, sum of exp(x - max)) at slots `slot`, `slot + 1`, read in
        segment order by every program of the row: each computes the very same value."""
        k = tl.arange(0, SEGMENTS_P2)
        mask = k < SEGMENTS
        m_k = tl.load(part_row + k * 8 + slot, mask=mask, other=float("-inf"), cache_modifier=".cg")
        d_k = tl.load(part_row + k * 8 + slot + 1, mask=mask, other=0.0, cache_modifier=".cg")
        return lse_finish(m_k.to(acc_ty), d_k.to(acc_ty))

    @triton.jit
    def _segment_lse_state(x):
        """(max, sum of exp(x - max)) of one segment held in registers: one exponential a value, where the
        streaming walk's online update takes two."""
        m = tl.max(x, axis=0)
        safe = tl.where(m == float("-inf"), 0.0, m)
        return m, tl.sum(tl.exp(x - safe), axis=0)

    @triton.jit
    def _jsd_segment_kernel(
        # pointers
        zs_ptr,  # (rows, V) student logits, fp32 (fp64 in tests)
        zt_ptr,  # (rows, V) teacher logits, fp32 or bf16; with PHASE 0 the gradient may overwrite them
        grad_ptr,  # (rows, V) dLoss/dlogits out, in the input dtype (unused without COMPUTE_GRAD)
        labels_ptr,  # (rows,) int64
        w_soft_ptr,  # (rows,) each row's weight of the KD term
        w_hard_ptr,  # (rows,) each row's weight of the CE term
        part_ptr,  # (rows, SEGMENTS, 8) per segment: max and sum for S, P, and S at T = 1; KD term; sum(S * g)
        hard_ptr,  # (rows,) out: the CE term per row
        count_ptr,  # (rows,) int32 zeros: arrivals at the row's barriers (PHASE 0)
        # strides and shapes
        stride_zs,
        stride_zt,
        stride_g,
        rows,
        V,
        seg_len,  # columns per segment (the last one may hold fewer)
        # loss options, as _jsd_chunk_kernel's
        inv_hi,
        inv_lo,
        b_hi,
        b_lo,
        omb_hi,
        omb_lo,
        cap_s,
        cap_t,
        ignore_index,
        # meta-parameters
        MODE: tl.constexpr,
        HAS_HARD: tl.constexpr,
        UNIT_TEMP: tl.constexpr,
        CAP_S: tl.constexpr,
        CAP_T: tl.constexpr,
        COMPUTE_GRAD: tl.constexpr,
        PAIR: tl.constexpr,
        SEGMENTS: tl.constexpr,  # programs a row is split over
        SEGMENTS_P2: tl.constexpr,  # the next power of two (a Triton vector of the partials)
        SEG: tl.constexpr,  # seg_len rounded up to a power of two: one segment is one register tile
        PHASE: tl.constexpr,  # 0: the three phases in one launch, met at per-row barriers; 1, 2, 3: that phase
    ):
        """The JSD chunk with each row split over SEGMENTS programs that each hold their segment of both logit rows
        in registers: read from memory once (10 bytes a logit with the bf16 gradient, against the streaming
        walk's 26). Phase 1: each segment's (max, sum) for S, P (and S at T = 1); phase 2: both log-sum-exps from
        all segments, then the segment's share of the KD term and of sum(S * g); phase 3: the sums, then the
        gradient. With PHASE 0 one persistent launch runs all three, the row's programs meeting at a barrier after
        phases 1 and 2 (after the first, every program of the row has read its inputs, so the gradient may go
        anywhere in the row's teacher bytes); with PHASE 1, 2, 3 each phase is a launch of its own, which reloads
        the segment: the same arithmetic in the same order, for the Triton interpreter (which runs programs one
        after another, so a barrier would never open) and GPUs where the programs cannot all be resident. The
        math is `_jsd_chunk_kernel`'s (divergence.py's terms); the KD term is left per segment in part[..., 6]."""
        acc_ty = zs_ptr.dtype.element_ty
        cols_in_seg = tl.arange(0, SEG)
        total = rows * SEGMENTS
        for item in range(tl.program_id(0), total, tl.num_programs(0)):
            row = tl.cast(item // SEGMENTS, tl.int64)
            seg = item % SEGMENTS
            cols = seg * seg_len + cols_in_seg
            mask = (cols_in_seg < seg_len) & (cols < V)
            zs_row = zs_ptr + row * stride_zs
            part_row = part_ptr + row * (SEGMENTS * 8)
            part = part_row + seg * 8
            xs = softcap(tl.load(zs_row + cols, mask=mask, other=0.0), cap_s, CAP_S)
            xt = tl.load(zt_ptr + row * stride_zt + cols, mask=mask, other=0.0).to(acc_ty)
            xt = softcap(xt, cap_t, CAP_T)
            us = scale_exact(xs, inv_hi, inv_lo, PAIR)  # finite in the masked lanes (0), which no sum reads
            ut = scale_exact(xt, inv_hi, inv_lo, PAIR)

            if PHASE == 0 or PHASE == 1:
                m, d = _segment_lse_state(tl.where(mask, us, float("-inf")))
                tl.store(part + 0, m)
                tl.store(part + 1, d)
                m, d = _segment_lse_state(tl.where(mask, ut, float("-inf")))
                tl.store(part + 2, m)
                tl.store(part + 3, d)
                if HAS_HARD and not UNIT_TEMP:
                    m, d = _segment_lse_state(tl.where(mask, xs, float("-inf")))
                    tl.store(part + 4, m)
                    tl.store(part + 5, d)
            if PHASE == 0:
                _arrive_and_wait(count_ptr + row, SEGMENTS)
            if PHASE != 1:
                lse_s = _combined_lse(part_row, 0, SEGMENTS, SEGMENTS_P2, acc_ty)
                lse_t = _combined_lse(part_row, 2, SEGMENTS, SEGMENTS_P2, acc_ty)
                log_s = us - lse_s
                log_p = ut - lse_t
                s = tl.exp(log_s)
                p = tl.exp(log_p)
                if MODE == 2:
                    log_m = _log_mixture(s, p, b_hi, b_lo, omb_hi, omb_lo, PAIR)
            if PHASE == 0 or PHASE == 2:
                if MODE == 0:
                    term = p * (log_p - log_s)
                    sg = term
                elif MODE == 1:
                    term = s * (log_s - log_p)
                    sg = term
                else:
                    sg = s * (log_s - log_m)
                    term = scale_exact(p * (log_p - log_m), b_hi, b_lo, PAIR) + scale_exact(sg, omb_hi, omb_lo, PAIR)
                tl.store(part + 6, tl.sum(tl.where(mask, term, 0.0), axis=0))
                tl.store(part + 7, tl.sum(tl.where(mask, sg, 0.0), axis=0))
            if COMPUTE_GRAD or HAS_HARD:
                if PHASE == 0 and MODE != 0 and COMPUTE_GRAD:
                    _arrive_and_wait(count_ptr + row, 2 * SEGMENTS)
                if PHASE == 0 or PHASE == 3:
                    label = tl.load(labels_ptr + row).to(tl.int64)
                    valid = (label != ignore_index) & (label >= 0) & (label < V)
                    lse_1 = lse_s
                    if HAS_HARD and not UNIT_TEMP:
                        lse_1 = _combined_lse(part_row, 4, SEGMENTS, SEGMENTS_P2, acc_ty)
                    if HAS_HARD:
                        if seg == 0:
                            x_label = softcap(tl.load(zs_row + tl.where(valid, label, 0)), cap_s, CAP_S)
                            tl.store(hard_ptr + row, tl.where(valid, lse_1 - x_label, 0.0))
                    if COMPUTE_GRAD:
                        if MODE == 0:
                            grad = s - p
                        else:
                            k = tl.arange(0, SEGMENTS_P2)
                            row_sg = tl.sum(tl.load(part_row + k * 8 + 7, mask=k < SEGMENTS, other=0.0,
                                                    cache_modifier=".cg"), axis=0)  # fmt: skip
                            if MODE == 1:
                                grad = s * (log_s - log_p - row_sg)
                            else:
                                grad = scale_exact(s * (log_s - log_m - row_sg), omb_hi, omb_lo, PAIR)
                        grad = grad * scale_exact(tl.load(w_soft_ptr + row), inv_hi, inv_lo, PAIR)
                        if HAS_HARD:
                            q = tl.exp(xs - lse_1)
                            grad += tl.load(w_hard_ptr + row) * (q - tl.where((cols == label) & valid, 1.0, 0.0))
                        if CAP_S:
                            grad = grad * (1.0 - (xs / cap_s) * (xs / cap_s))
                        tl.store(grad_ptr + row * stride_g + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)

def _grad_view_of(teacher_logits: torch.Tensor, grad_dtype: torch.dtype) -> torch.Tensor:
    """A (rows, V) gradient buffer inside the teacher logits' own storage, row i inside row i's bytes.

    The teacher chunk is dead once the last pass has read it, and reusing it drops a (rows x V) buffer per
    chunk, which buys larger chunks (fewer read-modify-writes of the V x H weight gradient) for the same
    memory. A bf16 row takes the first half of its fp32 row's bytes, so its row stride is 2V: cuBLAS reads
    that as a leading dimension, no copy.
    """
    if (
        not teacher_logits.is_contiguous()
        or teacher_logits.element_size() % torch.empty((), dtype=grad_dtype).element_size()
    ):
        return torch.empty(teacher_logits.shape, dtype=grad_dtype, device=teacher_logits.device)
    return teacher_logits.view(grad_dtype)[:, : teacher_logits.shape[1]]


@dataclass(frozen=True)
class JSDLaunch:
    """How `_jsd_chunk_kernel` walks a row, for the L2 cache's sake (the passes are bound by memory traffic).

    `reverse_middle`: pass 2 walks right to left, so it starts on the tiles pass 1 read last, the ones most
    likely still in L2 (pass 3 then starts where pass 2 ended); pass 3 itself must walk left to right, as its
    gradient may overwrite teacher bytes only behind its reads (`_grad_view_of`). `l2_hints`: passes 1 and 2 ask
    L2 to keep what they load, pass 3 (the last read) to drop it first. Neither changes what is computed, only the
    order of independent loads and of pass 2's partial sums (equal to rounding). The defaults are today's walk:
    benchmarks/loss/probe_jsd_order.py found no variant faster in the whole loss on a Hopper GPU, whose L2 holds
    too little of the rows in flight; the knobs stay so the probe can ask again on GPUs with a larger L2.
    """

    reverse_middle: bool = False
    l2_hints: bool = False
    block: int | None = None  # vocabulary tile and warps per program; None: row_launch_config's
    num_warps: int | None = None
    # `segment`: split each row over programs that hold up to this many columns of it in registers
    # (`_jsd_segment_kernel`: each logit read once) instead of streaming it three times; None: the streaming walk.
    # `programs_per_sm`: how many of those programs the persistent grid puts on a multiprocessor (all must be
    # resident at once, as a row's programs wait for each other). `phased`: the segments' three phases as three
    # launches (what the interpreter and CPU tensors always get), no barrier.
    segment: int | None = None
    programs_per_sm: int = 1
    phased: bool = False
    segment_from: int = 0  # the segment walk for rows of at least this many columns, the streaming walk below

    def __post_init__(self):
        for name in ("block", "segment"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"JSDLaunch.{name} must be a power of two >= 16 (a Triton tile); got {value}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"JSDLaunch.num_warps must be one of 1, 2, 4, 8, 16, 32; got {self.num_warps}")
        if self.programs_per_sm not in (1, 2, 3, 4):
            raise ValueError(f"JSDLaunch.programs_per_sm must be 1, 2, 3 or 4; got {self.programs_per_sm}")


# The segment walk where a row spans at least one segment (a 128K vocabulary: 8 segments of 16384 columns, the
# fastest size in benchmarks/loss/probe_jsd_order.py's sweep); smaller vocabularies keep the streaming walk, one
# program a row (never measured against it there).
JSD_LAUNCH = JSDLaunch(segment=16384, num_warps=16, segment_from=16384)


def row_launch_config(vocab: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the kernels that stream one row of logits per program (the JSD chunk, the teacher
    fold): 4096-wide tiles keep 16 fp32 values per thread at 8 warps, enough loads in flight to stream a row at
    full bandwidth without spilling; small vocabularies (tests) get one tile."""
    block = min(4096, 1 << (vocab - 1).bit_length())
    return block, 8 if block >= 2048 else 4


def jsd_chunk_triton(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    w_soft: torch.Tensor,
    w_hard: torch.Tensor,
    grad_dtype: torch.dtype | None,
    cfg: KDLossConfig,
    launch: JSDLaunch | None = None,
    grad_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch `_jsd_chunk_kernel`; same contract as `jsd_chunk_torch` (`launch`: JSD_LAUNCH unless given)."""
    launch = JSD_LAUNCH if launch is None else launch
    if launch.segment is not None and student_logits.shape[1] >= launch.segment_from:
        return _jsd_segments(student_logits, teacher_logits, labels, w_soft, w_hard, grad_dtype, cfg, launch, grad_out)
    rows, vocab = student_logits.shape
    soft = torch.empty(rows, dtype=student_logits.dtype, device=student_logits.device)
    hard = torch.zeros_like(soft)
    grad = soft
    if grad_dtype:
        grad = grad_out if grad_out is not None else _grad_view_of(teacher_logits, grad_dtype)
    block, num_warps = row_launch_config(vocab)
    block = min(block, launch.block) if launch.block else block
    num_warps = launch.num_warps or num_warps
    options, meta = _loss_options(cfg, student_logits.dtype, grad_dtype)
    _jsd_chunk_kernel[(rows,)](
        # pointers
        student_logits, teacher_logits, grad, labels, w_soft, w_hard, soft, hard,
        # strides and shapes
        student_logits.stride(0), teacher_logits.stride(0), grad.stride(0) if grad_dtype else 0, vocab,
        *options, **meta, BLOCK=block, REVERSE_MIDDLE=launch.reverse_middle,
        KEEP="evict_last" if launch.l2_hints else "", DROP="evict_first" if launch.l2_hints else "",
        num_warps=num_warps,
    )  # fmt: skip
    return soft, hard, grad if grad_dtype else None


def _loss_options(cfg: KDLossConfig, dtype: torch.dtype, grad_dtype: torch.dtype | None) -> tuple[tuple, dict]:
    """Both JSD kernels' loss options: (1/T, beta and 1 - beta as fp32 pairs, the two soft-caps, ignore_index) and
    their meta-parameters (MODE ... PAIR)."""
    options = (
        *fp32_pair(1.0 / cfg.temperature), *fp32_pair(float(cfg.beta)), *fp32_pair(1.0 - float(cfg.beta)),
        float(cfg.softcap or 1.0), float(cfg.teacher_softcap or 1.0), cfg.ignore_index,
    )  # fmt: skip
    meta = dict(
        MODE=_mode(cfg.beta), HAS_HARD=bool(cfg.hard_weight), UNIT_TEMP=cfg.temperature == 1.0,
        CAP_S=cfg.softcap is not None, CAP_T=cfg.teacher_softcap is not None, COMPUTE_GRAD=grad_dtype is not None,
        PAIR=dtype == torch.float64,
    )  # fmt: skip
    return options, meta


def _jsd_segments(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    w_soft: torch.Tensor,
    w_hard: torch.Tensor,
    grad_dtype: torch.dtype | None,
    cfg: KDLossConfig,
    launch: JSDLaunch,
    grad_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`_jsd_segment_kernel`: one persistent launch whose row programs meet at barriers, or three phased launches
    where a barrier cannot be trusted (see `barriers_hold`)."""
    rows, vocab = student_logits.shape
    device = student_logits.device
    segments = -(-vocab // launch.segment)
    seg_len = -(-vocab // segments)
    seg = 1 << (seg_len - 1).bit_length()
    phased = launch.phased or segments > 1 and not barriers_hold(device)  # a lone segment never waits
    # every slot a launch reads, it writes first (4 and 5 only with a CE term at T != 1)
    part = torch.empty(rows, segments, 8, dtype=student_logits.dtype, device=device)
    hard = torch.zeros(rows, dtype=student_logits.dtype, device=device)
    grad = grad_out if grad_dtype is not None else None
    if grad_dtype is not None and grad_out is None:
        # once a row's programs have passed their first barrier, each has read its inputs: the gradient may take
        # the teacher's bytes (a lone segment has read the whole row before it writes); phase 3 of a phased launch
        # reads the other segments' teacher bytes while this one writes, so it gets a buffer of its own
        shared = phased and segments > 1
        grad = torch.empty(student_logits.shape, dtype=grad_dtype, device=device) if shared else \
            _grad_view_of(teacher_logits, grad_dtype)  # fmt: skip
    count = torch.zeros(rows if not phased else 1, dtype=torch.int32, device=device)
    options, meta = _loss_options(cfg, student_logits.dtype, grad_dtype)
    common = dict(**meta, SEGMENTS=segments, SEGMENTS_P2=max(2, 1 << (segments - 1).bit_length()), SEG=seg,
                  num_warps=launch.num_warps or 8)  # fmt: skip
    args = (
        student_logits, teacher_logits, grad if grad is not None else part, labels, w_soft, w_hard, part, hard, count,
        student_logits.stride(0), teacher_logits.stride(0), grad.stride(0) if grad is not None else 0, rows, vocab,
        seg_len, *options,
    )  # fmt: skip
    if phased:
        for phase in (1, 2, 3):
            _jsd_segment_kernel[(rows * segments,)](*args, PHASE=phase, **common)
    else:
        programs = resident_programs(args, common, launch, device) // segments * segments
        _jsd_segment_kernel[(max(segments, min(programs, rows * segments)),)](*args, PHASE=0, **common)
    return part[:, :, 6].sum(1), hard, grad


_RESIDENT: dict[tuple, int] = {}


def resident_programs(args: tuple, common: dict, launch: JSDLaunch, device: torch.device) -> int:
    """Programs of the compiled `_jsd_segment_kernel` the device holds at once: its multiprocessors times
    `launch.programs_per_sm`, or fewer where the kernel's registers, shared memory or threads allow fewer
    (a grid larger than what is resident could leave a row's barrier waiting on a program never started).
    One program a multiprocessor always fits: the compiler keeps a program within one."""
    if device.type != "cuda":
        return 1
    key = (device.index, launch.programs_per_sm, tuple(sorted(common.items())),
           tuple(a.dtype for a in args[:3] if isinstance(a, torch.Tensor)))  # fmt: skip
    if key not in _RESIDENT:
        props = torch.cuda.get_device_properties(device)
        fits = [launch.programs_per_sm]
        if launch.programs_per_sm > 1:
            compiled = _jsd_segment_kernel.warmup(*args, grid=(1,), PHASE=0, **common)
            compiled._init_handles()  # n_regs is read from the loaded module
            threads = 32 * common["num_warps"]
            fits.append(getattr(props, "regs_per_multiprocessor", 65536) // (max(1, compiled.n_regs) * threads))
            fits.append(getattr(props, "max_threads_per_multi_processor", 2048) // threads)
            if compiled.metadata.shared:
                fits.append(getattr(props, "shared_memory_per_multiprocessor", 228 << 10) // compiled.metadata.shared)
        _RESIDENT[key] = props.multi_processor_count * max(1, min(fits))
    return _RESIDENT[key]


def barriers_hold(device: torch.device) -> bool:
    """Whether a row's programs can wait for each other: all of them resident at once, which a CUDA device gives a
    grid no larger than its multiprocessors, unless MPS caps this process's share of them (a grid sized by the
    full count could then wait forever); the interpreter runs programs one after another."""
    return device.type == "cuda" and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ


CHUNK_KERNELS = {"torch": jsd_chunk_torch, "triton": jsd_chunk_triton}
