"""The front doors: functional losses and their nn.Module twins, dispatching to Triton on CUDA and to the
PyTorch chunk math elsewhere. Nothing here knows about models."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import nn

from .config import KDLossConfig
from .ops.backend import select_backend
from .ops.chunked import ChunkPlan, FusedLinearKDFunction, choose_chunk_size
from .ops.backend import logits_fp32
from .ops import fused_linear_jsd as jsd_op


class KDLossOutput(NamedTuple):
    loss: torch.Tensor  # soft_weight * soft + hard_weight * hard, differentiable
    soft: torch.Tensor  # the KD term alone (detached), same reduction
    hard: torch.Tensor  # the CE term alone (detached; zeros when hard_weight == 0)


def _check_linear(role: str, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2:
        raise ValueError(f"{role}_weight must be (vocab, hidden); got shape {tuple(weight.shape)}")
    if hidden.dim() < 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{role}_input has hidden size {hidden.shape[-1] if hidden.dim() else None} (shape {tuple(hidden.shape)}) "
            f"but {role}_weight expects {weight.shape[1]} (shape {tuple(weight.shape)}); pass the last hidden states "
            f"of the model that owns this lm_head"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{role}_bias must have shape ({weight.shape[0]},) to match {role}_weight; got {tuple(bias.shape)}")


def _check_labels(labels: torch.Tensor | None, leading: torch.Size) -> None:
    if labels is not None and labels.shape != leading:
        raise ValueError(
            f"labels must have the leading shape of the hidden states {tuple(leading)}; got {tuple(labels.shape)}. "
            f"Shift labels HF style (labels[..., 1:] padded with ignore_index) rather than slicing the hidden states"
        )


def _compute_dtype(device: torch.device, hidden: torch.Tensor) -> torch.dtype:
    """Under autocast the products run in the autocast dtype, as nn.Linear's would; otherwise in the dtype of
    the hidden states (a weight of another dtype, e.g. fp32 master weights, is cast to it)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return hidden.dtype


def _row_weight(labels: torch.Tensor, cfg: KDLossConfig, num_items_in_batch, dtype: torch.dtype) -> torch.Tensor:
    """Each row's share of the reduction (0 for ignored rows), float32 (float64 for float64 inputs).
    No host sync: the count stays on the device."""
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    valid = (labels != cfg.ignore_index).to(dtype)
    if cfg.reduction != "batchmean":
        return valid
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(device=labels.device, dtype=dtype)
        return valid / num_items_in_batch
    return valid / valid.sum().clamp(min=1.0)


def _flatten_labels(labels: torch.Tensor | None, leading: torch.Size, device: torch.device, cfg: KDLossConfig):
    _check_labels(labels, leading)
    if labels is None:
        if cfg.hard_weight:
            raise ValueError("hard_weight > 0 needs labels for the cross-entropy term; pass labels or set hard_weight=0")
        return torch.zeros(leading.numel(), dtype=torch.long, device=device)
    return labels.reshape(-1).to(device)


def _no_autocast(device: torch.device):
    return torch.autocast(device.type, enabled=False) if device.type in ("cuda", "cpu") else contextlib.nullcontext()


@torch.compiler.disable  # a clean graph break: the chunk loop and Triton launches stay eager under torch.compile
def fused_linear_jsd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    num_items_in_batch: int | torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    soft_weight: float = 1.0,
    hard_weight: float = 0.0,
    softcap: float | None = None,
    teacher_softcap: float | None = None,
    chunk_size: int | None = None,
    fp32_weight_grad: bool = False,
    config: KDLossConfig | None = None,
    return_components: bool = False,
    backend: str | None = None,
) -> torch.Tensor | KDLossOutput:
    """Generalized-JSD distillation loss straight from last hidden states and lm_head weights.

    Equals `reference.kd_loss(student_input @ student_weight.T + student_bias, teacher_input @ teacher_weight.T
    + teacher_bias, labels, config)` without ever holding more than one chunk of (rows x V) logits.
    Inputs are (N, H) or (B, T, H) with labels of the leading shape, row-aligned (shift labels, not hidden
    states). Student and teacher hidden sizes may differ; vocab sizes may not. Gradients flow to the student
    input, weight and bias only. `config` (a KDLossConfig) replaces the loss keywords when given.
    Returns the loss (a scalar, or the leading shape for reduction="none"), or KDLossOutput with
    return_components=True. `backend` forces "triton" or "torch" (default: Triton on CUDA).
    """
    cfg = config or KDLossConfig(
        beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction, soft_weight=soft_weight,
        hard_weight=hard_weight, softcap=softcap, teacher_softcap=teacher_softcap, chunk_size=chunk_size,
        fp32_weight_grad=fp32_weight_grad,
    )  # fmt: skip
    _check_linear("student", student_input, student_weight, student_bias)
    _check_linear("teacher", teacher_input, teacher_weight, teacher_bias)
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"student vocab ({student_weight.shape[0]}, student_weight {tuple(student_weight.shape)}) differs from "
            f"teacher vocab ({teacher_weight.shape[0]}, teacher_weight {tuple(teacher_weight.shape)}); distillation "
            f"compares distributions over one vocabulary. Resize the embeddings to one size (padding rows the teacher "
            f"never predicts) or map the tokenizers first"
        )
    leading = student_input.shape[:-1]
    if teacher_input.shape[:-1] != leading:
        raise ValueError(
            f"teacher_input rows {tuple(teacher_input.shape[:-1])} do not match student_input rows {tuple(leading)}; "
            f"row i of the student is scored against row i of the teacher"
        )
    device = student_input.device
    flat_labels = _flatten_labels(labels, leading, device, cfg)
    dtype = _compute_dtype(device, student_input)
    h_s = student_input.reshape(-1, student_input.shape[-1]).to(dtype)
    h_t = teacher_input.reshape(-1, teacher_input.shape[-1]).to(dtype).detach()
    w_s = student_weight.to(dtype)
    w_t = teacher_weight.detach().to(dtype)
    b_t = None if teacher_bias is None else teacher_bias.detach()
    chosen = select_backend(device, backend)
    kernel = jsd_op.CHUNK_KERNELS[chosen]
    vocab = w_s.shape[0]
    rows = cfg.chunk_size or choose_chunk_size(h_s.shape[0], vocab, device, bytes_per_logit=8)  # fp32 student and teacher logits; the grad reuses the teacher's
    plan = ChunkPlan(
        teacher_chunk=lambda start, end: logits_fp32(h_t[start:end], w_t, b_t),
        kernel=lambda *args: kernel(*args, cfg),
        chunk_size=rows,
        reduction=cfg.reduction,
        soft_weight=cfg.soft_weight,
        hard_weight=cfg.hard_weight,
        fp32_weight_grad=cfg.fp32_weight_grad,
    )
    with _no_autocast(device):
        loss, soft, hard = FusedLinearKDFunction.apply(
            h_s, w_s, student_bias, flat_labels, _row_weight(flat_labels, cfg, num_items_in_batch, dtype), plan
        )
    if cfg.reduction == "none":
        loss, soft, hard = (t.reshape(leading) for t in (loss, soft, hard))
    return KDLossOutput(loss, soft, hard) if return_components else loss


class FusedLinearJSDLoss(nn.Module):
    """Module form of `fused_linear_jsd`: the loss options go to the constructor (or a KDLossConfig)."""

    def __init__(self, config: KDLossConfig | None = None, **options) -> None:
        super().__init__()
        self.config = KDLossConfig.build(config, **options)

    def forward(
        self,
        student_input: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_input: torch.Tensor,
        teacher_weight: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        student_bias: torch.Tensor | None = None,
        teacher_bias: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        return_components: bool = False,
    ) -> torch.Tensor | KDLossOutput:
        return fused_linear_jsd(
            student_input, student_weight, teacher_input, teacher_weight, labels,
            student_bias=student_bias, teacher_bias=teacher_bias, num_items_in_batch=num_items_in_batch,
            config=self.config, return_components=return_components,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return repr(self.config)
