"""FP8 (e4m3) logit products inside the fused loss's chunk loop: the opt-in `teacher_logits_fp8` and
`student_logits_fp8` of KDLossConfig.

A chunk's logits z = h Wᵀ (+ b) run as (h₈ W₈ᵀ) · s_h s_Wᵀ through `torch._scaled_mm` (ops/fp8.py): the lm_head
weight quantised with one scale per vocabulary row, the chunk's hidden rows with one scale per row, the product
accumulated in fp32. The weight is quantised once per call, or once for as long as it is unchanged when it is
frozen (a teacher's head: the quantised copy is kept on the weight tensor and is thrown away when the tensor's
data pointer or version counter moves, i.e. after any in-place update such as an optimizer step or
`load_state_dict`; a change made through `.data` bypasses the version counter, see `forget_quantized_head`).

What the rounding does: e4m3 keeps 3 mantissa bits, so each operand element is off by at most 2⁻⁴ of itself
(round to nearest; plus half a subnormal step, 2⁻¹⁰ of the row's scale, for elements below 2⁻⁶ of the scale).
A logit then moves by at most |δz| ≤ (2·2⁻⁴ + 2⁻⁸) Σₖ |hₖ Wₖ| (the worst case, signs aligned); with independent
roundings of mean 0 it moves by about 2⁻⁴ · sqrt(2/3 · Σₖ hₖ² Wₖ²), i.e. the worst case averaged down by
~sqrt(H). On CUDA the rowwise product may only write bf16, which adds 2⁻⁹ |z|.

The backward stays bf16 / fp32: the gradient products (dL/dz · W and dL/dzᵀ · h) use the unquantised operands.
With the student's product in FP8 the forward's logits are the quantised ones, so the gradient is dL/dz taken at
the FP8 logits, chained through the bf16 head (a straight-through estimator of the rounding): not the exact
gradient of either the bf16 loss or the FP8 loss, off from the bf16 gradient by first order in δz.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .fp8 import FP8_DTYPE, cpu_takes_rowwise_scales, fp8_available, note_if_emulated, quantize_rows

_CACHE_ATTR = "__liger_kd_fp8_head__"
_ALIGN = 16  # torch._scaled_mm on CUDA wants every dimension of both operands a multiple of 16
_OUT_DTYPE: dict[str, torch.dtype] = {}  # per device type: the output dtype its rowwise FP8 product accepts


def require_fp8(device: torch.device, option: str) -> None:
    """A one-line ValueError naming `option` when `device` cannot run FP8 products."""
    ok, why = fp8_available(device)
    if not ok:
        raise ValueError(f"{option}=True needs FP8 products, which are not available here: {why}; set {option}=False")
    note_if_emulated(device, f"{option}'s logit product")


def check_fp8_hidden(hidden_size: int, option: str) -> None:
    if hidden_size % _ALIGN:
        raise ValueError(
            f"{option}=True needs a hidden size that is a multiple of {_ALIGN} (torch._scaled_mm); got hidden size "
            f"{hidden_size}; set {option}=False"
        )


@dataclass(frozen=True)
class QuantizedHead:
    """The first `columns` rows of an lm_head weight in e4m3, one fp32 scale per row, padded with zero rows to a
    multiple of 16 rows."""

    weight: torch.Tensor  # (columns rounded up to 16, H) e4m3
    scale: torch.Tensor  # (same,) fp32
    columns: int


def _key(weight: torch.Tensor, columns: int) -> tuple:
    return (weight.data_ptr(), weight._version, tuple(weight.shape), weight.stride(), weight.dtype, columns)


def quantize_head(weight: torch.Tensor, columns: int, *, keep: bool) -> QuantizedHead:
    """`weight[:columns]` quantised per row. `keep`: cache the result on `weight` (for a frozen head); a cached copy
    is reused only while the weight is unchanged (same data pointer and version counter)."""
    key = _key(weight, columns)
    cached = getattr(weight, _CACHE_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    rows = weight.detach()[:columns]
    padded = -(-columns // _ALIGN) * _ALIGN
    if padded != columns:
        rows = torch.cat([rows, rows.new_zeros(padded - columns, rows.shape[1])])
    w8, scale = quantize_rows(rows.contiguous())
    head = QuantizedHead(w8, scale, columns)
    if keep:
        setattr(weight, _CACHE_ATTR, (key, head))
    elif cached is not None:
        forget_quantized_head(weight)  # a stale copy would only hold memory
    return head


def forget_quantized_head(weight: torch.Tensor) -> None:
    """Drop the quantised copy cached on `weight` (needed only after a change through `.data`)."""
    if hasattr(weight, _CACHE_ATTR):
        delattr(weight, _CACHE_ATTR)


def _scaled_product(x8, x_scale, head: QuantizedHead, keep_bf16: bool) -> torch.Tensor:
    """(x₈ W₈ᵀ) · s_x s_Wᵀ in fp32 where the device's rowwise product writes fp32, else in bf16 then fp32."""
    device_type = x8.device.type
    if device_type == "cpu" and not cpu_takes_rowwise_scales():  # torch 2.11: the dequantised product (ops/fp8.py)
        return (x8.float() @ head.weight.float().t()) * x_scale[:, None] * head.scale[None, :]

    def product(out_dtype):
        return torch._scaled_mm(
            x8, head.weight.t(), scale_a=x_scale[:, None], scale_b=head.scale[None, :], out_dtype=out_dtype
        )

    if device_type not in _OUT_DTYPE:
        try:
            out = product(torch.float32)
            _OUT_DTYPE[device_type] = torch.float32
            return out
        except RuntimeError:  # e.g. "only bf16 high precision output types are supported for row-wise scaling"
            _OUT_DTYPE[device_type] = torch.bfloat16
    out = product(_OUT_DTYPE[device_type])
    return out if out.dtype == torch.float32 or keep_bf16 else out.float()


def fp8_output_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype this device's FP8 logit product writes (known after its first call; None before)."""
    return _OUT_DTYPE.get(device.type)


def fp8_logits(
    hidden: torch.Tensor, head: QuantizedHead, bias: torch.Tensor | None, *, keep_bf16: bool = False
) -> torch.Tensor:
    """hidden Wᵀ (+ bias), (rows, columns) fp32 (fp64 for fp64 hidden states), from `head` and the hidden rows
    quantised here, one scale per row. `keep_bf16`: where the device's product writes bf16, return that (the
    Triton loss kernel reads bf16 teacher logits): no fp32 copy of the chunk, a third less memory traffic."""
    rows = hidden.shape[0]
    padded = -(-rows // _ALIGN) * _ALIGN
    x = hidden if padded == rows else torch.cat([hidden, hidden.new_zeros(padded - rows, hidden.shape[1])])
    x8, x_scale = quantize_rows(x.contiguous())
    out = _scaled_product(x8, x_scale, head, keep_bf16)
    if padded != rows or out.shape[1] != head.columns:
        out = out[:rows, : head.columns]  # row slices stay contiguous; a column slice keeps its row stride
    if hidden.dtype == torch.float64:
        out = out.double()
    if bias is not None:
        out += bias.to(out.dtype)
    return out


class Fp8Product:
    """A chunk loop's student product (the `logits_fp32(hidden, weight, bias)` signature) through a head quantised
    once per call."""

    def __init__(self, weight: torch.Tensor, columns: int):
        self.head = quantize_head(weight, columns, keep=False)

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if weight.shape[0] != self.head.columns:
            raise ValueError(f"the quantised head has {self.head.columns} rows; the chunk loop uses {weight.shape[0]}")
        return fp8_logits(hidden, self.head, bias)


def dequantized(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x₈ · s per row in float64: what the FP8 product multiplies, exactly (for tests and error reports)."""
    assert x8.dtype == FP8_DTYPE
    return x8.double() * scale.double()[:, None]
