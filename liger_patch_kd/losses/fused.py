"""The fused front doors: `fused_linear_jsd` (a live teacher's hidden states and lm_head) and
`fused_linear_topk_kd` (teacher top-k log-probs); their nn.Module twins are in modules.py. Both dispatch to
Triton on CUDA and to the PyTorch chunk math elsewhere, through ops.chunked's row-chunk loop. Nothing here knows
about models."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from ..config import KDLossConfig, require_full_teacher
from ..conventions import column_bias, computed_columns, resolve_vocab
from ..ops import fused_linear_jsd as jsd_op
from ..ops import fused_linear_topk_kd as topk_op
from ..ops.backend import compute_dtype, eager, logits_fp32, no_autocast, select_backend
from ..ops.chunked import ChunkPlan, FusedLinearKDFunction, plan_chunk_rows
from ..ops.fp8_logits import Fp8Product, check_fp8_hidden, fp8_logits, quantize_head, require_fp8
from .checks import (
    check_linear,
    check_num_items,
    check_topk_shapes,
    counted_rows,
    flatten_labels,
    label_check,
    loss_config,
    run_device_checks,
    topk_checks,
    zero_rows,
)
from .docs import args_section, shared_docs
from .sampled import sampled_token_kd

__all__ = ["KDLossOutput", "fused_linear_jsd", "fused_linear_topk_kd"]


class KDLossOutput(NamedTuple):
    """What a fused loss returns with return_components=True."""

    loss: torch.Tensor  # soft_weight * soft + hard_weight * hard, differentiable
    soft: torch.Tensor  # the KD term alone (detached), same reduction
    hard: torch.Tensor  # the CE term alone (detached; zeros when hard_weight == 0)


def _row_weight(labels: torch.Tensor, cfg: KDLossConfig, num_items_in_batch, dtype: torch.dtype) -> torch.Tensor:
    """Each row's share of the reduction (0 for ignored rows), float32 (float64 for float64 inputs).
    No host sync: the count stays on the device. No items at all (num_items_in_batch == 0, which the Trainer
    passes for a micro-batch whose labels are all ignored) gives every row weight 0: loss 0, zero gradients."""
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    valid = (labels != cfg.ignore_index).to(dtype)
    if cfg.reduction != "batchmean":
        return valid
    if num_items_in_batch is None:
        return valid / valid.sum().clamp(min=1.0)
    check_num_items(num_items_in_batch)
    count = torch.as_tensor(num_items_in_batch, dtype=dtype, device=labels.device)
    return valid * torch.where(count > 0, 1 / count, 0)  # 1 / 0 = inf is never selected


def check_fp8_request(
    cfg: KDLossConfig, student_input: torch.Tensor, teacher_input: torch.Tensor | None, *, no_teacher_product: str = ""
) -> None:
    """The FP8 options refused up front, with the reason, where the device or the shapes cannot run them, or where
    the loss has no teacher product to quantise (`no_teacher_product` says why): the flag would do nothing."""
    if cfg.teacher_logits_fp8 and no_teacher_product:
        raise ValueError(
            f"teacher_logits_fp8=True puts a teacher model's logit product in FP8; {no_teacher_product}: set "
            f"teacher_logits_fp8=False (kd_teacher_logits_fp8 in KDTrainingArguments; student_logits_fp8 applies)"
        )
    for option, on, x in (
        ("student_logits_fp8", cfg.student_logits_fp8, student_input),
        ("teacher_logits_fp8", cfg.teacher_logits_fp8, teacher_input),
    ):
        if on and x is not None:
            require_fp8(x.device, option)
            check_fp8_hidden(x.shape[-1], option)


def run_fused(
    student_input, student_weight, student_bias, flat_labels, cfg: KDLossConfig, num_items_in_batch, backend,
    return_components, *, vocab, teacher_chunk, kernels, bytes_per_logit, grouped_bytes_per_logit=None, columns=None,
    row_scale=None,
):  # fmt: skip
    """What the fused losses share: dtype policy, row weights, chunking and the autograd call. The full weight
    and bias go in (autograd then hands back a full-size gradient without a copy); the chunks see [:vocab].
    `row_scale` (N,): each row's share of the loss, multiplied into its row weight (KD and CE terms alike).
    `bytes_per_logit` / `grouped_bytes_per_logit`: what a chunk holds per logit on its own / with its gradient in
    a group (None: the kernels cannot write into one; ops.chunked.plan_chunk_rows)."""
    leading = student_input.shape[:-1]
    device = student_input.device
    dtype = compute_dtype(device, student_input)
    h_s = student_input.reshape(-1, student_input.shape[-1]).to(dtype)
    w_s = student_weight.to(dtype)
    kernel = kernels[select_backend(device, backend)]
    rows, grad_rows = plan_chunk_rows(
        h_s.shape[0], vocab, device, bytes_per_logit, grouped_bytes_per_logit, h_s.element_size(), cfg.chunk_size,
        cfg.grad_chunk_size, cfg.fp32_weight_grad,
        needs_grad=torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                   for t in (student_input, student_weight, student_bias)),
    )  # fmt: skip
    student_product = None
    if cfg.student_logits_fp8:  # the head quantised once per call: the student's weight changes every step
        student_product = Fp8Product(w_s, vocab if columns is None else columns)
    plan = ChunkPlan(
        teacher_chunk=teacher_chunk(torch.float64 if dtype == torch.float64 else torch.float32),
        kernel=lambda *args, **out: kernel(*args, cfg, **out),
        chunk_size=rows,
        grad_rows=grad_rows,
        vocab=vocab,
        columns=columns,
        temperature=cfg.temperature,
        reduction=cfg.reduction,
        soft_weight=cfg.soft_weight,
        hard_weight=cfg.hard_weight,
        fp32_weight_grad=cfg.fp32_weight_grad,
        student_product=student_product,
    )
    row_weight = _row_weight(flat_labels, cfg, num_items_in_batch, dtype)
    if row_scale is not None:
        row_weight = row_weight * row_scale.reshape(-1).to(row_weight.dtype)
    with no_autocast(device):
        loss, soft, hard = FusedLinearKDFunction.apply(h_s, w_s, student_bias, flat_labels, row_weight, plan)
    if cfg.reduction == "none":
        loss, soft, hard = (t.reshape(leading) for t in (loss, soft, hard))
    return KDLossOutput(loss, soft, hard) if return_components else loss


@eager  # a clean graph break: the chunk loop and Triton launches stay eager under torch.compile
@shared_docs(
    args=args_section(
        "student_input", "student_weight", "teacher_input", "teacher_weight", "labels", "num_items_in_batch",
        "student_bias", "teacher_bias", "config", "behaviour_logprobs", "return_components", "check_inputs",
        "backend",
    )
)  # fmt: skip
def fused_linear_jsd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    config: KDLossConfig | None = None,
    behaviour_logprobs: torch.Tensor | None = None,
    return_components: bool = False,
    check_inputs: bool = True,
    backend: str | None = None,
    **options: Any,
) -> torch.Tensor | KDLossOutput:
    """Generalized-JSD distillation loss straight from last hidden states and lm_head weights.

    Equals `reference.kd_loss(student_input @ student_weight.T + student_bias, teacher_input @ teacher_weight.T
    + teacher_bias, labels, config)` without ever holding more than one chunk of (rows x V) logits. The two heads
    must have one size unless `vocab_size` says how many leading rows are real tokens (rows viewed, not copied;
    the student's weight-gradient rows past it are 0). Each model's logits come from its own dtype's product (the
    autocast dtype under autocast), in fp32. Ignored rows are never read: NaN or inf in their hidden states
    touches neither the loss nor a gradient. `check_inputs` validates the labels (ignore_index or a real id)
    when a label names a class (vocab_size or hard_weight set).

    Args:
{args}

    Returns:
{returns_loss}
    """
    cfg = loss_config("fused_linear_jsd", config, options)
    check_linear("student", student_input, student_weight, student_bias)
    check_linear("teacher", teacher_input, teacher_weight, teacher_bias)
    check_fp8_request(cfg, student_input, teacher_input)
    vocab = resolve_vocab(student_weight.shape[0], teacher_weight.shape[0], cfg.vocab_size)
    columns = computed_columns(
        vocab, [student_weight.shape[0], teacher_weight.shape[0]], [cfg.softcap, cfg.teacher_softcap], cfg.temperature
    )
    leading = student_input.shape[:-1]
    if teacher_input.shape[:-1] != leading:
        raise ValueError(
            f"teacher_input rows {tuple(teacher_input.shape[:-1])} do not match student_input rows {tuple(leading)}; "
            f"row i of the student is scored against row i of the teacher"
        )
    flat_labels = flatten_labels(labels, leading, student_input.device, cfg)
    if behaviour_logprobs is not None and cfg.estimator != "pg":
        raise ValueError(
            f"behaviour_logprobs importance-correct the sampled-token policy gradient: set estimator='pg' (got "
            f"{cfg.estimator!r})"
        )
    if cfg.estimator is not None:  # the sampled-token estimators: one label per row, not the whole vocabulary
        loss, soft, hard = sampled_token_kd(
            student_input, student_weight, student_bias, teacher_input, teacher_weight, teacher_bias, flat_labels,
            cfg, num_items_in_batch, vocab, behaviour_logprobs=behaviour_logprobs,
        )  # fmt: skip
        return KDLossOutput(loss, soft, hard) if return_components else loss
    if check_inputs and labels is not None and (cfg.vocab_size is not None or cfg.hard_weight):
        run_device_checks([label_check(flat_labels, vocab, cfg)])
    # the teacher's product in its own dtype: casting a bf16 teacher to an fp16 student's dtype overflows at 65504
    teacher_dtype = compute_dtype(teacher_input.device, teacher_input)
    h_t = teacher_input.detach().reshape(-1, teacher_input.shape[-1]).to(teacher_dtype)
    b_t = column_bias(None if teacher_bias is None else teacher_bias.detach(), vocab, columns, cfg.temperature, h_t)
    if cfg.teacher_logits_fp8:  # quantised once, and kept while a frozen head is unchanged (ops/fp8_logits.py)
        head = quantize_head(teacher_weight, columns, keep=not teacher_weight.requires_grad)
        keep_bf16 = select_backend(h_t.device, backend) == "triton"  # the Triton kernel reads bf16 teacher logits

        def product(hidden: torch.Tensor) -> torch.Tensor:
            return fp8_logits(hidden, head, b_t, keep_bf16=keep_bf16)
    else:
        w_t = teacher_weight.detach()[:columns].to(teacher_dtype)

        def product(hidden: torch.Tensor) -> torch.Tensor:
            return logits_fp32(hidden, w_t, b_t)

    def teacher_chunk(logits_dtype: torch.dtype):
        def logits(start: int, end: int, active: torch.Tensor) -> torch.Tensor:
            z = product(zero_rows(h_t[start:end], active))
            return z if z.dtype == torch.bfloat16 else z.to(logits_dtype)  # bf16 only from an FP8 product kept so

        return logits

    return run_fused(
        student_input,
        student_weight,
        student_bias,
        flat_labels,
        cfg,
        num_items_in_batch,
        backend,
        return_components,
        vocab=vocab,
        columns=columns,
        teacher_chunk=teacher_chunk,
        kernels=jsd_op.CHUNK_KERNELS,
        bytes_per_logit=8,  # fp32 student and teacher logits; the gradient reuses the teacher's storage
        grouped_bytes_per_logit=8,  # the same, the gradient in its group
    )


@eager
@shared_docs(
    args=args_section(
        "student_input", "student_weight", "teacher_token_ids", "teacher_logprobs", "labels", "num_items_in_batch",
        "student_bias", "config", "return_components", "check_inputs", "backend",
    )
)  # fmt: skip
def fused_linear_topk_kd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_token_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    config: KDLossConfig | None = None,
    return_components: bool = False,
    check_inputs: bool = True,
    backend: str | None = None,
    **options: Any,
) -> torch.Tensor | KDLossOutput:
    """Distillation against precomputed teacher log-probs, straight from hidden states and the lm_head weight.

    Equals `reference.topk_kd_loss(student_input @ student_weight.T + student_bias, ids, logprobs, labels,
    config)`. The student is normalised over its full vocabulary (ids [0, vocab_size) when `vocab_size` is given)
    inside the fused kernel; `tail` says what happens to the teacher mass outside the top-k (see
    reference.topk_kd_per_row). Temperature is exact within the top-k (log-probs are logits minus a constant);
    for the tail bucket with T != 1 the remaining mass is assumed spread evenly over the tokens outside the top-k.
    Ids must be unique within a row. `check_inputs` validates the rows that count (label not ignore_index): ids
    below the vocabulary and unique within a row, log-probs neither NaN nor > 0, labels ignore_index or a real id.
    Ignored rows are never read.

    Args:
{args}

    Returns:
{returns_loss}
    """
    cfg = loss_config("fused_linear_topk_kd", config, options)
    require_full_teacher(cfg)
    check_linear("student", student_input, student_weight, student_bias)
    check_fp8_request(cfg, student_input, None, no_teacher_product="top-k teacher log-probs have no product")
    vocab = resolve_vocab(student_weight.shape[0], None, cfg.vocab_size)
    # tempering top-k log-probs (T != 1) spreads the teacher's rest over the V - k tokens outside its top-k: V
    # must stay the real vocabulary there, so the columns are padded for alignment only at T = 1
    columns = vocab
    if cfg.temperature == 1.0:
        columns = computed_columns(vocab, [student_weight.shape[0]], [cfg.softcap], cfg.temperature)
    leading = student_input.shape[:-1]
    check_topk_shapes(teacher_token_ids, teacher_logprobs, leading, vocab)
    flat_labels = flatten_labels(labels, leading, student_input.device, cfg)
    k = teacher_token_ids.shape[-1]
    # contiguous at the door (a copy only for a strided or transposed view): the Triton kernel reads a row's K
    # slots at unit stride. N x K is small beside the N x V work, and a copy costs less than a stride multiply
    # on every slot load of three passes. (The per-chunk select below would not do it: torch.where keeps a
    # transposed input's layout.)
    ids = teacher_token_ids.reshape(-1, k).to(student_input.device).contiguous()
    logprobs = teacher_logprobs.reshape(-1, k).to(student_input.device).detach().contiguous()
    if check_inputs:
        counted = counted_rows(flat_labels, labels, cfg)
        label_checks = [label_check(flat_labels, vocab, cfg)] if labels is not None else []
        run_device_checks(topk_checks(ids, logprobs, counted, vocab) + label_checks)

    def teacher_chunk(_logits_dtype: torch.dtype):
        def slots(start: int, end: int, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # rows that do not count become rows without teacher data: never read, whatever they hold
            return zero_rows(ids[start:end], active, -1), zero_rows(logprobs[start:end], active, -math.inf)

        return slots

    return run_fused(
        student_input,
        student_weight,
        student_bias,
        flat_labels,
        cfg,
        num_items_in_batch,
        backend,
        return_components,
        vocab=vocab,
        columns=columns,
        teacher_chunk=teacher_chunk,
        kernels=topk_op.CHUNK_KERNELS,
        bytes_per_logit=6,  # fp32 student logits and a bf16 gradient
        grouped_bytes_per_logit=4,  # fp32 student logits, the gradient in its group
    )
