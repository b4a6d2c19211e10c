"""x @ W.T + b for the few rows of a decode step, in Triton: each weight streamed once, and a gated MLP's gate/up
product with its activation in the same launch.

A decode step multiplies 8 to 64 rows by every weight of the model once: each product is bound by reading its
weight, not by its arithmetic, and a short one by its launch and ramp-up. Timed one product at a time against
cuBLAS at a 1B Llama's shapes (benchmarks/onpolicy/probe_few_row_linear.py), this kernel reads the wide weights
(the head; gate/up) as fast or faster and the narrow ones (q/k/v, o, down) slower: the decode step takes it where
MIN_OUT_FEATURES says, and for the gated MLP's gate and up (few_row_gated, mlp_fusion.py), where it also saves the
activation's own launch and the round trip of the gate/up output.

Each program holds BLOCK_N rows of the weight (two weights' for the gated kernel) and streams them over K in
software-pipelined tiles, multiplies the step's rows (padded to 16, the least M of a tensor-core product) by each
tile and rounds the float32 sums once into the output, as cuBLAS does. No split of K: a program's sum is one
running sum, the same bits at every step and launch, and no second kernel reduces. `launch_config` picks the tiles
by shape, from the probe's sweep.

`linear(x, weight, bias)` is what the decode engine's projections call (fused_projections.py): the kernel where
`applies` says so (a decode step inside `decode_kernel()`, gradients off, at most FEW_ROWS rows, a 16-bit dtype on a
GPU, the weight's rows contiguous) and the product is wide enough, F.linear elsewhere.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.backend import select_backend, triton_available, triton_interpreted
from ..ops.swiglu import ACTIVATIONS, gated_act_torch
from .decode_attention import kernel_wanted
from .dependent_launch import dependent_launch

FEW_ROWS = 64  # at most this many rows take the kernel (padded to a power of two from 16, the least M of a
# tensor-core product)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # what the kernel computes in
GPU_DTYPES = (torch.bfloat16, torch.float16)  # what a decode step takes it for on a GPU: the dtypes measured
# Which products of a decode step take the kernel: those with at least MIN_OUT_FEATURES output features (a gated
# MLP's gate/up counted as one product of twice its intermediate size). Timed one by one against cuBLAS at a 1B
# Llama's shapes (docs/benchmarks.md, "The few-row product again"), the kernel was faster on the head and as fast
# on gate/up, slower on q/k/v, o and down: the wide products take it, and the gated MLP drops its activation's
# launch with it (mlp_fusion.py).
MIN_OUT_FEATURES = 8192


if triton_available():
    import triton
    import triton.language as tl

    from ..ops.swiglu import act_and_grad
    from ..ops.triton_utils import acc_type, await_prior_grids, dependent_launch_options

    TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
                 torch.float64: tl.float64}  # fmt: skip

    @triton.jit
    def _tile(ptrs, lane_ok, k, K, start, EVEN_K: tl.constexpr):
        """One BLOCK_K-wide tile of x or of the weight, zeros past K and in the lanes not `lane_ok`."""
        if EVEN_K:
            return tl.load(ptrs, mask=lane_ok[:, None], other=0.0)
        return tl.load(ptrs, mask=lane_ok[:, None] & (k < K - start)[None, :], other=0.0)

    @triton.jit
    def _accumulate(acc, x, w, ACC: tl.constexpr, UPCAST: tl.constexpr):
        if UPCAST:  # the interpreter's 16-bit products are wrong: the same inputs, their product in float32
            x = x.to(ACC)
            w = w.to(ACC)
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee", out_dtype=ACC)

    @triton.jit
    def _rounded(x, DTYPE: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr):
        """x rounded to DTYPE (to nearest, ties to even) and back to ACC: a product's output as a later kernel
        reads it. The interpreter's casts to bfloat16 truncate: there the rounding is done on the bits."""
        if UPCAST and DTYPE == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True).to(ACC)
        return x.to(DTYPE).to(ACC)

    @triton.jit
    def _few_row_kernel(
        x_ptr, w_ptr, w2_ptr, b_ptr, out_ptr,
        rows, N, K,
        stride_xm, stride_wn, stride_w2n, stride_om,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, GELU: tl.constexpr, DTYPE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        ACC: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """out[:, n0:n0 + BLOCK_N] = x @ W[n0:n0 + BLOCK_N].T (+ b): the program's weight rows read once, in
        BLOCK_K-wide tiles, their products summed in ACC in K order. GATED: act(x @ W.T) * (x @ W2.T), each
        product rounded to the output dtype first, as the unfused products hand them to the activation kernel
        (ops/swiglu.py), whose arithmetic this is. PDL: launched as a programmatic dependent of the kernel before
        (ops.triton_utils.await_prior_grids)."""
        await_prior_grids(PDL)
        row = tl.arange(0, BLOCK_M).to(tl.int64)  # x may be rows of a longer prefill: offsets past 2**31
        col = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        row_ok = row < rows
        col_ok = col < N
        x_tile = x_ptr + row[:, None] * stride_xm + k[None, :]
        w_tile = w_ptr + col[:, None] * stride_wn + k[None, :]
        w2_tile = w2_ptr + col[:, None] * stride_w2n + k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC)
        for start in range(0, K, BLOCK_K):
            x = _tile(x_tile, row_ok, k, K, start, EVEN_K)
            acc = _accumulate(acc, x, _tile(w_tile, col_ok, k, K, start, EVEN_K), ACC, UPCAST)
            if GATED:
                acc2 = _accumulate(acc2, x, _tile(w2_tile, col_ok, k, K, start, EVEN_K), ACC, UPCAST)
            x_tile += BLOCK_K
            w_tile += BLOCK_K
            w2_tile += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + col, mask=col_ok, other=0.0).to(ACC)[None, :]
        if GATED:
            act, _ = act_and_grad(_rounded(acc, DTYPE, ACC, UPCAST), GELU)
            acc = act * _rounded(acc2, DTYPE, ACC, UPCAST)
        if UPCAST:  # rounded to nearest here: the interpreter's store to bfloat16 truncates
            acc = _rounded(acc, DTYPE, ACC, UPCAST)
        out = out_ptr + row[:, None] * stride_om + col[None, :]
        tl.store(out, acc.to(DTYPE), mask=row_ok[:, None] & col_ok[None, :])


def launch_config(rows: int, n: int, k: int, element_size: int, device: torch.device, weights: int = 1) -> dict:
    """BLOCK_N, BLOCK_K, warps and stages for a (rows x k) @ (k x n) product, as the tile sweep on an H100 ranked
    them (benchmarks/onpolicy/probe_few_row_linear.py, at 8 and 64 rows): wide products (an MLP's gate/up, a head)
    in 64-row tiles of the weight, 3 stages; long ones (down: K several times N) in 16-row tiles, so that N = 2048
    still makes 128 programs; the rest in 32-row tiles, 5 stages; tiles 256 wide from K = 8192 up, else 128. BLOCK_K
    is cut to what two stages of one weight's tiles need in shared memory, the stages to what `weights` weights'
    tiles leave (the gated kernel reads two). BLOCK_K depends on K alone (where shared memory allows): the order
    of each output's sum, so that the gated kernel's products are the bits of the plain kernel's over the gate/up
    copy."""
    if n >= 8192:
        block_n, stages = 64, 3
    elif k >= 4 * n:
        block_n, stages = 16, 5
    else:
        block_n, stages = 32, 5
    block_k = 256 if k >= 8192 else 128
    budget, padded_rows = shared_memory_bytes(device), max(16, triton.next_power_of_2(rows))
    while block_k > 32 and 2 * (padded_rows + block_n) * block_k * element_size > budget:  # two stages at least
        block_k //= 2
    stages = max(1, min(stages, budget // ((padded_rows + weights * block_n) * block_k * element_size)))
    # the gated kernel's two accumulators past 16 rows spill at 4 warps and not at 8 (compiled for sm_90 by Triton
    # 3.9: at 64 rows 255 registers and 72 bytes of spill, against 128 and none); the decode step fuses at most
    # mlp_fusion.FUSED_ROWS rows, so this serves few_row_gated's own callers until a step at 64 rows is timed
    warps = 8 if weights == 2 and padded_rows > 16 else 4
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}


def shared_memory_bytes(device: torch.device) -> int:
    """What one program may hold in shared memory on `device`, less 8 KiB for the kernel's own (Ampere's smallest,
    99 KiB, off a GPU)."""
    budget = 99 << 10
    if device.type == "cuda":
        budget = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", budget)
    return budget - (8 << 10)


def refusal(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why few_row_linear cannot compute F.linear(x, weight, bias) (None: it can)."""
    if not triton_available():
        return "needs triton: pip install triton"
    tensors = {"x": x, "weight": weight} | ({} if bias is None else {"bias": bias})
    odd = {name: type(t).__name__ for name, t in tensors.items() if type(t) not in (torch.Tensor, nn.Parameter)}
    if odd:  # a quantized weight's subclass, a tracer's fake tensor: its storage is no plain matrix
        return f"takes plain tensors; got {odd}"
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return f"takes x (..., K) and weight (N, K); got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    if x.dtype not in DTYPES or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return (f"takes one float dtype for x, weight and bias; got {x.dtype}, {weight.dtype}, "
                f"{None if bias is None else bias.dtype}")  # fmt: skip
    if bias is not None and bias.shape != (weight.shape[0],):
        return f"takes bias (N,) = ({weight.shape[0]},); got {tuple(bias.shape)}"
    if math.prod(x.shape[:-1]) > FEW_ROWS:
        return f"takes at most {FEW_ROWS} rows; got {math.prod(x.shape[:-1])} (x {tuple(x.shape)})"
    strides = {name: t.stride(-1) for name, t in tensors.items() if t.stride(-1) != 1}
    if strides:
        return f"reads K (and the bias) as contiguous: stride 1 in the last dim wanted; got {strides} (.contiguous())"
    devices = {name: str(t.device) for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        return f"takes x, weight and bias on one device; got {devices}"
    if x.device.type != "cuda" and not triton_interpreted():
        return f"runs on CUDA tensors (or any under TRITON_INTERPRET=1); got {x.device.type} tensors"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors.values()):
        return "computes no gradient: call it under torch.no_grad() (or use F.linear)"
    return None


def few_row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: dict | None = None,
    dependent: bool = False,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for at most FEW_ROWS rows of x (its leading dims flattened), through the kernel;
    a one-line ValueError where it cannot (`refusal`). `config`: launch_config's keys, to time others; `dependent`:
    launched as a programmatic dependent of the kernel before it (Hopper and later; ignored elsewhere)."""
    reason = refusal(x, weight, bias)
    if reason is not None:
        raise ValueError(f"few_row_linear {reason}")
    return launch(x, weight, bias=bias, config=config, dependent=dependent)


def few_row_gated(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    up_weight: torch.Tensor,
    activation: str = "silu",
    config: dict | None = None,
    dependent: bool = False,
) -> torch.Tensor:
    """act(F.linear(x, gate_weight)) * F.linear(x, up_weight) in one launch, each product rounded to x's dtype
    before the activation (ops.swiglu.gated_act's arithmetic on the two products' outputs); activation one of
    ops.swiglu.ACTIVATIONS. A one-line ValueError where it cannot (`gated_refusal`)."""
    reason = gated_refusal(x, gate_weight, up_weight, activation)
    if reason is not None:
        raise ValueError(f"few_row_gated {reason}")
    return launch(x, gate_weight, up_weight, activation=activation, config=config, dependent=dependent)


def gated_refusal(x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, activation: str) -> str | None:
    """Why few_row_gated cannot compute act(x @ gate_weight.T) * (x @ up_weight.T) (None: it can)."""
    if activation not in ACTIVATIONS:
        return f"takes activation one of {sorted(ACTIVATIONS)}; got {activation!r}"
    if gate_weight.shape != up_weight.shape or gate_weight.dtype != up_weight.dtype:
        return (f"takes gate and up weights of one shape and dtype; got {tuple(gate_weight.shape)} "
                f"{gate_weight.dtype}, {tuple(up_weight.shape)} {up_weight.dtype}")  # fmt: skip
    return refusal(x, gate_weight, None) or refusal(x, up_weight, None)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    up_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    config: dict | None = None,
    dependent: bool = False,
) -> torch.Tensor:
    """The kernel's launch, unchecked: F.linear(x, weight, bias), or with `up_weight` the gated product, for inputs
    that `refusal` (`gated_refusal`) passed. Each entry point checks once and calls it: few_row_linear and
    few_row_gated (a ValueError on a refusal), linear and gated_step (the decode step's, F.linear or None
    elsewhere)."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), k)
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out.reshape(*lead, n)
    if k == 0:  # an empty sum
        if up_weight is not None:
            zero = x.new_zeros(rows, n)
            return gated_act_torch(zero, zero, activation).reshape(*lead, n)
        return (bias if bias is not None else x.new_zeros(n)).expand(rows, n).clone().reshape(*lead, n)
    gated = up_weight is not None
    config = config or launch_config(rows, n, k, x.element_size(), x.device, weights=2 if gated else 1)
    second = up_weight if gated else weight
    _few_row_kernel[(triton.cdiv(n, config["BLOCK_N"]),)](
        x2, weight, second, weight if bias is None else bias, out,
        rows, n, k,
        x2.stride(0), weight.stride(0), second.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % config["BLOCK_K"] == 0, GATED=gated,
        GELU=gated and ACTIVATIONS[activation] == 1, DTYPE=TL_DTYPES[x.dtype],
        BLOCK_M=max(16, triton.next_power_of_2(rows)), ACC=acc_type(x.dtype), UPCAST=triton_interpreted(),
        **config, **dependent_launch_options(dependent, x.device),
    )  # fmt: skip
    return out.reshape(*lead, n)


def step_applies(x: torch.Tensor) -> bool:
    """Whether a product of x would take the kernel at this point, whatever its weight: a decode step (inside
    decode_kernel(), gradients off) on a device the project's kernels run on, in the dtype F.linear would compute in
    (under autocast: the autocast dtype, or float64, which autocast leaves alone); on a GPU in 16 bits (GPU_DTYPES: a
    float32 product through the kernel is neither measured nor free of register spills; the interpreter runs every
    dtype, so that CPU tests check the kernel's sums in float64)."""
    if not kernel_wanted() or torch.is_grad_enabled() or select_backend(x.device) != "triton":
        return False
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and x.dtype not in (torch.get_autocast_dtype(kind), torch.float64):
        return False
    return kind != "cuda" or x.dtype in GPU_DTYPES


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` takes the kernel for a product of any width: `step_applies`, and what few_row_linear takes."""
    return step_applies(x) and refusal(x, weight, bias) is None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the few-row kernel at a decode step's few rows (`applies`) for the products of at least
    MIN_OUT_FEATURES output features."""
    if weight.shape[0] >= MIN_OUT_FEATURES and applies(x, weight, bias):  # the width first: the cheap question
        return launch(x, weight, bias=bias, dependent=dependent_launch(x.device))
    return F.linear(x, weight, bias)


def gated_step(
    x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, activation: str
) -> torch.Tensor | None:
    """act(x @ gate_weight.T) * (x @ up_weight.T) through the gated kernel where a decode step takes it (gate and up
    counted as one product of twice the width against MIN_OUT_FEATURES, `step_applies`, what few_row_gated takes);
    None elsewhere, for the caller to compute its own way."""
    if 2 * gate_weight.shape[0] < MIN_OUT_FEATURES or not step_applies(x):
        return None
    if gated_refusal(x, gate_weight, up_weight, activation) is not None:
        return None
    return launch(x, gate_weight, up_weight, activation=activation, dependent=dependent_launch(x.device))
