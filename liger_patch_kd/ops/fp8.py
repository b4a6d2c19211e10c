"""FP8 (e4m3) products for a frozen teacher: rowwise-scaled quantisation and `torch._scaled_mm`.

A product y = x Wᵀ runs as y = (x₈ Wᵀ₈) · sₓ sᵂᵀ, where x₈ = x / sₓ with one scale per token (row of x, computed
from the row's absolute maximum as it arrives: "dynamic") and W₈ = W / sᵂ with one scale per output channel (row
of W, computed once). e4m3 keeps 3 mantissa bits: a relative rounding error of at most 2⁻⁴ per element, which
averages out over the K-long dot product.

Quantising an activation is a separate pass over it; in eager PyTorch (abs, amax, divide, clamp, cast) it costs
about what the FP8 product saves. Here it is one Triton pass (read the row, write a byte per
element and one scale), and after the gated activation it is fused into that kernel, so the MLP's wide
intermediate is never written in bf16.

Accumulation: Hopper's FP8 tensor cores keep a product's running sums with fewer bits than fp32, so by default
cuBLASLt moves them into fp32 registers every few K-steps. `fast_accum=True` skips that promotion
(`use_fast_accum` of `torch._scaled_mm`): faster, with an accumulation error that grows with K
(benchmarks/loss/probe_fp8_accum.py measures both at the 8B teacher's shapes). The CPU product ignores the flag.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

from .backend import select_backend, triton_available
from .rms_norm import check_casting, norm_output_dtype, norm_warps, rms_norm_torch
from .swiglu import ACTIVATIONS, gated_act_torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
SCALE_FLOOR = 1e-12  # an all-zero row gets this scale (and zeros), not a division by zero


def fp8_available(device: torch.device) -> tuple[bool, str]:
    """(whether `device` runs FP8 products, why not). CUDA needs compute capability 8.9 (Ada) or 9.0+ (Hopper);
    the CPU runs `_scaled_mm` too (slowly: for tests and small models), or, where torch's CPU product refuses
    rowwise scales (2.11), the same product of the dequantised operands (fp8_linear)."""
    if not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_mm"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            return False, f"{name} (compute capability {major}.{minor}) has no FP8 tensor cores; 8.9+ (Ada, Hopper)"
    elif device.type != "cpu":
        return False, f"FP8 products are not available on {device.type}"
    return True, ""  # the CPU: torch's own product where it takes rowwise scales, else the dequantised one


log = logging.getLogger(__name__)
_EMULATION_SAID: set[str] = set()  # device types whose emulated FP8 was reported (once per process)


def note_if_emulated(device: torch.device, what: str) -> None:
    """Say once per process, when FP8 is asked of a device without FP8 tensor cores (the CPU: fp8_available lets it
    run, for tests and small models), that the products are emulated: the maths of FP8, none of its speed."""
    if device.type == "cuda" or device.type in _EMULATION_SAID:
        return
    _EMULATION_SAID.add(device.type)
    log.warning(
        "fp8 emulated on %s: no speed-up (%s rounds as FP8 would, in products without FP8 tensor cores; those need "
        "a CUDA GPU of compute capability 8.9+, Ada or Hopper)", device.type, what,
    )  # fmt: skip


_CPU_ROWWISE: list[bool] = []  # whether this torch's CPU _scaled_mm takes rowwise scales, probed once


def cpu_takes_rowwise_scales() -> bool:
    """Whether `torch._scaled_mm` on the CPU takes one scale per row (torch >= 2.13 does; 2.11 refuses with a
    RuntimeError): asked of the product itself once, not read from the version string."""
    if not _CPU_ROWWISE:
        a = torch.zeros(16, 16, dtype=FP8_DTYPE)
        try:
            torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
            _CPU_ROWWISE.append(True)
        except RuntimeError:
            _CPU_ROWWISE.append(False)
    return _CPU_ROWWISE[0]


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x₈, s) with x ≈ x₈ · s[:, None]: one fp32 scale per row of the 2-D `x`, the reference."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1).clamp_min(SCALE_FLOOR) / FP8_MAX
    return (x32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def gated_act_quantized_torch(gate_up: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(gate) * up quantised per row, from the (M, 2I) output of the fused gate/up product."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return quantize_rows_torch(gated_act_torch(gate, up, activation))


class LastOnThisThread(threading.local):
    """The last value computed from an activation on this thread (for one `owner`), while the activation is alive
    and unchanged: q, k and v (or gate and up when they are separate) are called on the same tensor one after
    another, and quantise it, or run their shared product, once; a norm that quantised its own output leaves the
    quantised rows here for the products that read it. A change through `.data` bypasses the version counter and
    is not seen; under torch.inference_mode (no version counters) nothing is reused, each product computes its own."""

    ref: weakref.ref | None = None
    version: int = -1
    owner: object = None
    value: object = None

    def lookup(self, x: torch.Tensor, owner: object = None):
        if x.is_inference():  # no version counter to tell an in-place change: nothing is reused
            return None
        if self.ref is not None and self.ref() is x and self.version == x._version and self.owner is owner:
            return self.value
        return None

    def remember(self, x: torch.Tensor, value: object, owner: object = None) -> None:
        if x.is_inference():
            return
        self.ref = weakref.ref(x, lambda _: self.forget())  # the bytes go when the activation goes
        self.version, self.owner, self.value = x._version, owner, value

    def forget(self) -> None:
        self.ref, self.owner, self.value = None, None, None


QUANTIZED_INPUTS = LastOnThisThread()  # an activation's (e4m3 rows, scales), for the FP8 products that read it


if triton_available():
    import triton
    import triton.language as tl

    from .rms_norm import rms_norm_row
    from .swiglu import act_and_grad

    @triton.jit
    def _store_quantized(y_ptr, scale_ptr, row, stride_y, x, cols, mask, FP8_MAX: tl.constexpr, FLOOR: tl.constexpr):
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), FLOOR) / FP8_MAX
        q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
        tl.store(y_ptr + row * stride_y + cols, q.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, y_ptr, scale_ptr, stride_x, stride_y, K,
        FP8_MAX: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """One row per program, held whole in registers (up to 32 per thread at 32k columns): read once, a byte per
        element out."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        _store_quantized(y_ptr, scale_ptr, row, stride_y, x, cols, mask, FP8_MAX, FLOOR)

    @triton.jit
    def _gated_quantized_kernel(
        gu_ptr, y_ptr, scale_ptr, stride_gu, stride_y, width,
        GELU: tl.constexpr, FP8_MAX: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """act(gate) * up for one row of the fused product's output [gate | up], quantised on the way out."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < width
        g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + width + cols, mask=mask, other=0.0).to(tl.float32)
        act, _ = act_and_grad(g, GELU)
        _store_quantized(y_ptr, scale_ptr, row, stride_y, act * u, cols, mask, FP8_MAX, FLOOR)


    @triton.jit
    def _rms_norm_quantized_kernel(
        x_ptr, w_ptr, y_ptr, q_ptr, scale_ptr, stride_x, stride_y, stride_q, H, eps, offset,
        CAST_LAST: tl.constexpr, FP8_MAX: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """RMSNorm of one row (ops/rms_norm.py's arithmetic) written in its dtype, and that written row quantised:
        the FP8 products that read the norm's output find it quantised, with no pass of their own over it."""
        row = tl.program_id(0).to(tl.int64)
        y, _, cols, mask = rms_norm_row(x_ptr, w_ptr, row, stride_x, H, eps, offset, CAST_LAST, BLOCK)
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * stride_y + cols, y, mask=mask)
        _store_quantized(q_ptr, scale_ptr, row, stride_q, y.to(tl.float32), cols, mask, FP8_MAX, FLOOR)


def _launch_rowwise(kernel, x: torch.Tensor, width: int, **meta) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0]
    out = torch.empty((rows, width), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(width)
    if rows:
        kernel[(rows,)](x, out, scale, x.stride(0), out.stride(0), width, FP8_MAX=FP8_MAX, FLOOR=SCALE_FLOOR,
                        BLOCK=block, num_warps=max(4, min(32, block // 512)), **meta)  # fmt: skip
    return out, scale


def quantize_rows(x: torch.Tensor, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x₈ contiguous e4m3, fp32 scale per row) of a 2-D `x` whose rows are contiguous."""
    if select_backend(x.device, backend) == "torch":
        return quantize_rows_torch(x)
    return _launch_rowwise(_quantize_rows_kernel, x, x.shape[1])


def gated_act_quantized(
    gate_up: torch.Tensor, activation: str, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """act(gate) * up quantised per row, from the (M, 2I) output [gate | up] of the fused gate/up product."""
    if select_backend(gate_up.device, backend) == "torch":
        return gated_act_quantized_torch(gate_up, activation)
    return _launch_rowwise(_gated_quantized_kernel, gate_up, gate_up.shape[1] // 2, GELU=ACTIVATIONS[activation] == 1)


def rms_norm_quantized(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0, casting: str = "llama",
    backend: str | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(y, (y₈, s)): `ops.rms_norm(x, ...)` for inference (no autograd) and its output quantised per row, exactly
    as `quantize_rows(y.reshape(-1, H))` would give it, in one pass on the GPU."""
    check_casting(casting)
    hidden = x.shape[-1]
    if select_backend(x.device, backend) == "torch":
        y = rms_norm_torch(x, weight, eps, offset, casting)
        return y, quantize_rows_torch(y.reshape(-1, hidden))
    x2 = x.reshape(-1, hidden)
    rows = x2.shape[0]
    y = torch.empty((rows, hidden), dtype=norm_output_dtype(x.dtype, weight.dtype, casting), device=x.device)
    q = torch.empty((rows, hidden), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(hidden)
    if rows:
        _rms_norm_quantized_kernel[(rows,)](
            x2, weight, y, q, scale, x2.stride(0), y.stride(0), q.stride(0), hidden, float(eps), float(offset),
            CAST_LAST=casting != "llama", FP8_MAX=FP8_MAX, FLOOR=SCALE_FLOOR, BLOCK=block,
            num_warps=norm_warps(block),
        )  # fmt: skip
    return y.reshape(x.shape), (q, scale)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W₈, one scale per output channel) of an (N, K) weight: done once, when the teacher is quantised."""
    return quantize_rows_torch(weight.detach())


def fp8_linear(
    x8: torch.Tensor,
    x_scale: torch.Tensor,
    w8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """(x₈ W₈ᵀ) · sₓ sᵂᵀ (+ bias) in bf16, accumulated in fp32 by `torch._scaled_mm` (rowwise scales need a bf16
    output on CUDA); `fast_accum`: without the periodic fp32 promotion (see the module's docstring). The bias is
    added after the product: not every torch release takes one with rowwise scales. On a CPU whose torch refuses
    rowwise scales (2.11) the same product is taken from the dequantised operands in fp32: e4m3 values and their
    pairwise products are exact in fp32, so only the order of the fp32 sums differs."""
    if x8.device.type == "cpu" and not cpu_takes_rowwise_scales():
        y = ((x8.float() @ w8.float().t()) * x_scale[:, None] * w_scale[None, :]).to(torch.bfloat16)
    else:
        y = torch._scaled_mm(
            x8, w8.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :], out_dtype=torch.bfloat16,
            use_fast_accum=fast_accum,
        )  # fmt: skip
    return y if bias is None else y + bias
