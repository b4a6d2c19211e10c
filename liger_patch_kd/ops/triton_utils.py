"""Triton helpers the kernels share."""

import torch
import triton
import triton.language as tl

from .backend import triton_interpreted

try:  # grid dependency control (Triton 3.3 and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


def acc_type(dtype: torch.dtype):
    """The kernels' arithmetic type: fp32 for 16- and 32-bit inputs, fp64 for fp64 inputs (tests, references)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def fp32_pair(value: float) -> tuple[float, float]:
    """(hi, lo), both exact float32 values, with hi + lo = value to ~2^-48 relative: a Python float reaches a
    compiled kernel as a float32 argument (the interpreter keeps it float64), so a float64 kernel given 1/T alone
    would scale by 1/T rounded to 2^-24, and agree with a float64 reference to ~1e-7 only on the GPU."""
    hi = float(torch.tensor(value, dtype=torch.float32))
    return hi, float(torch.tensor(value - hi, dtype=torch.float32))


def dependent_launch_supported(device: torch.device) -> bool:
    """Programmatic dependent launch (`launch_pdl=True`, `await_prior_grids` in the kernel): compiled for a GPU of
    compute capability 9.0 or later, with a Triton that has grid dependency control."""
    return (device.type == "cuda" and not triton_interpreted() and gdc_wait is not None
            and torch.cuda.get_device_capability(device)[0] >= 9)  # fmt: skip


def dependent_launch_options(dependent: bool, device: torch.device) -> dict:
    """A launch's keywords for a kernel taking a PDL meta-parameter (await_prior_grids): launched as a programmatic
    dependent where `dependent` and the GPU supports it, as a plain launch elsewhere."""
    if dependent and dependent_launch_supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def await_prior_grids(PDL: tl.constexpr):
    """In a kernel launched as a programmatic dependent (PDL): wait until the kernels before it have finished and
    their writes are visible, then let the next kernel launch (it waits in turn before reading anything). The
    kernel's first statement: before any load (an earlier kernel may still be writing it) and any store (an earlier
    kernel may still read the memory a store reuses)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def scale_exact(x, hi, lo, PAIR: tl.constexpr):
    """x * (hi + lo) where PAIR (float64 rows: both halves of fp32_pair), x * hi otherwise (float32 rows, where lo
    is below their precision): the hottest kernel (JSD) pays no extra multiply-add for exact float64 tests. The
    slot (top-k, sampled) and mixture kernels pass PAIR=True whatever the dtype (one extra multiply-add)."""
    y = x * hi
    if PAIR:
        y = y + x * lo
    return y


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


# ------------------------------------------------------------------- what the slot kernels (top-k, sampled) share
@triton.jit
def row_lse(zs_row, V, inv_hi, inv_lo, cap_s, CAP_S: tl.constexpr, HAS_HARD: tl.constexpr,
            UNIT_TEMP: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    """Pass V1 of a row: (log-sum-exp of the capped logits at T, scaled by 1/T = inv_hi + inv_lo; the same at
    T = 1 for the CE term, which is the first when T = 1 or there is no CE term)."""
    acc_ty = zs_row.dtype.element_ty
    cv = tl.arange(0, BLOCK_V)
    m_s = tl.full([BLOCK_V], float("-inf"), acc_ty)
    d_s = tl.zeros([BLOCK_V], acc_ty)
    m_1, d_1 = m_s, d_s
    for off in range(0, V, BLOCK_V):
        mask = off + cv < V
        x = softcap(tl.load(zs_row + off + cv, mask=mask, other=0.0), cap_s, CAP_S)
        m_s, d_s = online_lse_update(m_s, d_s, tl.where(mask, scale_exact(x, inv_hi, inv_lo, True), float("-inf")))
        if HAS_HARD and not UNIT_TEMP:
            m_1, d_1 = online_lse_update(m_1, d_1, tl.where(mask, x, float("-inf")))
    lse_s = lse_finish(m_s, d_s)
    lse_1 = lse_s
    if HAS_HARD and not UNIT_TEMP:
        lse_1 = lse_finish(m_1, d_1)
    return lse_s, lse_1


@triton.jit
def row_label_and_ce(zs_row, labels_ptr, hard_ptr, row, lse_1, ignore_index, V, cap_s, CAP_S: tl.constexpr,
                     HAS_HARD: tl.constexpr):  # fmt: skip
    """(the row's label, whether it counts), and with HAS_HARD its CE term lse_1 - x_label stored at hard_ptr[row].
    A label outside [0, V) (only reachable with check_inputs=False) counts as ignored: never read out of the row."""
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid_row = (label != ignore_index) & (label >= 0) & (label < V)
    if HAS_HARD:
        x_label = softcap(tl.load(zs_row + tl.where(valid_row, label, 0)), cap_s, CAP_S)
        tl.store(hard_ptr + row, tl.where(valid_row, lse_1 - x_label, 0.0))
    return label, valid_row


@triton.jit
def finish_grad(grad, x, cols, label, valid_row, w_hard, lse_1, cap_s, HAS_HARD: tl.constexpr, CAP_S: tl.constexpr):
    """A tile of dLoss/dlogits from its weighted KD part: plus the CE gradient w_hard (softmax_1 - onehot(label))
    at columns `cols`, then through the soft-cap (d c tanh(z / c) / dz = 1 - (x / c)^2 with x the capped logit)."""
    if HAS_HARD:
        grad += w_hard * (tl.exp(x - lse_1) - tl.where((cols == label) & valid_row, 1.0, 0.0))
    if CAP_S:
        grad = grad * (1.0 - (x / cap_s) * (x / cap_s))
    return grad
