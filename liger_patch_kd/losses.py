"""The front doors: functional losses and their nn.Module twins, dispatching to Triton on CUDA and to the
PyTorch chunk math elsewhere. Nothing here knows about models."""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch
from torch import nn

from . import reference
from .config import KDLossConfig
from .ops import fused_linear_jsd as jsd_op
from .ops import fused_linear_topk_kd as topk_op
from .ops.backend import logits_fp32, select_backend
from .ops.chunked import ChunkPlan, FusedLinearKDFunction, choose_chunk_size


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
        raise ValueError(
            f"{role}_bias must have shape ({weight.shape[0]},) to match {role}_weight; got {tuple(bias.shape)}"
        )


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
    reference.require_labels_for_hard_term(cfg, labels)
    if labels is None:
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
    h_t = teacher_input.reshape(-1, teacher_input.shape[-1]).detach()
    w_t = teacher_weight.detach()
    b_t = None if teacher_bias is None else teacher_bias.detach()
    return _run_fused(
        student_input,
        student_weight,
        student_bias,
        labels,
        cfg,
        num_items_in_batch,
        backend,
        return_components,
        teacher_chunk=lambda dtype: _teacher_logits_source(h_t.to(dtype), w_t.to(dtype), b_t),
        kernels=jsd_op.CHUNK_KERNELS,
        bytes_per_logit=8,  # fp32 student and teacher logits; the gradient reuses the teacher's storage
    )


def _teacher_logits_source(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Teacher logits of rows [start, end), from operands already cast once to the compute dtype."""
    return lambda start, end: logits_fp32(hidden[start:end], weight, bias)


def _run_fused(
    student_input, student_weight, student_bias, labels, cfg: KDLossConfig, num_items_in_batch, backend,
    return_components, *, teacher_chunk, kernels, bytes_per_logit,
):  # fmt: skip
    """What both fused losses share: flattening, dtype policy, row weights, chunking and the autograd call."""
    leading = student_input.shape[:-1]
    device = student_input.device
    flat_labels = _flatten_labels(labels, leading, device, cfg)
    dtype = _compute_dtype(device, student_input)
    h_s = student_input.reshape(-1, student_input.shape[-1]).to(dtype)
    w_s = student_weight.to(dtype)
    kernel = kernels[select_backend(device, backend)]
    rows = cfg.chunk_size or choose_chunk_size(h_s.shape[0], w_s.shape[0], device, bytes_per_logit=bytes_per_logit)
    plan = ChunkPlan(
        teacher_chunk=teacher_chunk(dtype),
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


class _ConfiguredLoss(nn.Module):
    """The loss options go to the constructor (a KDLossConfig and/or its fields), the tensors to forward."""

    def __init__(self, config: KDLossConfig | None = None, **options) -> None:
        super().__init__()
        self.config = KDLossConfig.build(config, **options)

    def extra_repr(self) -> str:
        return repr(self.config)


class FusedLinearJSDLoss(_ConfiguredLoss):
    """Module form of `fused_linear_jsd`."""

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


@torch.compiler.disable
def fused_linear_topk_kd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_token_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    tail: str = "bucket",
    ignore_index: int = -100,
    reduction: str = "batchmean",
    num_items_in_batch: int | torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    soft_weight: float = 1.0,
    hard_weight: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    fp32_weight_grad: bool = False,
    config: KDLossConfig | None = None,
    return_components: bool = False,
    check_inputs: bool = True,
    backend: str | None = None,
) -> torch.Tensor | KDLossOutput:
    """Distillation against precomputed teacher log-probs, straight from hidden states and the lm_head weight.

    teacher_token_ids / teacher_logprobs: (N, K) or (B, T, K), row-aligned with the student's rows like logits
    (row t holds the teacher's top-k for the token after position t); log-probs taken at temperature 1 over
    the full vocabulary, as vLLM / SGLang return them; K may equal V (full log-probs). Padding slots (-inf,
    values <= -1000 such as vLLM's -9999, or negative ids) are ignored. Ids must be unique within a row.
    The student is normalised over its full vocabulary inside the fused kernel; `tail` says what happens to
    the teacher mass outside the top-k ("bucket", "renormalize", "none": see reference.topk_kd_per_row).
    Temperature: exact within the top-k (log-probs are logits minus a constant); for the tail bucket with
    T != 1 the remaining mass is assumed spread evenly over the tokens outside the top-k.
    Equals `reference.topk_kd_loss(student_input @ student_weight.T + student_bias, ...)`.
    `check_inputs` validates ids and log-probs on the device (one host sync); the other options are as in
    `fused_linear_jsd`.
    """
    cfg = config or KDLossConfig(
        beta=beta, temperature=temperature, tail=tail, ignore_index=ignore_index, reduction=reduction,
        soft_weight=soft_weight, hard_weight=hard_weight, softcap=softcap, chunk_size=chunk_size,
        fp32_weight_grad=fp32_weight_grad,
    )  # fmt: skip
    _check_linear("student", student_input, student_weight, student_bias)
    vocab = student_weight.shape[0]
    _check_topk(teacher_token_ids, teacher_logprobs, student_input.shape[:-1], vocab, check_inputs)
    k = teacher_token_ids.shape[-1]
    ids = teacher_token_ids.reshape(-1, k).to(student_input.device)
    logprobs = teacher_logprobs.reshape(-1, k).to(student_input.device).detach()
    return _run_fused(
        student_input,
        student_weight,
        student_bias,
        labels,
        cfg,
        num_items_in_batch,
        backend,
        return_components,
        teacher_chunk=lambda dtype: lambda start, end: (ids[start:end], logprobs[start:end]),
        kernels=topk_op.CHUNK_KERNELS,
        bytes_per_logit=6,  # fp32 student logits and a bf16 gradient
    )


class FusedLinearTopKKDLoss(_ConfiguredLoss):
    """Module form of `fused_linear_topk_kd`."""

    def forward(
        self,
        student_input: torch.Tensor,
        student_weight: torch.Tensor,
        teacher_token_ids: torch.Tensor,
        teacher_logprobs: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        student_bias: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        return_components: bool = False,
    ) -> torch.Tensor | KDLossOutput:
        return fused_linear_topk_kd(
            student_input, student_weight, teacher_token_ids, teacher_logprobs, labels, student_bias=student_bias,
            num_items_in_batch=num_items_in_batch, config=self.config, return_components=return_components,
        )  # fmt: skip


def _check_topk(ids: torch.Tensor, logprobs: torch.Tensor, leading: torch.Size, vocab: int, check_values: bool) -> None:
    if ids.shape != logprobs.shape:
        raise ValueError(
            f"teacher_token_ids {tuple(ids.shape)} and teacher_logprobs {tuple(logprobs.shape)} must have one shape"
        )
    if ids.shape[:-1] != leading:
        raise ValueError(
            f"teacher_token_ids rows {tuple(ids.shape[:-1])} do not match the student's rows {tuple(leading)}; "
            f"they are row-aligned like logits (row t: the teacher's top-k for the token after position t)"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"teacher_token_ids must be integer ids; got dtype {ids.dtype}")
    if not logprobs.dtype.is_floating_point:
        raise ValueError(f"teacher_logprobs must be floating point log-probabilities; got dtype {logprobs.dtype}")
    if ids.shape[-1] > vocab:
        raise ValueError(f"teacher_token_ids has K={ids.shape[-1]} slots per row but the vocabulary has {vocab} ids")
    if check_values and ids.numel():
        too_big, has_nan, positive = torch.stack(
            [(ids >= vocab).any(), logprobs.isnan().any(), (logprobs > 1e-3).any()]
        ).tolist()  # one host sync for all three
        if too_big:
            raise ValueError(
                f"teacher_token_ids holds ids >= the student's vocab size {vocab} (max {int(ids.max())}); the teacher "
                f"data was made with another tokenizer or vocabulary"
            )
        if has_nan:
            raise ValueError(
                "teacher_logprobs contains NaN; regenerate the teacher data (padding slots should be -inf)"
            )
        if positive:
            raise ValueError(
                "teacher_logprobs contains values > 0, so they are not log-probabilities (logits?); pass "
                "log_softmax(teacher_logits) or the log-probs an inference server returns"
            )


def kl_estimator(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    kind: str = "k3",
    mask: torch.Tensor | None = None,
    clamp: float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """On-policy estimate of KL(student || teacher) from the log-probs of tokens sampled from the student.

    k1 = log q - log p, k2 = (log q - log p)^2 / 2, k3 = exp(log p - log q) - (log p - log q) - 1 (see
    reference.kl_estimator_terms). `clamp` bounds the log-ratio to [-clamp, clamp] first (the k3 exponent can
    explode on tokens the teacher finds unlikely). `mask` (same shape, bool or 0/1) selects the tokens that
    count: the completion, not the prompt or padding. reduction: "mean" over masked tokens (0 when none),
    "sum", or "none". Gradients flow to whichever inputs require them (usually student_logprobs).
    """
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"student_logprobs {tuple(student_logprobs.shape)} and teacher_logprobs "
            f"{tuple(teacher_logprobs.shape)} must have one shape (one value per sampled token)"
        )
    if clamp is not None:
        if not clamp > 0:
            raise ValueError(f"clamp must be None or > 0; got clamp={clamp!r}")
        log_ratio = (teacher_logprobs - student_logprobs).clamp(-clamp, clamp)
        student_logprobs = teacher_logprobs - log_ratio
    terms = reference.kl_estimator_terms(student_logprobs, teacher_logprobs, kind)
    return _masked_reduce(terms, mask, reduction)


def topk_kd_from_logprobs(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    beta: float = 0.0,
    tail: str = "bucket",
    reduction: str = "mean",
) -> torch.Tensor:
    """Top-k forward KL (beta=0) / reverse KL (beta=1) / generalized JSD on student-sampled sequences, from
    log-probs an RL framework already holds: both (..., K) on the same K ids (e.g. the teacher's top-k),
    each normalised over its full vocabulary. No logits, no patch. `tail` as in `fused_linear_topk_kd`; padding
    slots (-inf in either) are ignored. `mask` (...) selects the tokens; reduction as in `kl_estimator`.
    """
    KDLossConfig(beta=beta, tail=tail)  # validates
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"student_logprobs {tuple(student_logprobs.shape)} and teacher_logprobs {tuple(teacher_logprobs.shape)} "
            f"must have one shape (..., K): both models' log-probs on the same K ids"
        )
    present = torch.isfinite(student_logprobs) & (teacher_logprobs > reference.LOGPROB_PLACEHOLDER)
    log_s = torch.where(present, student_logprobs, -math.inf)
    log_p = torch.where(present, teacher_logprobs.to(log_s.dtype), -math.inf)
    if tail == "renormalize":
        log_s = torch.where(present, log_s - torch.logsumexp(log_s, -1, keepdim=True), -math.inf)
        log_p = torch.where(present, log_p - torch.logsumexp(log_p, -1, keepdim=True), -math.inf)
    terms = reference.divergence_terms(log_s, log_p, beta, present).sum(-1)
    if tail == "bucket":
        tails = [(1 - t.exp().sum(-1)).clamp(min=reference.TAIL_FLOOR).log() for t in (log_s, log_p)]
        terms = terms + reference.divergence_terms(*tails, beta, torch.ones_like(terms, dtype=torch.bool))
    return _masked_reduce(terms, mask, reduction)


def _masked_reduce(terms: torch.Tensor, mask: torch.Tensor | None, reduction: str) -> torch.Tensor:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none'; got reduction={reduction!r}")
    if mask is not None:
        if mask.shape != terms.shape:
            raise ValueError(f"mask {tuple(mask.shape)} must have the per-token shape {tuple(terms.shape)}")
        terms = torch.where(mask.bool(), terms, torch.zeros_like(terms))
    if reduction == "none":
        return terms
    if reduction == "sum":
        return terms.sum()
    count = terms.new_tensor(terms.numel()) if mask is None else mask.sum().to(terms.dtype)
    return terms.sum() / count.clamp(min=1)
