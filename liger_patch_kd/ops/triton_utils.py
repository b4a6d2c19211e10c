"""Triton helpers the kernels share."""

import torch
import triton
import triton.language as tl


def acc_type(dtype: torch.dtype):
    """The kernels' arithmetic type: fp32 for 16- and 32-bit inputs, fp64 for fp64 inputs (tests, references)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def fp32_pair(value: float) -> tuple[float, float]:
    """(hi, lo), both exact float32 values, with hi + lo = value to ~2^-48 relative: a Python float reaches a
    compiled kernel as a float32 argument (the interpreter keeps it float64), so a float64 kernel given 1/T alone
    would scale by 1/T rounded to 2^-24, and agree with a float64 reference to ~1e-7 only on the GPU."""
    hi = float(torch.tensor(value, dtype=torch.float32))
    return hi, float(torch.tensor(value - hi, dtype=torch.float32))


@triton.jit
def scale_by_pair(x, hi, lo):
    """x * (hi + lo) in x's precision (float64 stays float64; float32 pays one multiply-add)."""
    return x * hi + x * lo


@triton.jit
def tanh(x):
    """tanh without a tanh intrinsic: (1 - e) / (1 + e) with e = exp(-2|x|) <= 1, sign restored. The exponent is
    never positive, so nothing overflows (exp(2x) did, harmlessly on a GPU, with a warning when interpreted)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def softcap(x, c, CAP: tl.constexpr):
    if CAP:
        x = c * tanh(x / c)
    return x


@triton.jit
def online_lse_update(m_vec, d_vec, x):
    """Lane-wise online log-sum-exp: (running max, running sum of exp(x - max)) with x folded in."""
    new = tl.maximum(m_vec, x)
    safe = tl.where(new == float("-inf"), 0.0, new)  # lanes that have seen only -inf stay at (−inf, 0)
    d_vec = d_vec * tl.exp(m_vec - safe) + tl.exp(x - safe)
    return new, d_vec


@triton.jit
def lse_finish(m_vec, d_vec):
    """log-sum-exp from the lane-wise state; -inf when every value was -inf (an empty set)."""
    m = tl.max(m_vec, axis=0)
    empty = m == float("-inf")
    m_safe = tl.where(empty, 0.0, m)
    total = tl.sum(d_vec * tl.exp(m_vec - m_safe), axis=0)  # >= 1 unless empty
    # log(1) on an empty set, then -inf: no log(0) evaluated (the interpreter warns on it)
    return tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
