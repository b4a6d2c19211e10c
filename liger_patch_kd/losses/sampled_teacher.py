"""`fused_linear_sampled_kd`: distillation from tokens sampled from the teacher (Sparse Logit Sampling,
arXiv 2503.16870), straight from hidden states; the twin of `reference.sampled_kd_loss`. The estimate of forward
KL and its gradient are unbiased for the full-vocabulary ones (see reference.sampled_kd_per_row for why, and why
beta > 0 is refused). Runs through the row-chunk loop that `fused_linear_topk_kd` uses."""

from __future__ import annotations

from typing import Any

import torch

from ..config import KDLossConfig
from ..conventions import computed_columns, require_sampled_objective, resolve_vocab
from ..ops import fused_linear_sampled_kd as sampled_op
from ..ops.backend import eager, select_backend
from .checks import (
    check_linear,
    check_topk_shapes,
    counted_rows,
    flatten_labels,
    has_duplicate_ids,
    label_check,
    logprob_checks,
    loss_config,
    run_device_checks,
    topk_checks,
    zero_rows,
)
from .docs import args_section, shared_docs
from .fused import KDLossOutput, check_fp8_request, run_fused

__all__ = ["fused_linear_sampled_kd"]


SAMPLED_DEFAULT = KDLossConfig(beta=0.0)  # forward KL: the only divergence the draws estimate without bias


def bytes_per_logit(backend: str) -> int:
    """What a chunk holds per logit: the Triton kernel fp32 logits and a 16-bit gradient (6); the PyTorch chunk
    also a log-softmax and its exp, both fp32, and the gradient before its cast (16)."""
    return 6 if backend == "triton" else 16


def check_sample_shapes(ids, counts, logprobs, leading: torch.Size) -> None:
    if not (ids.shape == counts.shape == logprobs.shape):
        raise ValueError(
            f"teacher_sample_ids {tuple(ids.shape)}, teacher_sample_counts {tuple(counts.shape)} and "
            f"teacher_sample_logprobs {tuple(logprobs.shape)} must have one shape (one slot per distinct drawn id)"
        )
    if ids.shape[:-1] != leading:
        raise ValueError(
            f"teacher_sample_ids rows {tuple(ids.shape[:-1])} do not match the student's rows {tuple(leading)}; "
            f"they are row-aligned like logits"
        )
    if ids.dtype.is_floating_point or counts.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(
            f"teacher_sample_ids and teacher_sample_counts must be integers; got {ids.dtype} and {counts.dtype}"
        )


def sample_checks(ids, counts, logprobs, counted, vocab: int, has_topk: bool):
    """(device flag, message) pairs for the draws of the rows that count."""
    present = (ids >= 0) & (counts > 0) & counted[:, None]
    draws = torch.where(present, counts, 0).sum(-1)
    checks = [
        ((present & (ids >= vocab)).any(), lambda: f"teacher_sample_ids holds ids >= the vocab size {vocab}"),
        ((counts < 0).any(), lambda: "teacher_sample_counts holds negative counts; a count is a number of draws"),
        *logprob_checks("teacher_sample_logprobs", logprobs, present),
        (
            (present & (logprobs == -torch.inf)).any(),
            lambda: "teacher_sample_logprobs is -inf on a drawn id: the teacher cannot have drawn it; fix the data",
        ),
    ]
    if not has_topk:
        checks.append(
            (
                (counted & (draws == 0)).any(),
                lambda: (
                    "a row that counts has no teacher draws (every count 0): its teacher data are missing; "
                    "give it ignore_index as label, or regenerate the samples"
                ),
            )
        )
    return checks


@eager
@shared_docs(
    args=args_section(
        "student_input", "student_weight", "teacher_sample_ids", "teacher_sample_counts", "teacher_sample_logprobs",
        "labels", "hybrid_topk", "num_items_in_batch", "student_bias", "sampled_config", "return_components",
        "check_inputs", "backend",
    )
)  # fmt: skip
def fused_linear_sampled_kd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_sample_ids: torch.Tensor,
    teacher_sample_counts: torch.Tensor,
    teacher_sample_logprobs: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    teacher_token_ids: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    config: KDLossConfig | None = None,
    return_components: bool = False,
    check_inputs: bool = True,
    backend: str | None = None,
    **options: Any,
) -> torch.Tensor | KDLossOutput:
    """Forward KL(P_T || S_T) estimated from teacher draws, straight from hidden states and the lm_head weight.

    Equals `reference.sampled_kd_loss(student_input @ student_weight.T + student_bias, ids, counts, logprobs,
    labels, config, topk_ids=teacher_token_ids, topk_logprobs=teacher_logprobs)`. The student is normalised over
    its full vocabulary inside the chunk loop; over the draws the loss and its gradient are unbiased for the
    full-vocabulary forward KL at temperature T, provided the draws were made from the teacher at T (the data's
    log-probs are at T and are not re-tempered). beta defaults to 0 and must stay 0 (reverse KL and the JSD have
    no usable unbiased sampled form). Ignored rows are never read.

    Args:
{args}

    Returns:
{returns_loss}
    """
    cfg = loss_config("fused_linear_sampled_kd", config, options, default=SAMPLED_DEFAULT)
    require_sampled_objective(cfg)
    check_linear("student", student_input, student_weight, student_bias)
    check_fp8_request(cfg, student_input, None, no_teacher_product="sampled teacher tokens have no product")
    vocab = resolve_vocab(student_weight.shape[0], None, cfg.vocab_size)
    columns = computed_columns(vocab, [student_weight.shape[0]], [cfg.softcap], cfg.temperature)
    leading = student_input.shape[:-1]
    check_sample_shapes(teacher_sample_ids, teacher_sample_counts, teacher_sample_logprobs, leading)
    has_topk = teacher_token_ids is not None
    if has_topk != (teacher_logprobs is not None):
        raise ValueError("the hybrid needs both teacher_token_ids and teacher_logprobs (or neither, for draws alone)")
    if has_topk:
        check_topk_shapes(teacher_token_ids, teacher_logprobs, leading, vocab)
    flat_labels = flatten_labels(labels, leading, student_input.device, cfg)
    device, j = student_input.device, teacher_sample_ids.shape[-1]
    ids = teacher_sample_ids.reshape(-1, j).to(device)
    counts = teacher_sample_counts.reshape(-1, j).to(device)
    logprobs = teacher_sample_logprobs.reshape(-1, j).to(device).detach()
    top_ids = top_lp = None
    if has_topk:
        k = teacher_token_ids.shape[-1]
        top_ids = teacher_token_ids.reshape(-1, k).to(device)
        top_lp = teacher_logprobs.reshape(-1, k).to(device).detach()
    counted = counted_rows(flat_labels, labels, cfg)
    acc = torch.float64 if student_input.dtype == torch.float64 else torch.float32
    # rows that do not count hold no slots: never read, whatever they hold (NaN included)
    slots = sampled_op.sampled_slots(
        zero_rows(ids, counted, -1), zero_rows(counts, counted, 0), zero_rows(logprobs, counted, 0.0),
        None if top_ids is None else zero_rows(top_ids, counted, -1),
        None if top_lp is None else zero_rows(top_lp, counted, -torch.inf), acc,
    )  # fmt: skip
    if check_inputs:
        checks = sample_checks(ids, counts, logprobs, counted, vocab, has_topk)
        if has_topk:
            checks += topk_checks(top_ids, top_lp, counted, vocab)[:3]
        checks.append(
            (
                has_duplicate_ids(slots[0], slots[0] >= 0),
                lambda: (
                    "a row repeats a teacher id among its draws (or between its draws and its top-k): give each "
                    "distinct id one slot with its count, and draw the hybrid's samples from outside its top-k"
                ),
            )
        )
        if labels is not None:
            checks.append(label_check(flat_labels, vocab, cfg))
        run_device_checks(checks)

    def teacher_chunk(_logits_dtype: torch.dtype):
        def rows(start: int, end: int, active: torch.Tensor):
            return tuple(t[start:end] for t in slots)

        return rows

    return run_fused(
        student_input, student_weight, student_bias, flat_labels, cfg, num_items_in_batch, backend,
        return_components, vocab=vocab, columns=columns, teacher_chunk=teacher_chunk,
        kernels=sampled_op.CHUNK_KERNELS, bytes_per_logit=bytes_per_logit(select_backend(device, backend)),
    )  # fmt: skip
