"""One teacher folded into a running log-mixture of teachers, per chunk of rows (losses.multi_teacher):

    mix <- logaddexp(mix, log w_j + log_softmax(cap_j(z_j) / T))        (row-wise log w_j; mix = that term for j = 0)

and, for the last teacher, mix * out_scale (the chunk kernel then reads T * log P as its teacher's logits). The
Triton kernel reads the teacher's logits twice (its log-sum-exp, then the fold) and the mixture once, writing it in
place: four passes over the chunk where the PyTorch ops take about twelve. With no mixture yet it writes into the
teacher's own logits. `fold_teacher_torch` is the same math in PyTorch (and what runs on CPU).
"""

from __future__ import annotations

import torch

from ..conventions import apply_softcap
from .backend import triton_available
from .fused_linear_jsd import row_launch_config


def fold_teacher_torch(
    mix: torch.Tensor | None,
    logits: torch.Tensor,
    log_w: torch.Tensor,
    inv_temp: float,
    softcap: float | None,
    out_scale: float = 1.0,
) -> torch.Tensor:
    """logaddexp(mix, log_w[:, None] + log_softmax(cap(logits) * inv_temp)) * out_scale, in place in `mix` (in
    `logits` when `mix` is None). logits (rows, V) fp32 / fp64, log_w (rows,)."""
    z = apply_softcap(logits, softcap).mul_(inv_temp)
    z.sub_(torch.logsumexp(z, -1, keepdim=True) - log_w[:, None])  # log w_j + log P_j
    mix = z if mix is None else torch.logaddexp(mix, z, out=mix)
    return mix if out_scale == 1.0 else mix.mul_(out_scale)


if triton_available():
    import triton
    import triton.language as tl

    from .triton_utils import fp32_pair, row_lse, scale_exact, softcap

    @triton.jit
    def _fold_teacher_kernel(
        # pointers
        z_ptr,  # (rows, V) the teacher's logits, fp32 (fp64 in tests)
        mix_ptr,  # (rows, V) the running log-mixture, read (unless FIRST) and written in place
        log_w_ptr,  # (rows,) this teacher's log-weight per row
        # strides and shapes
        stride_z,
        stride_m,
        V,
        # options: 1/T and the output scale each as two fp32 halves (triton_utils.fp32_pair: a compiled kernel
        # takes a Python float as fp32, which would cap a float64 fold at ~1e-7)
        inv_hi,
        inv_lo,
        cap,
        scale_hi,
        scale_lo,
        # meta-parameters
        CAP: tl.constexpr,  # the teacher has a soft-cap
        FIRST: tl.constexpr,  # no mixture yet: mix_ptr is z_ptr, written over
        BLOCK: tl.constexpr,  # vocabulary tile
    ):
        """One program per row. Pass 1: the tempered logits' log-sum-exp. Pass 2: each tile's log w + log P,
        folded into the mixture by a log-add-exp (max + log(1 + exp(min - max))), scaled and stored."""
        row = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + row * stride_z
        m_row = mix_ptr + row * stride_m
        cols = tl.arange(0, BLOCK)
        # pass 1 is the slot kernels' student pass (no CE term)
        lse, _ = row_lse(z_row, V, inv_hi, inv_lo, cap, CAP, False, True, BLOCK)
        shift = tl.load(log_w_ptr + row) - lse
        for off in range(0, V, BLOCK):
            mask = off + cols < V
            z = softcap(tl.load(z_row + off + cols, mask=mask, other=0.0), cap, CAP)
            term = scale_exact(z, inv_hi, inv_lo, True)
            term += shift
            if FIRST:
                out = term
            else:
                prev = tl.load(m_row + off + cols, mask=mask, other=0.0)
                hi = tl.maximum(prev, term)
                lo = tl.minimum(prev, term)
                safe_hi = tl.where(hi == float("-inf"), 0.0, hi)  # both -inf (weight 0 twice): stays -inf
                out = tl.where(hi == float("-inf"), hi, hi + tl.log(1.0 + tl.exp(lo - safe_hi)))
            out = tl.where(out == float("-inf"), out, scale_exact(out, scale_hi, scale_lo, True))  # -inf * 0 is no -inf
            tl.store(m_row + off + cols, out, mask=mask)


def fold_teacher_triton(
    mix: torch.Tensor | None,
    logits: torch.Tensor,
    log_w: torch.Tensor,
    inv_temp: float,
    softcap: float | None,
    out_scale: float = 1.0,
) -> torch.Tensor:
    """Launch `_fold_teacher_kernel`; same contract as `fold_teacher_torch`."""
    rows, vocab = logits.shape
    first = mix is None
    out = logits if first else mix
    log_w = log_w.to(logits.dtype).contiguous()
    block, num_warps = row_launch_config(vocab)
    _fold_teacher_kernel[(rows,)](
        # pointers
        logits, out, log_w,
        # strides and shapes
        logits.stride(0), out.stride(0), vocab,
        # options
        *fp32_pair(inv_temp), float(softcap or 1.0), *fp32_pair(out_scale),
        # meta-parameters
        CAP=softcap is not None, FIRST=first, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip
    return out


FOLD_KERNELS = {"torch": fold_teacher_torch, "triton": fold_teacher_triton}
