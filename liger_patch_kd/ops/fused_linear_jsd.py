"""Fused linear generalized JSD: the online-teacher distillation loss without materialised logits.

Per row chunk (see `chunked.py`) the student and teacher logits come from two fp32-output products; then
`_jsd_chunk_kernel` (Triton) or `jsd_chunk_torch` (PyTorch, same math) reads both logit rows, computes both
log-sum-exps, the loss and dLoss/dlogits, and writes the gradient in the input dtype for the backward
products.

Gradient of the tempered student logits u = cap(z) / T, with S = softmax(u), P = softmax(cap(z_t) / T): the
divergence.py form dL/du = a - S * sum(a), which here reads
    beta == 0 (KL(P||S)):  dL/du = S - P                                  (a = -P, sum(a) = -1)
    beta == 1 (KL(S||P)):  dL/du = S * (log S - log P - L)                (sum(a) = L + 1)
    otherwise:             dL/du = (1 - beta) * S * (g - sum(S * g)),  g = log S - log M
and dL/dz = dL/du / T * cap'(z), cap'(z) = 1 - (cap(z) / c)^2. The hard term adds softmax(cap(z)) - onehot.
"""

from __future__ import annotations

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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The per-chunk math in PyTorch: (soft rows, hard rows, weighted dLoss/dlogits or None)."""
    inv_t = 1.0 / cfg.temperature
    teacher_logits = teacher_logits.to(student_logits.dtype)  # bf16 teacher logits (FP8 products) in fp32 math
    capped = apply_softcap(student_logits, cfg.softcap)
    log_s = F.log_softmax(capped * inv_t, dim=-1)
    log_p = F.log_softmax(apply_softcap(teacher_logits, cfg.teacher_softcap) * inv_t, dim=-1)
    soft, grad_u = dense_divergence(log_s, log_p, cfg.beta)
    return finish_chunk(soft, grad_u, capped, labels, w_soft, w_hard, grad_dtype, cfg)


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

    def __post_init__(self):
        if self.block is not None and (self.block < 16 or self.block & (self.block - 1)):
            raise ValueError(f"JSDLaunch.block must be a power of two >= 16 (a Triton tile); got {self.block}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"JSDLaunch.num_warps must be one of 1, 2, 4, 8, 16, 32; got {self.num_warps}")


JSD_LAUNCH = JSDLaunch()


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch `_jsd_chunk_kernel`; same contract as `jsd_chunk_torch` (`launch`: JSD_LAUNCH unless given)."""
    launch = JSD_LAUNCH if launch is None else launch
    rows, vocab = student_logits.shape
    soft = torch.empty(rows, dtype=student_logits.dtype, device=student_logits.device)
    hard = torch.zeros_like(soft)
    grad = _grad_view_of(teacher_logits, grad_dtype) if grad_dtype else soft
    block, num_warps = row_launch_config(vocab)
    block = min(block, launch.block) if launch.block else block
    num_warps = launch.num_warps or num_warps
    teacher_cap = cfg.teacher_softcap
    _jsd_chunk_kernel[(rows,)](
        # pointers
        student_logits, teacher_logits, grad, labels, w_soft, w_hard, soft, hard,
        # strides and shapes
        student_logits.stride(0), teacher_logits.stride(0), grad.stride(0) if grad_dtype else 0, vocab,
        # loss options
        *fp32_pair(1.0 / cfg.temperature), *fp32_pair(float(cfg.beta)), *fp32_pair(1.0 - float(cfg.beta)),
        float(cfg.softcap or 1.0), float(teacher_cap or 1.0), cfg.ignore_index,
        # meta-parameters
        MODE=_mode(cfg.beta), HAS_HARD=bool(cfg.hard_weight), UNIT_TEMP=cfg.temperature == 1.0,
        CAP_S=cfg.softcap is not None, CAP_T=teacher_cap is not None, COMPUTE_GRAD=grad_dtype is not None,
        PAIR=student_logits.dtype == torch.float64, BLOCK=block, REVERSE_MIDDLE=launch.reverse_middle,
        KEEP="evict_last" if launch.l2_hints else "", DROP="evict_first" if launch.l2_hints else "",
        num_warps=num_warps,
    )  # fmt: skip
    return soft, hard, grad if grad_dtype else None


CHUNK_KERNELS = {"torch": jsd_chunk_torch, "triton": jsd_chunk_triton}
