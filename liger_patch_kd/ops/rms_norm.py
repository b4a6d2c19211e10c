"""RMSNorm, forward and backward, as each architecture computes it.

y = x / sqrt(mean(x^2) + eps) * (offset + w), with three casting modes:
    "llama": normalise in fp32, cast to the input dtype, then multiply by the weight (Llama, Mistral, Qwen, Phi-3)
    "gemma": normalise and multiply by (1 + w) in fp32, cast at the end (Gemma 1/2/3, offset 1)
    "olmo":  normalise in fp32, multiply by w in w's dtype promoted with fp32, cast at the end (OLMo-2, GPT-OSS).
             For fp32 / bf16 / fp16 weights that is "gemma" with offset 0, which is what the kernel computes;
             it differs only for fp64 weights, which the PyTorch path (CPU) computes as the model does.
"""

from __future__ import annotations

import torch

from .backend import select_backend, triton_available

CASTING_MODES = ("llama", "gemma", "olmo")


def check_casting(casting: str) -> None:
    if casting not in CASTING_MODES:
        raise ValueError(f"casting must be one of {CASTING_MODES}; got casting={casting!r}")


def norm_output_dtype(x_dtype: torch.dtype, weight_dtype: torch.dtype, casting: str) -> torch.dtype:
    """The norm's output dtype: "llama" multiplies the input-dtype result by the weight (promoted), the others
    cast at the end to the input's dtype."""
    return x_dtype if casting != "llama" else torch.promote_types(x_dtype, weight_dtype)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, casting: str = "llama"):
    """The reference computation, op for op as transformers writes it."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "gemma":
        return (normed * (offset + weight.float())).to(x.dtype)
    if casting == "olmo":
        return ((offset + weight) * normed).to(x.dtype)
    return (offset + weight) * normed.to(x.dtype)


if triton_available():
    import triton
    import triton.language as tl

    from .triton_utils import await_prior_grids, dependent_launch_options

    @triton.jit
    def rms_norm_values(x, w_ptr, cols, mask, H, eps, offset, CAST_LAST: tl.constexpr):
        """(y in fp32 before its cast to the output dtype, rstd) of one row already loaded (x, in its own dtype)."""
        x32 = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        normed = x32 * rstd
        if CAST_LAST:
            y = normed * (offset + w.to(tl.float32))
        else:
            y = normed.to(x.dtype).to(tl.float32) * (offset + w.to(tl.float32))
        return y, rstd

    @triton.jit
    def rms_norm_row(x_ptr, w_ptr, row, stride_x, H, eps, offset, CAST_LAST: tl.constexpr, BLOCK: tl.constexpr):
        """(y in fp32 before its cast to the output dtype, rstd, the column mask) of one row, as the casting mode
        computes it; shared with the FP8 teacher's norm that also quantises its output (ops/fp8.py)."""
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        y, rstd = rms_norm_values(x, w_ptr, cols, mask, H, eps, offset, CAST_LAST)
        return y, rstd, cols, mask

    @triton.jit
    def _rms_norm_fwd_kernel(
        x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, H, eps, offset,
        CAST_LAST: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        y, rstd, cols, mask = rms_norm_row(x_ptr, w_ptr, row, stride_x, H, eps, offset, CAST_LAST, BLOCK)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _add_rms_norm_fwd_kernel(
        x_ptr, r_ptr, w_ptr, s_ptr, y_ptr, stride_x, stride_r, stride_s, stride_y, H, eps, offset,
        CAST_LAST: tl.constexpr, ADD_F64: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """s = r + x rounded to s's dtype (as torch's add rounds it), then y = RMSNorm(s), one read of each row."""
        await_prior_grids(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        add_dtype = tl.float64 if ADD_F64 else tl.float32  # an fp64 sum is exact only added in fp64
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(add_dtype)
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(add_dtype)
        summed = (r + x).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + cols, summed, mask=mask)
        y, _ = rms_norm_values(summed, w_ptr, cols, mask, H, eps, offset, CAST_LAST)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_bwd_kernel(
        dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, stride_dy, stride_x, stride_dx, n_rows, H, offset,
        rows_per_program, CAST_LAST: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Each program takes a run of rows: dx per row, and its share of dW summed in fp32 (one partial row)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
        dw = tl.zeros([BLOCK], tl.float32)
        start = pid * rows_per_program
        for i in range(0, rows_per_program):
            row = (start + i).to(tl.int64)
            if row < n_rows:
                x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
                x32 = x.to(tl.float32)
                dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                rstd = tl.load(rstd_ptr + row)
                normed = x32 * rstd
                if CAST_LAST:
                    dw += dy * normed
                else:
                    dw += dy * normed.to(x.dtype).to(tl.float32)
                dn = dy * w
                dx = rstd * (dn - normed * (tl.sum(dn * normed, axis=0) / H))
                tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dw_partial_ptr + pid * H + cols, dw, mask=mask)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        n_rows, hidden = x2.shape
        y = torch.empty((n_rows, hidden), dtype=norm_output_dtype(x.dtype, weight.dtype, casting), device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(hidden)
        _rms_norm_fwd_kernel[(n_rows,)](
            x2, weight, y, rstd, x2.stride(0), y.stride(0), hidden, eps, offset,
            CAST_LAST=casting != "llama", BLOCK=block, num_warps=norm_warps(block),
        )  # fmt: skip
        ctx.save_for_backward(x2, weight, rstd)
        ctx.meta = (shape, offset, casting)
        return y.reshape(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        shape, offset, casting = ctx.meta
        dy2 = dy.reshape(-1, shape[-1])
        n_rows, hidden = x2.shape
        dx = torch.empty_like(x2)
        # enough programs to fill the GPU; each sums its rows' dW in fp32 so no atomics are needed
        programs = max(1, min(n_rows, 4 * _sm_count(x2.device)))
        rows_per_program = -(-n_rows // programs)
        dw_partial = torch.empty((programs, hidden), dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(hidden)
        _rms_norm_bwd_kernel[(programs,)](
            dy2, x2, weight, rstd, dx, dw_partial, dy2.stride(0), x2.stride(0), dx.stride(0), n_rows, hidden, offset,
            rows_per_program, CAST_LAST=casting != "llama", BLOCK=block, num_warps=norm_warps(block),
        )  # fmt: skip
        return dx.reshape(shape), dw_partial.sum(0).to(weight.dtype), None, None, None


def norm_warps(block: int) -> int:
    """One warp per 256 columns, 1..16: a row stays in registers without spilling at hidden sizes up to 16k."""
    return max(1, min(16, block // 256))


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    casting: str = "llama",
    backend: str | None = None,
) -> torch.Tensor:
    """RMSNorm of the last dimension; Triton on CUDA, `rms_norm_torch` elsewhere."""
    check_casting(casting)
    if select_backend(x.device, backend) == "torch":
        return rms_norm_torch(x, weight, eps, offset, casting)
    return RMSNormFunction.apply(x, weight, float(eps), float(offset), casting)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    casting: str = "llama",
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
    dependent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed, normed): summed = residual + x as torch adds them (dtype promoted, rounded once), normed =
    RMSNorm(summed), in one kernel on CUDA (a decoder layer's residual add and the norm that reads it). Forward only:
    nothing here is differentiated. `out_dtype`: the norm's output dtype where its readers would cast it anyway (a
    product under autocast): the same values, rounded once, without the cast's kernel; default the norm's own.
    `dependent`: launched as a programmatic dependent of the kernel before it where the GPU supports it
    (ops.triton_utils.await_prior_grids; the decode engine's choice, generation/dependent_launch.py)."""
    check_casting(casting)
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} must be ({x.shape[-1]},), x's last dimension")
    if not (x.device == residual.device == weight.device):
        raise ValueError(f"add_rms_norm: x, residual and weight must be on one device; got {x.device}, "
                         f"{residual.device} and {weight.device}")  # fmt: skip
    summed_dtype = torch.promote_types(residual.dtype, x.dtype)
    normed_dtype = out_dtype or norm_output_dtype(summed_dtype, weight.dtype, casting)
    if select_backend(x.device, backend) == "torch":
        summed = residual + x
        return summed, rms_norm_torch(summed, weight, eps, offset, casting).to(normed_dtype)
    hidden = x.shape[-1]
    x2, r2 = x.reshape(-1, hidden), residual.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    summed = torch.empty(x2.shape, dtype=summed_dtype, device=x.device)
    normed = torch.empty(x2.shape, dtype=normed_dtype, device=x.device)
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_fwd_kernel[(x2.shape[0],)](
        x2, r2, weight, summed, normed, x2.stride(0), r2.stride(0), summed.stride(0), normed.stride(0), hidden,
        float(eps), float(offset), CAST_LAST=casting != "llama", ADD_F64=summed_dtype == torch.float64,
        BLOCK=block, num_warps=norm_warps(block), **dependent_launch_options(dependent, x.device),
    )  # fmt: skip
    return summed.reshape(x.shape), normed.reshape(x.shape)
