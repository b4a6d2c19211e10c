"""Rotary position embedding for q and k in one kernel (rotate-half convention, as transformers writes it).

q_out = q * cos + rotate_half(q) * sin, with q (B, heads, T, D) in any strides and cos / sin (B, T, D) or
(1, T, D). The backward is the same rotation with sin negated.
"""

from __future__ import annotations

import torch

from .backend import select_backend, triton_available


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_torch(q, k, cos, sin, unsqueeze_dim: int = 1):
    """The rotation in the promoted dtype, returned in q's and k's (as the Triton path, and as OLMo-2's own
    apply_rotary_pos_emb does with its fp32 cos / sin; elsewhere cos and sin come in q's dtype already)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos + rotate_half(q) * sin).to(q.dtype), (k * cos + rotate_half(k) * sin).to(k.dtype)


if triton_available():
    import triton
    import triton.language as tl

    from .triton_utils import acc_type

    @triton.jit
    def _rotate_heads(x_ptr, out_ptr, b, t, sxb, sxh, sxt, sob, soh, sot, n_heads, cos1, cos2, sin1, sin2,
                      ACC: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
        """Both halves of the rotation for every head of one (batch, position) of one tensor."""
        d = tl.arange(0, BLOCK_D)
        heads = tl.arange(0, BLOCK_H)
        hmask = (heads[:, None] < n_heads) & (d[None, :] < HALF)
        base = x_ptr + b * sxb + t * sxt + heads[:, None] * sxh
        x1 = tl.load(base + d[None, :], mask=hmask, other=0.0).to(ACC)
        x2 = tl.load(base + HALF + d[None, :], mask=hmask, other=0.0).to(ACC)
        out = out_ptr + b * sob + t * sot + heads[:, None] * soh
        tl.store(out + d[None, :], (x1 * cos1[None, :] - x2 * sin1[None, :]).to(out_ptr.dtype.element_ty), mask=hmask)
        tl.store(
            out + HALF + d[None, :], (x2 * cos2[None, :] + x1 * sin2[None, :]).to(out_ptr.dtype.element_ty), mask=hmask
        )

    @triton.jit
    def _rope_kernel(
        q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
        sqb, sqh, sqt, skb, skh, skt, soqb, soqh, soqt, sokb, sokh, sokt, scb, sct, T, q_heads, k_heads,
        BACKWARD: tl.constexpr, ACC: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    ):  # fmt: skip
        """One program per (batch, position): every head of q and of k, cos / sin read once for both (one launch:
        a decode step's few rows are bound by launches, not bytes). The backward applies the transposed rotation:
        sin halves swapped and negated. cos / sin are read in their own dtype and the rotation computed in ACC, as
        the torch path's type promotion does (float32 tables for bf16 q stay float32). A half that is not a power
        of two (head size 80, 96, 24) is a masked BLOCK_D-wide tile."""
        pid = tl.program_id(0)
        b = (pid // T).to(tl.int64)
        t = (pid % T).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        dmask = d < HALF
        cos1 = tl.load(cos_ptr + b * scb + t * sct + d, mask=dmask, other=0.0).to(ACC)
        cos2 = tl.load(cos_ptr + b * scb + t * sct + HALF + d, mask=dmask, other=0.0).to(ACC)
        sin1 = tl.load(sin_ptr + b * scb + t * sct + d, mask=dmask, other=0.0).to(ACC)
        sin2 = tl.load(sin_ptr + b * scb + t * sct + HALF + d, mask=dmask, other=0.0).to(ACC)
        if BACKWARD:
            sin1, sin2 = -sin2, -sin1
        _rotate_heads(q_ptr, q_out_ptr, b, t, sqb, sqh, sqt, soqb, soqh, soqt, q_heads, cos1, cos2, sin1, sin2,
                      ACC, HALF, BLOCK_D, BLOCK_QH)  # fmt: skip
        _rotate_heads(k_ptr, k_out_ptr, b, t, skb, skh, skt, sokb, sokh, sokt, k_heads, cos1, cos2, sin1, sin2,
                      ACC, HALF, BLOCK_D, BLOCK_KH)  # fmt: skip

    def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool):
        bsz, q_heads, seq, dim = q.shape
        k_heads = k.shape[1]
        # outputs in transformers' layout: (B, T, heads, D) storage seen as (B, heads, T, D)
        q_out = torch.empty((bsz, seq, q_heads, dim), dtype=q.dtype, device=q.device).transpose(1, 2)
        k_out = torch.empty((bsz, seq, k_heads, dim), dtype=k.dtype, device=k.device).transpose(1, 2)
        cb = cos.stride(0) if cos.shape[0] > 1 else 0
        _rope_kernel[(bsz * seq,)](
            q, k, q_out, k_out, cos, sin,
            *q.stride()[:3], *k.stride()[:3], *q_out.stride()[:3], *k_out.stride()[:3], cb, cos.stride(1),
            seq, q_heads, k_heads, BACKWARD=backward, ACC=acc_type(q.dtype), HALF=dim // 2,
            BLOCK_D=triton.next_power_of_2(dim // 2), BLOCK_QH=triton.next_power_of_2(q_heads),
            BLOCK_KH=triton.next_power_of_2(k_heads),
        )  # fmt: skip
        return q_out, k_out


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(q, k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = (g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk))  # the kernel reads dim as contiguous
        return (*_rotate(dq, dk, cos, sin, True), None, None)


def _triton_can_take(q: torch.Tensor, cos: torch.Tensor, unsqueeze_dim: int) -> bool:
    dim = q.shape[-1]
    return (
        unsqueeze_dim == 1
        and q.dim() == 4
        and cos.dim() == 3
        and cos.shape[-1] == dim  # partial rotary (Phi-4-mini) goes to the torch path
        and dim % 2 == 0
        and q.stride(-1) == 1
    )


def _pairs_with(q: torch.Tensor, k: torch.Tensor) -> bool:
    """k can be rotated in q's launch: the same batch, positions, head size and dtype, its last dim contiguous."""
    return k.dim() == 4 and k.shape[::2] == q.shape[::2] and k.shape[-1] == q.shape[-1] and k.dtype == q.dtype \
        and k.stride(-1) == 1  # fmt: skip


def _tables_fit(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """cos / sin cover q's positions, for its batch or for all (the kernel reads them by q's indices: a smaller
    table would be read past its end; the torch path raises on it instead)."""
    return cos.shape == sin.shape and cos.shape[1] == q.shape[2] and cos.shape[0] in (1, q.shape[0])


def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim: int = 1, backend: str | None = None):
    """Drop-in for transformers' apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)."""
    if select_backend(q.device, backend) == "torch" or not (
        _triton_can_take(q, cos, unsqueeze_dim) and _pairs_with(q, k) and _tables_fit(q, cos, sin)
    ):
        return rope_torch(q, k, cos, sin, unsqueeze_dim)
    return RoPEFunction.apply(q, k, cos, sin)  # tables in their own dtype: the torch path's promotion
