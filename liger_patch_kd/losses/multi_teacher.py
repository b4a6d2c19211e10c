"""Several live teachers at once: `fused_linear_multi_teacher_jsd`, the student against the mixture of the
teachers' distributions P = sum_j w_j P_j (per-row weights; a one-hot row routes it to one teacher), or against
the mixture of the losses sum_j w_j D(S, P_j), without materialising any logits.

The mixture is built inside the chunk loop of ops.chunked: per chunk of rows, each teacher's logits come from its
own product, are tempered (and soft-capped) on their own, normalised and folded into a running log-mixture
log P = logsumexp_j(log w_j + log P_j), one teacher at a time. A chunk therefore holds the student's logits, the
running mixture and one teacher's logits, whatever the number of teachers; the divergence and its gradient are
ops.fused_linear_jsd's chunk kernel (Triton or PyTorch) unchanged, fed the mixture as its teacher. Nothing here
knows about models; the math is `reference.multi_teacher_kd_loss`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..config import KDLossConfig
from ..conventions import column_bias, computed_columns, resolve_vocab
from ..ops import fused_linear_jsd as jsd_op
from ..ops import mixture as mixture_op
from ..ops.backend import compute_dtype, eager, logits_fp32, select_backend
from ..reference import MIXTURES
from .checks import check_linear, counted_rows, flatten_labels, label_check, loss_config, run_device_checks, zero_rows
from .docs import args_section, shared_docs
from .fused import KDLossOutput, check_fp8_request, run_fused

__all__ = ["fused_linear_multi_teacher_jsd", "mixture_weight_checks"]

# A row's weights must sum to 1 (a distribution over teachers); this much off is more than fp32 / bf16 rounding of
# weights a user wrote down, and means unnormalised weights (which would silently rescale the loss).
WEIGHT_SUM_TOLERANCE = 1e-3


def mixture_weight_checks(weights: torch.Tensor, counted: torch.Tensor):
    """(device flag, message) pairs for (N, J) mixture weights on the rows that count: finite, >= 0, sum 1."""
    rows = weights[counted]
    total = rows.sum(-1)
    return [
        (
            (~torch.isfinite(rows) | (rows < 0)).any(),
            lambda: "teacher mixture weights must be finite and >= 0; got a NaN, inf or negative weight",
        ),
        (
            ((total - 1).abs() > WEIGHT_SUM_TOLERANCE).any(),
            lambda: (
                f"teacher mixture weights must sum to 1 on every scored row (a distribution over the teachers); "
                f"got row sums {total[(total - 1).abs() > WEIGHT_SUM_TOLERANCE][:4].tolist()}: normalise them"
            ),
        ),
    ]


def _flat_weights(mixture_weights: torch.Tensor, leading: torch.Size, n_teachers: int, device) -> torch.Tensor:
    """(N, J) per-row weights from (J,) (one mixture for every row) or (*leading, J)."""
    w = torch.as_tensor(mixture_weights, device=device)
    if not w.dtype.is_floating_point:
        w = w.double()
    if w.shape == (n_teachers,):
        w = w.expand(*leading, n_teachers)
    if w.shape != (*leading, n_teachers):
        raise ValueError(
            f"mixture_weights must have shape ({n_teachers},) (one mixture for every row) or "
            f"{(*leading, n_teachers)} (per row, one weight per teacher); got {tuple(w.shape)}"
        )
    return w.reshape(-1, n_teachers)


def _check_teachers(teacher_inputs, teacher_weights, teacher_biases, teacher_softcaps, leading) -> int:
    n = len(teacher_inputs)
    if n == 0 or len(teacher_weights) != n:
        raise ValueError(
            f"pass one lm_head weight per teacher and at least one teacher; got {n} teacher_inputs and "
            f"{len(teacher_weights)} teacher_weights"
        )
    for name, given in (("teacher_biases", teacher_biases), ("teacher_softcaps", teacher_softcaps)):
        if given is not None and len(given) != n:
            raise ValueError(f"{name} must have one entry per teacher ({n}); got {len(given)}")
    for j, (h, w) in enumerate(zip(teacher_inputs, teacher_weights)):
        check_linear(f"teacher[{j}]", h, w, None if teacher_biases is None else teacher_biases[j])
        if h.shape[:-1] != leading:
            raise ValueError(
                f"teacher_inputs[{j}] rows {tuple(h.shape[:-1])} do not match student_input rows {tuple(leading)}; "
                f"row i of the student is scored against row i of every teacher"
            )
    return n


# the docstring's {args} lines sit at column 0, where shared_docs fills them in (as in losses/fused.py)
# fmt: off
@eager
@shared_docs(
    args=args_section(
        "student_input", "student_weight", "labels", "num_items_in_batch", "student_bias", "config",
        "return_components", "check_inputs", "backend",
    )
)  # fmt: skip
def fused_linear_multi_teacher_jsd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_inputs: Sequence[torch.Tensor],
    teacher_weights: Sequence[torch.Tensor],
    mixture_weights: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    teacher_biases: Sequence[torch.Tensor | None] | None = None,
    teacher_softcaps: Sequence[float | None] | None = None,
    mixture: str = "distribution",
    row_scale: torch.Tensor | None = None,
    config: KDLossConfig | None = None,
    return_components: bool = False,
    check_inputs: bool = True,
    backend: str | None = None,
    **options: Any,
) -> torch.Tensor | KDLossOutput:
    """Generalized-JSD distillation of the student against several teachers, from hidden states and lm_heads.

    Equals `reference.multi_teacher_kd_loss(student logits, [teacher logits], mixture_weights, labels, config,
    teacher_softcaps=..., mixture=...)`. mixture="distribution" (the default) scores the student against
    P = sum_j w_j softmax(cap_j(z_j) / T): the temperature applies to each teacher's logits before mixing (not to
    the mixture). mixture="loss" scores sum_j w_j D(S, P_j); reference.multi_teacher_kd_loss says why the first is
    the default. Peak memory is one chunk of the student's logits, the running mixture and one teacher's logits
    (mixture="loss": a gradient accumulator instead of the mixture), flat in N and in the number of teachers.
    Teachers may have different hidden sizes and heads padded to different sizes (`vocab_size`: the real ids
    every head holds). Gradients flow to the student only.

    Args:
        teacher_inputs (Sequence[Tensor]): J tensors (N, H_j) or (B, T, H_j): each teacher's last hidden states,
            row-aligned with the student's. Detached.
        teacher_weights (Sequence[Tensor]): J lm_head weights (V_j, H_j). Detached.
        mixture_weights (Tensor): (J,) one mixture for every row, or (N, J) / (B, T, J) per row: >= 0, each
            scored row summing to 1; a one-hot row is routed to that teacher alone.
        teacher_biases (Sequence[Tensor | None] | None): each teacher's lm_head bias (V_j,), or None.
        teacher_softcaps (Sequence[float | None] | None): each teacher's final-logit soft-cap; default none.
        mixture (str): "distribution" (default) or "loss", as above.
        row_scale (Tensor | None): (N,) / (B, T), each row's share of this loss (>= 0; its KD and CE terms
            alike; default 1): the part of a row's objective these teachers hold when other losses score the
            rest of it (teachers of other tokenizers, trainer/teachers/mixture_loss.py).
{args}

    Returns:
{returns_loss}
    """
    cfg = loss_config("fused_linear_multi_teacher_jsd", config, options)
    if mixture not in MIXTURES:
        raise ValueError(f"mixture must be one of {MIXTURES}; got mixture={mixture!r}")
    if cfg.estimator is not None:
        raise ValueError(f"estimator={cfg.estimator!r} is not offered against several teachers; use estimator=None")
    check_linear("student", student_input, student_weight, student_bias)
    unquantised = "the several-teachers loss keeps each teacher's logit product in its own dtype"
    check_fp8_request(cfg, student_input, None, no_teacher_product=unquantised)
    leading = student_input.shape[:-1]
    n_teachers = _check_teachers(teacher_inputs, teacher_weights, teacher_biases, teacher_softcaps, leading)
    biases = list(teacher_biases or [None] * n_teachers)
    caps = list(teacher_softcaps or [None] * n_teachers)
    rows = [student_weight.shape[0], *(w.shape[0] for w in teacher_weights)]
    vocab = min(resolve_vocab(rows[0], r, cfg.vocab_size) for r in rows[1:])
    columns = computed_columns(vocab, rows, [cfg.softcap, *caps], cfg.temperature)
    device = student_input.device
    flat_labels = flatten_labels(labels, leading, device, cfg)
    weights = _flat_weights(mixture_weights, leading, n_teachers, device)
    counted = counted_rows(flat_labels, labels, cfg)
    scale = None if row_scale is None else _flat_scale(row_scale, leading, device)
    if check_inputs:
        checks = mixture_weight_checks(weights, counted)
        if scale is not None:
            checks.append(((~torch.isfinite(scale) | (scale < 0)).any(), lambda: _SCALE_ERROR))
        if labels is not None and (cfg.vocab_size is not None or cfg.hard_weight):
            checks.append(label_check(flat_labels, vocab, cfg))
        run_device_checks(checks)
    # rows that do not count get a harmless uniform mixture: their weights are never read as data. The rows that
    # count are normalised (sums within WEIGHT_SUM_TOLERANCE of 1): mixture="loss" would otherwise scale by the sum
    weights = weights.detach()
    weights = torch.where(counted[:, None], weights / weights.sum(-1, keepdim=True), 1.0 / n_teachers)
    teachers = []
    for h, w, b in zip(teacher_inputs, teacher_weights, biases):
        dtype = compute_dtype(h.device, h)
        h = h.detach().reshape(-1, h.shape[-1]).to(dtype)
        teachers.append(
            (h, w.detach()[:columns].to(dtype), column_bias(_detached(b), vocab, columns, cfg.temperature, h))
        )

    def teacher_logits(j: int, start: int, end: int, active: torch.Tensor, logits_dtype) -> torch.Tensor:
        h, w, b = teachers[j]
        return logits_fp32(zero_rows(h[start:end], active), w, b).to(logits_dtype)

    base = jsd_op.CHUNK_KERNELS
    if mixture == "distribution":
        fold = mixture_op.FOLD_KERNELS[select_backend(device, backend)]
        teacher_chunk = _mixture_source(teacher_logits, weights, caps, cfg.temperature, fold)
        kernels = {name: _as_teacher(kernel) for name, kernel in base.items()}
        bytes_per_logit = 16  # student logits, the running mixture, one teacher's logits, a temporary (PyTorch fold)
    else:
        teacher_chunk = _per_teacher_source(teacher_logits, weights, n_teachers)
        kernels = {name: _loss_mixture(kernel, caps) for name, kernel in base.items()}
        bytes_per_logit = 16  # student logits, one teacher's logits, an fp32 gradient accumulator, a temporary
    return run_fused(
        student_input, student_weight, student_bias, flat_labels, cfg, num_items_in_batch, backend,
        return_components, vocab=vocab, columns=columns, teacher_chunk=teacher_chunk, kernels=kernels,
        bytes_per_logit=bytes_per_logit, row_scale=scale,
    )
# fmt: on


_SCALE_ERROR = "row_scale (each row's share of the loss) must be finite and >= 0; got a NaN, inf or negative share"


def _flat_scale(row_scale: torch.Tensor, leading: torch.Size, device) -> torch.Tensor:
    scale = torch.as_tensor(row_scale, device=device)
    if scale.shape != leading and scale.shape != (leading.numel(),):
        raise ValueError(
            f"row_scale must have the student's leading shape {tuple(leading)} (one share per row); got "
            f"{tuple(scale.shape)}"
        )
    return scale.detach().reshape(-1)


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def _mixture_source(teacher_logits, weights: torch.Tensor, caps, temperature: float, fold):
    """A chunk source giving T * log P of the mixture, folded one teacher at a time (ops.mixture): the chunk kernel
    tempers its teacher by 1 / T and normalises it, which gives back log P exactly (up to rounding)."""
    n_teachers = weights.shape[1]

    def factory(logits_dtype: torch.dtype):
        log_w = weights.to(logits_dtype).log()

        def chunk(start: int, end: int, active: torch.Tensor) -> torch.Tensor:
            mix = None
            for j in range(n_teachers):
                z = teacher_logits(j, start, end, active, logits_dtype)
                scale = temperature if j == n_teachers - 1 else 1.0
                mix = fold(mix, z, log_w[start:end, j], 1.0 / temperature, caps[j], scale)
                del z
            return mix

        return chunk

    return factory


def _as_teacher(kernel):
    """The dense chunk kernel with the mixture as its teacher: the teachers' soft-caps were applied before mixing."""

    def run(logits, teacher, labels, w_soft, w_hard, grad_dtype, cfg: KDLossConfig):
        return kernel(logits, teacher, labels, w_soft, w_hard, grad_dtype, cfg.replace(teacher_softcap=None))

    return run


def _per_teacher_source(teacher_logits, weights: torch.Tensor, n_teachers: int):
    """A chunk source giving, lazily, (teacher j's logits, its row weights) one teacher at a time."""

    def factory(logits_dtype: torch.dtype):
        def chunk(start: int, end: int, active: torch.Tensor):
            w = weights[start:end].to(logits_dtype)
            return (
                (lambda j=j: teacher_logits(j, start, end, active, logits_dtype), w[:, j]) for j in range(n_teachers)
            )

        return chunk

    return factory


def _loss_mixture(kernel, caps):
    """mixture="loss": the dense chunk kernel once per teacher, row weights w_soft * w_j, the per-row terms and
    gradients summed (the gradient in fp32, cast once); the CE term is counted with the first teacher only."""

    def run(logits, teachers, labels, w_soft, w_hard, grad_dtype, cfg: KDLossConfig):
        soft_total, hard_total, grad_total = None, None, None
        acc_dtype = logits.dtype if grad_dtype is not None else None
        for j, (make_logits, w_j) in enumerate(teachers):
            first = j == 0
            soft, hard, grad = kernel(
                logits, make_logits(), labels, w_soft * w_j, w_hard if first else torch.zeros_like(w_hard), acc_dtype,
                cfg.replace(teacher_softcap=caps[j]),
            )  # fmt: skip
            soft_total = w_j * soft if first else soft_total + w_j * soft
            hard_total = hard if first else hard_total
            if grad is not None:
                grad_total = grad if first else grad_total.add_(grad)
            del grad
        return soft_total, hard_total, None if grad_total is None else grad_total.to(grad_dtype)

    return run
