"""x @ W.T (+ b) for a few rows of x: the products of a decode step, at the speed of reading W once.

A decode step multiplies a handful of rows (one token per sequence) by each weight. That is a read of the weight
and almost no arithmetic, yet a general matrix product tiles it as it would a square one: most of a tile's rows
are empty, few tiles cover a narrow output, and the GPU's memory system sits partly idle
(benchmarks/onpolicy/probe_few_rows_linear.py measures both). Here each program owns a narrow band of output
columns (BLOCK_N of them) for every row at once, so the weight is read exactly once by enough programs to keep
every SM streaming; the rows of x, a few kB, come from L2.

`few_rows_linear` is F.linear's contract; it takes the kernel where it applies (`few_rows_applies`: CUDA, or the
Triton interpreter when the backend is asked for; bf16 / fp16 inputs of one dtype, autocast off or in that
dtype, no gradient wanted, at most MAX_ROWS rows) and F.linear elsewhere. The kernel sums each output in fp32 in
one program, in a fixed order: the same inputs give the same bits on every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import autocast_dtype, select_backend, triton_available, triton_interpreted

MAX_ROWS = 64  # beyond this a step's product is a real matrix product: cuBLAS's tiles fit it
DTYPES = (torch.bfloat16, torch.float16)


def few_rows_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `few_rows_linear` runs the kernel for these inputs (the module docstring)."""
    if x.dtype not in DTYPES or weight.dtype != x.dtype or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.stride(0) != 1):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if weight.stride(1) != 1 or weight.device != x.device or autocast_dtype(x.device) not in (None, x.dtype):
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return 0 < rows <= MAX_ROWS and select_backend(x.device) == "triton"


def few_rows_config(rows: int, n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the rows padded to a tile, the output band narrow enough
    that a 132-SM GPU gets at least two programs per SM, and K tiles deep enough to keep loads in flight."""
    block_m = max(16, 1 << (rows - 1).bit_length())
    block_n = 16 if n <= 4 * 1024 else 32 if n <= 8 * 1024 else 64
    block_k = 256 if block_m <= 16 else 128
    return block_m, block_n, min(block_k, max(16, 1 << (k - 1).bit_length())), 4, 4


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _few_rows_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        UPCAST: tl.constexpr,
    ):  # fmt: skip
        """One program: out[:, band] for every row, over the whole K (one fp32 sum per output, in K order).
        UPCAST: the tiles go to the product in fp32 (the same products, exact in fp32): the Triton interpreter's
        bf16 product is wrong; a GPU multiplies the 16-bit tiles as they are."""
        band = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        w_rows = w_ptr + band.to(tl.int64)[:, None] * stride_wn
        x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
        for k in range(0, K, BLOCK_K):
            kk = k + cols
            x = tl.load(x_rows + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=(band[:, None] < N) & (kk[None, :] < K), other=0.0)
            if UPCAST:
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc)
        if HAS_BIAS:
            acc += tl.load(b_ptr + band, mask=band < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + band[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (band[None, :] < N))


def few_rows_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: tuple | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias), through the kernel where `few_rows_applies`. `config`: few_rows_config's tuple,
    to try another (benchmarks)."""
    if not few_rows_applies(x, weight, bias):
        return F.linear(x, weight, bias)
    k, n = weight.shape[1], weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps, stages = config or few_rows_config(rows, n, k)
    _few_rows_kernel[(triton.cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, out, rows, n, k, x2.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        UPCAST=triton_interpreted(), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)
