"""The front doors: functional losses and their nn.Module twins, dispatching to Triton on CUDA and to the
PyTorch chunk math elsewhere. Nothing here knows about models."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from . import reference
from .config import KDLossConfig
from .conventions import column_bias, computed_columns, resolve_vocab, topk_valid_slots
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
    No host sync: the count stays on the device. No items at all (num_items_in_batch == 0, which the Trainer
    passes for a micro-batch whose labels are all ignored) gives every row weight 0: loss 0, zero gradients."""
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    valid = (labels != cfg.ignore_index).to(dtype)
    if cfg.reduction != "batchmean":
        return valid
    if num_items_in_batch is None:
        return valid / valid.sum().clamp(min=1.0)
    if not isinstance(num_items_in_batch, torch.Tensor) and not num_items_in_batch >= 0:
        raise ValueError(f"num_items_in_batch must be a count >= 0; got {num_items_in_batch!r}")
    count = torch.as_tensor(num_items_in_batch, dtype=dtype, device=labels.device)
    return valid * torch.where(count > 0, 1 / count, 0)  # 1 / 0 = inf is never selected


def _flatten_labels(labels: torch.Tensor | None, leading: torch.Size, device: torch.device, cfg: KDLossConfig):
    _check_labels(labels, leading)
    reference.require_labels_for_hard_term(cfg, labels)
    if labels is None:
        return torch.zeros(leading.numel(), dtype=torch.long, device=device)
    # contiguous: the Triton kernels index labels by row (a stride-2 view would be read as every other label)
    return labels.reshape(-1).to(device).contiguous()


def _label_check(flat_labels: torch.Tensor, vocab: int, cfg: KDLossConfig) -> tuple[torch.Tensor, Callable[[], str]]:
    """(device flag, message) for labels that are neither ignore_index nor a real id in [0, vocab)."""
    bad = (flat_labels != cfg.ignore_index) & ((flat_labels < 0) | (flat_labels >= vocab))

    def message() -> str:
        wrong = flat_labels[bad]
        return (
            f"labels hold {wrong.numel()} value(s) that are neither ignore_index={cfg.ignore_index} nor a token id "
            f"in [0, {vocab}) (e.g. {wrong[:4].tolist()}); set ignored positions to ignore_index, and pass "
            f"vocab_size=len(tokenizer) (or a tokenizer that matches the model)"
        )

    return bad.any(), message


def _run_device_checks(checks: list[tuple[torch.Tensor, Callable[[], str]]]) -> None:
    """Every check's flag stays on the device until one host sync reads them all; the first failure raises."""
    if not checks:
        return
    failed = torch.stack([flag for flag, _ in checks]).tolist()
    for bad, (_, message) in zip(failed, checks):
        if bad:
            raise ValueError(message())


def _zero_rows(values: torch.Tensor, keep: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """`values` with `fill` where `keep` (its leading dims) is False. A select, not a product: 0 * NaN is NaN."""
    return torch.where(keep.reshape(keep.shape + (1,) * (values.dim() - keep.dim())), values, fill)


def _config_with_vocab_size(cfg: KDLossConfig, vocab_size: int | None) -> KDLossConfig:
    if vocab_size is None or cfg.vocab_size == vocab_size:
        return cfg
    if cfg.vocab_size is not None:
        raise ValueError(
            f"vocab_size={vocab_size} was given but config.vocab_size={cfg.vocab_size}; pass one of the two"
        )
    return cfg.replace(vocab_size=vocab_size)


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
    vocab_size: int | None = None,
    config: KDLossConfig | None = None,
    return_components: bool = False,
    check_inputs: bool = True,
    backend: str | None = None,
) -> torch.Tensor | KDLossOutput:
    """Generalized-JSD distillation loss straight from last hidden states and lm_head weights.

    Equals `reference.kd_loss(student_input @ student_weight.T + student_bias, teacher_input @ teacher_weight.T
    + teacher_bias, labels, config)` without ever holding more than one chunk of (rows x V) logits.
    Inputs are (N, H) or (B, T, H) with labels of the leading shape, row-aligned (shift labels, not hidden
    states). Student and teacher hidden sizes may differ. The two heads must have one size unless `vocab_size`
    (e.g. len(tokenizer)) says how many leading rows are real tokens: both distributions and the CE term are
    then taken over ids [0, vocab_size) (rows viewed, not copied; the student's weight-gradient rows past it are
    0). Each model's logits come from its own dtype's product (the autocast dtype under autocast), in fp32.
    Ignored rows are never read: NaN or inf in their hidden states touches neither the loss nor a gradient.
    Gradients flow to the student input, weight and bias only. `config` (a KDLossConfig) replaces the loss
    keywords when given (`vocab_size` may still be given beside it). `check_inputs` validates the labels
    (ignore_index or a real id) with one host sync when a label names a class (vocab_size or hard_weight set).
    Returns the loss (a scalar, or the leading shape for reduction="none"), or KDLossOutput with
    return_components=True. `backend` forces "triton" or "torch" (default: Triton on CUDA).
    """
    cfg = config or KDLossConfig(
        beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction, soft_weight=soft_weight,
        hard_weight=hard_weight, softcap=softcap, teacher_softcap=teacher_softcap, chunk_size=chunk_size,
        fp32_weight_grad=fp32_weight_grad,
    )  # fmt: skip
    cfg = _config_with_vocab_size(cfg, vocab_size)
    _check_linear("student", student_input, student_weight, student_bias)
    _check_linear("teacher", teacher_input, teacher_weight, teacher_bias)
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
    flat_labels = _flatten_labels(labels, leading, student_input.device, cfg)
    if check_inputs and labels is not None and (cfg.vocab_size is not None or cfg.hard_weight):
        _run_device_checks([_label_check(flat_labels, vocab, cfg)])
    # the teacher's product in its own dtype: casting a bf16 teacher to an fp16 student's dtype overflows at 65504
    teacher_dtype = _compute_dtype(teacher_input.device, teacher_input)
    h_t = teacher_input.detach().reshape(-1, teacher_input.shape[-1]).to(teacher_dtype)
    w_t = teacher_weight.detach()[:columns].to(teacher_dtype)
    b_t = column_bias(None if teacher_bias is None else teacher_bias.detach(), vocab, columns, cfg.temperature, h_t)

    def teacher_chunk(logits_dtype: torch.dtype):
        def logits(start: int, end: int, active: torch.Tensor) -> torch.Tensor:
            return logits_fp32(_zero_rows(h_t[start:end], active), w_t, b_t).to(logits_dtype)

        return logits

    return _run_fused(
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
    )


def _run_fused(
    student_input, student_weight, student_bias, flat_labels, cfg: KDLossConfig, num_items_in_batch, backend,
    return_components, *, vocab, teacher_chunk, kernels, bytes_per_logit, columns=None,
):  # fmt: skip
    """What both fused losses share: dtype policy, row weights, chunking and the autograd call. The full weight
    and bias go in (autograd then hands back a full-size gradient without a copy); the chunks see [:vocab]."""
    leading = student_input.shape[:-1]
    device = student_input.device
    dtype = _compute_dtype(device, student_input)
    h_s = student_input.reshape(-1, student_input.shape[-1]).to(dtype)
    w_s = student_weight.to(dtype)
    kernel = kernels[select_backend(device, backend)]
    rows = cfg.chunk_size or choose_chunk_size(h_s.shape[0], vocab, device, bytes_per_logit=bytes_per_logit)
    plan = ChunkPlan(
        teacher_chunk=teacher_chunk(torch.float64 if dtype == torch.float64 else torch.float32),
        kernel=lambda *args: kernel(*args, cfg),
        chunk_size=rows,
        vocab=vocab,
        columns=columns,
        temperature=cfg.temperature,
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
    vocab_size: int | None = None,
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
    The student is normalised over its full vocabulary (ids [0, vocab_size) when `vocab_size` is given) inside
    the fused kernel; `tail` says what happens to the teacher mass outside the top-k ("bucket", "renormalize",
    "none": see reference.topk_kd_per_row).
    Temperature: exact within the top-k (log-probs are logits minus a constant); for the tail bucket with
    T != 1 the remaining mass is assumed spread evenly over the tokens outside the top-k.
    Equals `reference.topk_kd_loss(student_input @ student_weight.T + student_bias, ...)`.
    `check_inputs` validates, with one host sync, the rows that count (label not ignore_index): ids below the
    vocabulary and unique within a row, log-probs neither NaN nor > 0, labels ignore_index or a real id.
    Ignored rows are never read. The other options are as in `fused_linear_jsd`.
    """
    cfg = config or KDLossConfig(
        beta=beta, temperature=temperature, tail=tail, ignore_index=ignore_index, reduction=reduction,
        soft_weight=soft_weight, hard_weight=hard_weight, softcap=softcap, chunk_size=chunk_size,
        fp32_weight_grad=fp32_weight_grad,
    )  # fmt: skip
    cfg = _config_with_vocab_size(cfg, vocab_size)
    _check_linear("student", student_input, student_weight, student_bias)
    vocab = resolve_vocab(student_weight.shape[0], None, cfg.vocab_size)
    # tempering top-k log-probs (T != 1) spreads the teacher's rest over the V - k tokens outside its top-k: V
    # must stay the real vocabulary there, so the columns are padded for alignment only at T = 1
    columns = vocab
    if cfg.temperature == 1.0:
        columns = computed_columns(vocab, [student_weight.shape[0]], [cfg.softcap], cfg.temperature)
    leading = student_input.shape[:-1]
    _check_topk_shapes(teacher_token_ids, teacher_logprobs, leading, vocab)
    flat_labels = _flatten_labels(labels, leading, student_input.device, cfg)
    k = teacher_token_ids.shape[-1]
    # contiguous at the door (a copy only for a strided or transposed view): the Triton kernel reads a row's K
    # slots at unit stride. N x K is small beside the N x V work, and a copy costs less than a stride multiply
    # on every slot load of three passes. (The per-chunk select below would not do it: torch.where keeps a
    # transposed input's layout.)
    ids = teacher_token_ids.reshape(-1, k).to(student_input.device).contiguous()
    logprobs = teacher_logprobs.reshape(-1, k).to(student_input.device).detach().contiguous()
    if check_inputs:
        counted = flat_labels != cfg.ignore_index if labels is not None else torch.ones_like(flat_labels, dtype=bool)
        label_checks = [_label_check(flat_labels, vocab, cfg)] if labels is not None else []
        _run_device_checks(_topk_checks(ids, logprobs, counted, vocab) + label_checks)

    def teacher_chunk(_logits_dtype: torch.dtype):
        def slots(start: int, end: int, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # rows that do not count become rows without teacher data: never read, whatever they hold
            return _zero_rows(ids[start:end], active, -1), _zero_rows(logprobs[start:end], active, -math.inf)

        return slots

    return _run_fused(
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


def _check_topk_shapes(ids: torch.Tensor, logprobs: torch.Tensor, leading: torch.Size, vocab: int) -> None:
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


# Log-probs are <= 0; this much above 0 is more than bf16 rounding of a log-prob near 0 and means logits.
_LOGPROB_SLACK = 1e-3
# Rows per sort in the duplicate-id check: bounds its temporary to 16M ids even for full-vocabulary rows.
_DUPLICATE_CHECK_ELEMS = 1 << 24


def _topk_checks(ids: torch.Tensor, logprobs: torch.Tensor, counted: torch.Tensor, vocab: int):
    """(device flag, message) pairs for the top-k data of the rows that count; padding slots are skipped."""
    counted = counted[:, None]
    present = topk_valid_slots(ids, logprobs) & counted

    def too_big() -> str:
        return (
            f"teacher_token_ids holds ids >= the vocab size {vocab} (max {int(ids[present].max())}); the "
            f"teacher data was made with another tokenizer or vocabulary (or vocab_size is too small)"
        )

    return [
        ((present & (ids >= vocab)).any(), too_big),
        (
            (logprobs.isnan() & counted).any(),
            lambda: "teacher_logprobs contains NaN; regenerate the teacher data (padding slots should be -inf)",
        ),
        (
            ((logprobs > _LOGPROB_SLACK) & counted).any(),
            lambda: (
                "teacher_logprobs contains values > 0 (or +inf), so they are not log-probabilities (logits?); "
                "pass log_softmax(teacher_logits) or the log-probs an inference server returns"
            ),
        ),
        (
            _has_duplicate_ids(ids, present),
            lambda: (
                "teacher_token_ids repeats an id within a row; top-k ids are unique (a repeated id would count "
                "its probability twice): deduplicate the teacher data, or mark the repeats as padding (id -1)"
            ),
        ),
    ]


def _has_duplicate_ids(ids: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """True (on the device) when a row repeats an id among its present slots: sort each row, compare neighbours.
    Padding slots get distinct negative keys so they never match each other or a real id."""
    n, k = ids.shape
    found = torch.zeros((), dtype=torch.bool, device=ids.device)
    if k < 2:
        return found
    padding_keys = -1 - torch.arange(k, device=ids.device)
    rows = max(1, _DUPLICATE_CHECK_ELEMS // k)
    for start in range(0, n, rows):
        keys = torch.where(present[start : start + rows], ids[start : start + rows].long(), padding_keys)
        keys = keys.sort(-1).values
        found |= (keys[:, 1:] == keys[:, :-1]).any()
    return found


def kl_estimator(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    kind: str = "k3",
    mask: torch.Tensor | None = None,
    clamp: float | None = None,
    reduction: str = "mean",
    check_inputs: bool = True,
) -> torch.Tensor:
    """On-policy estimate of KL(student || teacher) from the log-probs of tokens sampled from the student.

    k1 = log q - log p, k2 = (log q - log p)^2 / 2, k3 = exp(log p - log q) - (log p - log q) - 1 (see
    reference.kl_estimator_terms). `clamp` bounds the log-ratio to [-clamp, clamp] first (the k3 exponent can
    explode on tokens the teacher finds unlikely). A teacher log-prob of -inf (a token the teacher rules out)
    makes the estimate +inf without `clamp` and counts as log-ratio -clamp with it (no gradient there, as
    clamp's own). `mask` (same shape, bool or 0/1) selects the tokens that count: the completion, not the
    prompt or padding, whose values are never read. reduction: "mean" over masked tokens (0 when none), "sum",
    or "none". `check_inputs` refuses, with one host sync, NaN, +inf or positive log-probs on selected tokens,
    and a student log-prob of -inf (a token sampled from the student has probability > 0).
    Gradients flow to whichever inputs require them (usually student_logprobs).
    """
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"student_logprobs {tuple(student_logprobs.shape)} and teacher_logprobs "
            f"{tuple(teacher_logprobs.shape)} must have one shape (one value per sampled token)"
        )
    if clamp is not None and not clamp > 0:
        raise ValueError(f"clamp must be None or > 0; got clamp={clamp!r}")
    selected = _selected_tokens(mask, student_logprobs.shape, student_logprobs.device)
    if check_inputs:
        checks = _logprob_checks("student_logprobs", student_logprobs, selected)
        checks += _logprob_checks("teacher_logprobs", teacher_logprobs, selected)
        checks.append(
            (
                (student_logprobs.isneginf() & selected).any(),
                lambda: (
                    "student_logprobs holds -inf on a selected token, which the student cannot have sampled; "
                    "mask that token out"
                ),
            )
        )
        _run_device_checks(checks)
    student_logprobs, teacher_logprobs = _zero_rows(student_logprobs, selected), _zero_rows(teacher_logprobs, selected)
    terms = reference.kl_estimator_terms(student_logprobs, teacher_logprobs, kind, clamp)
    return _masked_reduce(terms, mask, reduction)


def topk_kd_from_logprobs(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    beta: float = 0.0,
    tail: str = "bucket",
    reduction: str = "mean",
    check_inputs: bool = True,
) -> torch.Tensor:
    """Top-k forward KL (beta=0) / reverse KL (beta=1) / generalized JSD on student-sampled sequences, from
    log-probs an RL framework already holds: both (..., K) on the same K ids (e.g. the teacher's top-k),
    each normalised over its full vocabulary. No logits, no patch. `tail` as in `fused_linear_topk_kd`; padding
    slots (-inf in either, or a teacher value <= -1000) are ignored. `mask` (...) selects the tokens; the others
    are never read. `check_inputs` refuses NaN, +inf and positive log-probs on selected tokens (one host sync).
    reduction as in `kl_estimator`.
    """
    KDLossConfig(beta=beta, tail=tail)  # validates
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"student_logprobs {tuple(student_logprobs.shape)} and teacher_logprobs {tuple(teacher_logprobs.shape)} "
            f"must have one shape (..., K): both models' log-probs on the same K ids"
        )
    selected = _selected_tokens(mask, student_logprobs.shape[:-1], student_logprobs.device)
    if check_inputs:
        checks = _logprob_checks("student_logprobs", student_logprobs, selected[..., None])
        _run_device_checks(checks + _logprob_checks("teacher_logprobs", teacher_logprobs, selected[..., None]))
    present = (
        selected[..., None]
        & torch.isfinite(student_logprobs)
        & (teacher_logprobs > reference.LOGPROB_PLACEHOLDER)
        & torch.isfinite(teacher_logprobs)
    )
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


def _selected_tokens(mask: torch.Tensor | None, shape: torch.Size, device: torch.device) -> torch.Tensor:
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if mask.shape != shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the per-token shape {tuple(shape)}")
    return mask.bool()


def _logprob_checks(name: str, values: torch.Tensor, selected: torch.Tensor):
    """(device flag, message) pairs: no NaN and nothing above 0 (+inf included) among the selected values."""
    return [
        ((values.isnan() & selected).any(), lambda: f"{name} contains NaN on a selected token; mask it out or fix it"),
        (
            ((values > _LOGPROB_SLACK) & selected).any(),
            lambda: (
                f"{name} contains values > 0 (or +inf), so they are not log-probabilities (logits?); pass "
                f"log_softmax(logits) gathered at the tokens"
            ),
        ),
    ]


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
