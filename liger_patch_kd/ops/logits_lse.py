"""Logits and their log-sum-exp from one product: the softmax's first pass moved into the product's epilogue.

`logits_with_lse(x, w, bias, ...)` returns out = x @ w.T (+ bias) in float32, like `backend.logits_fp32`, and
each row's log-sum-exp of cap(out) / T (and, when asked, of cap(out) at T = 1 for the hard term). Each program
of the product owns a (rows x columns) tile of the accumulator; before storing it, it reduces the tile to one
log-sum-exp per row, so the chunk kernels start with every row's normaliser instead of streaming both fp32 rows
once more to find it: a third of the bytes the JSD kernel reads, half of what the KL kernels read.

Programs walk the row tiles of one column tile before moving to the next: a chunk's hidden states (rows x H)
stay in L2 and each weight tile is read from memory once per chunk, as cuBLAS does for this tall-weight shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import triton_interpreted
from .chunked import LogitsWithLse
from .triton_utils import _softcap

# Tile shapes tried once per (rows, columns, H) on the first call. 128 x 256 x 64 at 8 warps is the usual Hopper
# bf16 optimum; the others cover small row counts and GPUs with less shared memory.
_CONFIGS = [
    triton.Config({"BM": 128, "BN": 256, "BK": 64}, num_warps=8, num_stages=3),
    triton.Config({"BM": 128, "BN": 256, "BK": 64}, num_warps=8, num_stages=4),
    triton.Config({"BM": 128, "BN": 128, "BK": 64}, num_warps=4, num_stages=4),
    triton.Config({"BM": 128, "BN": 128, "BK": 64}, num_warps=8, num_stages=4),
    triton.Config({"BM": 256, "BN": 128, "BK": 64}, num_warps=8, num_stages=3),
    triton.Config({"BM": 64, "BN": 256, "BK": 64}, num_warps=4, num_stages=4),
]
_INTERPRETED_CONFIG = {"BM": 32, "BN": 64, "BK": 32}


@triton.jit
def _tile_lse(y, col_ok):
    """Log-sum-exp along the columns of a tile, ignoring the columns past the weight's end."""
    y = tl.where(col_ok[None, :], y, float("-inf"))
    m = tl.max(y, axis=1)
    return m + tl.log(tl.sum(tl.exp(y - m[:, None]), axis=1))


@triton.jit
def _logits_lse_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, lse_ptr, lse1_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_lm,
    inv_temp, cap,
    HAS_BIAS: tl.constexpr, CAP: tl.constexpr, WITH_UNIT: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    n_row_tiles = tl.cdiv(M, BM)
    pid_m = pid % n_row_tiles  # row tiles vary fastest: one weight tile serves every row tile in turn
    pid_n = pid // n_row_tiles
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    row_ok = rm < M
    col_ok = rn < N
    # rows / columns past the end read row 0 (always there) instead of masking every load of the main loop
    x_rows = tl.where(row_ok, rm, 0).to(tl.int64)
    w_rows = tl.where(col_ok, rn, 0).to(tl.int64)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = k + rk < K
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's 16-bit dot is wrong (triton 3.9); the GPU's is what this kernel is for
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
        x_ptrs += BK
        w_ptrs += BK
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, acc, mask=row_ok[:, None] & col_ok[None, :])
    capped = _softcap(acc, cap, CAP)
    lse_at = lse_ptr + rm.to(tl.int64) * stride_lm + pid_n
    tl.store(lse_at, _tile_lse(capped * inv_temp, col_ok), mask=row_ok)
    if WITH_UNIT:
        tl.store(lse1_ptr + rm.to(tl.int64) * stride_lm + pid_n, _tile_lse(capped, col_ok), mask=row_ok)


# each config tried writes its own partial columns: restoring the -inf fill between tries keeps one config's
# columns from leaking into another's result
_tuned_kernel = triton.autotune(
    configs=_CONFIGS, key=["M", "N", "K", "HAS_BIAS", "CAP", "WITH_UNIT"], restore_value=["lse_ptr", "lse1_ptr"]
)(_logits_lse_kernel)


def logits_with_lse(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    with_unit_temperature: bool = False,
    config: dict | None = None,
) -> LogitsWithLse:
    """LogitsWithLse: logits fp32 (M, N), lse (M,) of cap(logits) / T, lse_unit (M,) of cap(logits) or None.

    x (M, K) and w (N, K) are 16-bit with unit stride along K. `config` fixes the tile shape ({"BM", "BN", "BK",
    "num_warps", "num_stages"}) instead of autotuning: the tests use it, so the interpreter runs one small tile.
    """
    m, k = x.shape
    n = w.shape[0]
    if config is None and triton_interpreted():
        config = _INTERPRETED_CONFIG  # autotuning 128 x 256 tiles in the interpreter would take minutes
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"logits_with_lse needs unit stride along H; got x {x.stride()}, w {w.stride()}")
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    block_n = config["BN"] if config else min(c.kwargs["BN"] for c in _CONFIGS)
    # partial log-sum-exps: one column per column tile of the smallest BN, so any config's tiles fit
    parts = torch.full((2 if with_unit_temperature else 1, m, triton.cdiv(n, block_n)), float("-inf"),
                       dtype=torch.float32, device=x.device)  # fmt: skip
    args = (
        x, w, bias if bias is not None else out, out, parts[0], parts[-1],
        m, n, k, x.stride(0), w.stride(0), out.stride(0), parts.stride(1),
        1.0 / temperature, float(softcap or 1.0),
    )  # fmt: skip
    flags = dict(
        HAS_BIAS=bias is not None, CAP=softcap is not None, WITH_UNIT=with_unit_temperature,
        UPCAST=triton_interpreted() and x.dtype != torch.float32,
    )  # fmt: skip
    if config:
        meta = {key: config[key] for key in ("BM", "BN", "BK")}
        grid = (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)
        _logits_lse_kernel[grid](
            *args, **flags, EVEN_K=k % meta["BK"] == 0, **meta,
            num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 2),
        )  # fmt: skip
    else:
        grid = lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)  # noqa: E731
        _tuned_kernel[grid](*args, **flags, EVEN_K=k % 64 == 0)
    # columns a config with a wider BN did not write stay -inf and add nothing
    lse = torch.logsumexp(parts, dim=-1)
    return LogitsWithLse(out, lse[0], lse[1] if with_unit_temperature else None)
