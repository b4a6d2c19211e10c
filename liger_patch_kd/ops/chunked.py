"""The row-chunk loop that every fused linear loss shares.

For each chunk of rows: student logits in fp32 from one product, the teacher's chunk (logits from a second
product, or precomputed log-probs), a per-chunk kernel that turns both into per-row losses and dLoss/dlogits
(already weighted per row), then the two gradient products. Only one chunk of (rows x V) logits lives at a
time, so peak memory does not grow with the number of rows.

Gradient groups: a loss whose kernel can write its gradient where it is told (`grad_out=`) may gather the
gradients of several chunks in one (group rows x V) buffer of the input dtype and run the two gradient products
once per group. The weight-gradient product writes (and, after the first group, reads back) the whole V x H
gradient each time it runs, whatever its row count, so fewer, larger products move fewer bytes for the same
arithmetic; the price is smaller logit chunks in the same memory (`plan_chunk_rows` says when that pays).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..config import check_grad_chunk_size
from ..conventions import column_bias
from .backend import logits_fp32, no_autocast
from .scale import scale_

# (student_logits_chunk fp32, teacher_chunk, labels_chunk, w_soft, w_hard, grad_dtype | None[, grad_out=])
#   -> (soft_rows, hard_rows, grad_logits | None); a kernel given grad_out writes its gradient there and returns it
# A teacher chunk source: (start, end, active rows of the chunk) -> what the kernel compares with (teacher logits,
# or top-k ids and log-probs), with the inactive rows replaced by harmless values.
ChunkKernel = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]

# Budget for one chunk's (rows x V) buffers: the 1 GiB a call may hold, less ~20 MiB for the rest of its own
# memory (the chunk's hidden rows, per-row terms: 15 MiB measured at V = 128256). Rows per chunk set how well
# the products run: a logits product of a thousand rows runs a little slower than one of two thousand, while
# accumulating the weight gradient instead of writing it costs a few % of its product (bench_loss_breakdown.py).
# At V = 128256 this budget holds 1024 rows (8 bytes per logit): N = 8192 runs as 8 aligned chunks, not 9 of 911.
_GPU_CHUNK_BYTES = (1 << 30) - (20 << 20)
_GPU_FREE_FRACTION = 8  # never take more than 1/8 of what is free: the model and its activations come first
# On CPU chunks only bound memory: 4M logits (16 MiB fp32) per chunk.
_CPU_CHUNK_ELEMS = 1 << 22


def choose_chunk_size(n_rows: int, vocab: int, device: torch.device, bytes_per_logit: int) -> int:
    """Rows per chunk, from N, V and free memory; `bytes_per_logit` counts every (rows x V) buffer a chunk holds.

    The N rows are split into equal chunks (a last chunk of a few rows would run its products inefficiently);
    on the GPU a chunk is a multiple of 128 rows (tensor-core tiles) where that fits the budget.
    """
    if device.type == "cuda":
        max_rows = max(128, _chunk_budget_bytes(device) // (vocab * bytes_per_logit))
    else:
        max_rows = max(1, _CPU_CHUNK_ELEMS // vocab)
    n_chunks = -(-n_rows // max_rows)
    rows = -(-n_rows // max(1, n_chunks))
    if device.type == "cuda" and -(-rows // 128) * 128 <= max_rows:
        rows = -(-rows // 128) * 128
    return max(1, min(n_rows, rows))


# Rows of a logit chunk when the gradients are gathered in groups: a multiple of the tensor-core tiles that still
# leaves room for a group of four chunks' gradients in the budget at a 128K vocabulary. Groups are formed
# automatically only for an fp32 weight gradient (fp32_weight_grad), whose every product reads and writes V x H in
# float32: there fewer products save more than the smaller logit chunks cost. With the weight's own bf16 gradient
# they do not (benchmarks/loss/probe_gradient_groups.py, in docs/benchmarks.md), and a plain chunk stays. Nor
# where a plain chunk already holds GROUP_BELOW_ROWS rows.
GROUPED_CHUNK_ROWS = 512
GROUP_BELOW_ROWS = 2048


def plan_chunk_rows(
    n_rows: int,
    vocab: int,
    device: torch.device,
    bytes_per_logit: int,
    grouped_bytes_per_logit: int | None = None,
    grad_bytes_per_logit: int = 2,
    chunk_size: int | None = None,
    grad_chunk_size: int | None = None,
    fp32_weight_grad: bool = False,
    needs_grad: bool = True,
) -> tuple[int, int]:
    """(rows per logit chunk, rows per gradient group); the group is a multiple of the chunk.

    `bytes_per_logit`: a chunk's (rows x V) buffers when it runs its own gradient products;
    `grouped_bytes_per_logit`: the same when its gradient goes to a group (None: the loss's kernel cannot write
    into one, and every chunk runs its own products); `grad_bytes_per_logit`: the gradient's element size. A given
    chunk_size is taken as it is; a grad_chunk_size given alone (at most the rows there are) is split into equal chunks
    that fit beside it, and rounded up to whole chunks. Automatic: on the GPU with `fp32_weight_grad` and a
    gradient wanted (`needs_grad`), gradient groups where the rows need more than one plain chunk of fewer than
    `GROUP_BELOW_ROWS` rows and the budget holds at least two `GROUPED_CHUNK_ROWS` chunks' gradients beside one
    chunk's logits; otherwise one chunk per group.
    """
    if grad_chunk_size is not None and grouped_bytes_per_logit is None:
        raise ValueError(
            f"grad_chunk_size={grad_chunk_size} gathers the gradients of several chunks, which this loss cannot do "
            f"(fused_linear_jsd without an estimator and fused_linear_topk_kd can): leave grad_chunk_size=None"
        )
    check_grad_chunk_size(grad_chunk_size, chunk_size)
    if chunk_size is not None:
        return chunk_size, grad_chunk_size or chunk_size
    budget = _chunk_budget_bytes(device)
    if grad_chunk_size is not None:
        group = max(1, min(grad_chunk_size, n_rows))
        # equal chunks, each within what fits beside the group's gradients (a group larger than the budget is taken
        # as asked, with chunks of up to 128 rows); the group rounded up to whole chunks, by fewer rows than chunks
        room = (budget - group * vocab * grad_bytes_per_logit) // (vocab * grouped_bytes_per_logit)
        chunks = -(-group // min(group, max(room, 128)))
        rows = -(-group // chunks)
        return rows, rows * chunks
    plain = choose_chunk_size(n_rows, vocab, device, bytes_per_logit)
    grouping_pays = fp32_weight_grad and needs_grad and grouped_bytes_per_logit is not None
    if device.type != "cuda" or not grouping_pays or plain >= min(n_rows, GROUP_BELOW_ROWS):
        return plain, plain
    room = budget - GROUPED_CHUNK_ROWS * vocab * grouped_bytes_per_logit
    group_max = room // (vocab * grad_bytes_per_logit) // GROUPED_CHUNK_ROWS * GROUPED_CHUNK_ROWS
    if group_max < 2 * GROUPED_CHUNK_ROWS:
        return plain, plain
    per_group = -(-n_rows // -(-n_rows // group_max))  # equal groups
    chunks = -(-per_group // GROUPED_CHUNK_ROWS)  # and equal chunks in each, multiples of 128 rows: no runt chunk
    rows = -(-(-(-per_group // chunks)) // 128) * 128
    return rows, rows * chunks


def _chunk_budget_bytes(device: torch.device) -> int:
    """What one call's (rows x V) buffers may hold: `_GPU_CHUNK_BYTES` or an eighth of the free memory on the GPU,
    `_CPU_CHUNK_ELEMS` fp32 logits elsewhere."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(_GPU_CHUNK_BYTES, free // _GPU_FREE_FRACTION)
    return _CPU_CHUNK_ELEMS * 4


@dataclass
class ChunkedResult:
    soft_rows: torch.Tensor  # (N,) float32, unweighted KD term per row
    hard_rows: torch.Tensor  # (N,) float32, unweighted CE term per row
    grad_input: torch.Tensor | None
    grad_weight: torch.Tensor | None
    grad_bias: torch.Tensor | None


def run_chunked(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher_chunk: Callable[[int, int, torch.Tensor], Any],
    labels: torch.Tensor,
    w_soft: torch.Tensor,
    w_hard: torch.Tensor,
    kernel: ChunkKernel,
    *,
    chunk_size: int,
    needs_grad: tuple[bool, bool, bool],
    vocab: int | None = None,
    columns: int | None = None,
    temperature: float = 1.0,
    fp32_weight_grad: bool = False,
    student_product: Callable | None = None,
    grad_rows: int | None = None,
) -> ChunkedResult:
    """Loop over row chunks; see the module docstring. `needs_grad` = (input, weight, bias).

    `vocab`: only the first `vocab` rows of the weight (and bias) are real tokens; the chunks see row views of
    them and the gradient rows past them are 0. `columns` (>= vocab, conventions.computed_columns) is how many rows
    the products use: the extra ones get conventions.PAD_LOGIT as bias, so they carry no probability and no
    gradient, and the products stay aligned. Rows whose weights are both 0 (ignored labels, or no items in
    the batch) are replaced by zeros before any product, so NaN or inf in them (padding garbage) reaches
    neither the loss nor a gradient: a zero row weight alone would not do, as 0 * NaN is NaN.
    `student_product(hidden, weight, bias)`: the forward logit product (default `logits_fp32`; an FP8 one with
    student_logits_fp8); the gradient products always use `weight` and the hidden rows as they are.
    """
    n_rows, full_vocab = student_input.shape[0], student_weight.shape[0]
    vocab = full_vocab if vocab is None else vocab
    columns = vocab if columns is None else columns
    weight = student_weight[:columns]
    bias = column_bias(student_bias, vocab, columns, temperature, student_input)
    active = (w_soft != 0) | (w_hard != 0)
    acc_dtype = torch.float64 if student_input.dtype == torch.float64 else torch.float32
    soft_rows = torch.zeros(n_rows, dtype=acc_dtype, device=student_input.device)
    hard_rows = torch.zeros_like(soft_rows)
    need_input, need_weight, need_bias = needs_grad
    any_grad = need_input or need_weight or need_bias
    # contiguous whatever the input's strides, so each chunk's rows are one block for mm(out=)
    grad_input = student_input.new_empty(student_input.shape) if need_input else None
    grad_weight = None
    if need_weight:
        weight_grad_dtype = (
            torch.float32 if fp32_weight_grad and student_weight.dtype != torch.float64 else student_weight.dtype
        )
        # the first chunk writes rows [0, vocab), later chunks accumulate (zeros only when there is no chunk at
        # all); the padding rows past vocab are 0
        new = torch.empty if n_rows else torch.zeros
        grad_weight = new(student_weight.shape, dtype=weight_grad_dtype, device=student_weight.device)
        grad_weight[columns:].zero_()
    grad_bias = torch.zeros(full_vocab, dtype=acc_dtype, device=student_input.device) if need_bias else None

    def gradient_products(grad_logits: torch.Tensor, hidden: torch.Tensor, start: int, end: int) -> None:
        if need_input:
            torch.mm(grad_logits, weight, out=grad_input[start:end])
        if need_weight:
            _accumulate_weight_grad(grad_weight[:columns], grad_logits, hidden, first=start == 0)
        if need_bias:
            grad_bias[:vocab] += grad_logits[:, :vocab].sum(0, dtype=acc_dtype)

    grouped = any_grad and grad_rows is not None and grad_rows > chunk_size
    if grouped and grad_rows % chunk_size:
        raise ValueError(f"grad_rows={grad_rows} must be a multiple of chunk_size={chunk_size} (whole chunks)")
    group_grad = group_hidden = None
    group_start = group_end = 0
    for start in range(0, n_rows, chunk_size):
        end = min(n_rows, start + chunk_size)
        chunk_active = active[start:end]
        grad_out = {}
        if grouped:
            if start == group_end:  # a new group: its masked hidden rows once, its gradient buffer reused
                group_start, group_end = start, min(n_rows, start + grad_rows)
                span = slice(group_start, group_end)
                group_hidden = torch.where(active[span, None], student_input[span], 0.0)
                if group_grad is None:
                    group_grad = student_input.new_empty((group_end - group_start, columns))
            hidden = group_hidden[start - group_start : end - group_start]
            grad_out = {"grad_out": group_grad[start - group_start : end - group_start]}
        else:
            hidden = torch.where(chunk_active[:, None], student_input[start:end], 0.0)
        logits = (student_product or logits_fp32)(hidden, weight, bias)
        soft, hard, grad_logits = kernel(
            logits,
            teacher_chunk(start, end, chunk_active),
            labels[start:end],
            w_soft[start:end],
            w_hard[start:end],
            student_input.dtype if any_grad else None,
            **grad_out,
        )
        soft_rows[start:end] = soft
        hard_rows[start:end] = hard
        del logits
        if grad_logits is None:
            continue
        if not grouped:
            gradient_products(grad_logits, hidden, start, end)
        elif end == group_end:
            gradient_products(group_grad[: group_end - group_start], group_hidden, group_start, group_end)
        # free this chunk's buffers before the next chunk allocates its own: peak memory is one chunk (and one
        # group of gradients), not two
        del grad_logits
    if grad_bias is not None and student_bias is not None:
        grad_bias = grad_bias.to(student_bias.dtype)
    return ChunkedResult(soft_rows, hard_rows, grad_input, grad_weight, grad_bias)


def _accumulate_weight_grad(
    grad_weight: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor, first: bool
) -> None:
    """grad_weight (+)= grad_logits.T @ hidden in grad_weight's dtype; the first chunk writes without reading."""
    g_t = grad_logits.t()
    same_dtype = grad_weight.dtype == grad_logits.dtype
    if grad_weight.is_cuda and not same_dtype and hasattr(torch.ops.aten.addmm, "dtype"):
        # bf16 operands into an fp32 accumulator: no rounding between chunks
        if first:
            torch.mm(g_t, hidden, out_dtype=grad_weight.dtype, out=grad_weight)
        else:
            torch.addmm(grad_weight, g_t, hidden, out_dtype=grad_weight.dtype, out=grad_weight)
    elif not same_dtype:
        product = g_t.to(grad_weight.dtype) @ hidden.to(grad_weight.dtype)
        grad_weight.copy_(product) if first else grad_weight.add_(product)
    elif first:
        torch.mm(g_t, hidden, out=grad_weight)
    else:
        grad_weight.addmm_(g_t, hidden)


@dataclass(frozen=True)
class ChunkPlan:
    """Everything about a fused call that is not a differentiable tensor."""

    teacher_chunk: Callable[[int, int, torch.Tensor], Any]
    kernel: ChunkKernel
    chunk_size: int
    vocab: int  # the leading weight rows that are real tokens (all of them unless vocab_size says otherwise)
    reduction: str
    soft_weight: float
    hard_weight: float
    fp32_weight_grad: bool = False
    columns: int | None = None  # rows the products use (>= vocab; see conventions.computed_columns)
    temperature: float = 1.0  # scales the padding columns' bias
    student_product: Callable | None = None  # the student's forward product (run_chunked's default: logits_fp32)
    grad_rows: int | None = None  # rows per gradient group (run_chunked); None: each chunk's own products


def _plan_release_token(ctx) -> torch.Tensor:
    """An empty tensor saved beside the inputs, so that the plan (the teacher side of the chunk loop: the teacher's
    hidden states, quantised heads) is freed with the saved inputs when autograd releases them after the graph's
    last backward, rather than living, as an attribute of ctx, as long as anything holds the loss tensor. (Under
    saved-tensor hooks that copy what is saved, the token dies at once, before any backward: nothing is freed
    early, and the plan lives as long as the graph, as it would without the token.)"""
    token = torch.empty(0)
    weakref.finalize(token, _release_plan, weakref.ref(ctx))
    return token


def _release_plan(ctx_ref: weakref.ref) -> None:
    ctx = ctx_ref()
    if ctx is not None and getattr(ctx, "backward_ran", False):
        ctx.plan = None


class FusedLinearKDFunction(torch.autograd.Function):
    """Loss of student rows (h W^T + b) against a teacher chunk source, without materialising the logits.

    `row_weight` (N,) holds each row's share of the reduction: 0 for ignored rows, 1 / denominator for
    "batchmean", 1 for "sum" and "none". For "sum" / "batchmean" the gradients are computed during the forward
    (the loss is usually the last op) and scaled by grad_output in the backward; for "none" grad_output is a
    vector of row weights, so the backward recomputes the chunks with it (as does a second backward through a
    retained graph). A recomputing backward needs the teacher's weight again: under FSDP, where the teacher
    reshards after its forward, keep to "sum" / "batchmean" and one backward.
    Returns (loss, soft term, hard term), the two terms detached, for logging.
    """

    @staticmethod
    def forward(ctx, student_input, student_weight, student_bias, labels, row_weight, plan: ChunkPlan):
        needs_grad = tuple(ctx.needs_input_grad[:3])
        eager_grads = any(needs_grad) and plan.reduction != "none"
        result = _run(
            plan,
            student_input,
            student_weight,
            student_bias,
            labels,
            row_weight,
            needs_grad if eager_grads else (False,) * 3,
        )
        soft = result.soft_rows * row_weight
        hard = result.hard_rows * row_weight
        ctx.plan, ctx.needs_grad = plan, needs_grad
        # the inputs are kept (references, no copies) for backwards that must recompute: reduction "none", or a
        # second backward through a retained graph after the precomputed gradients were handed over
        ctx.save_for_backward(student_input, student_weight, student_bias, labels, row_weight, _plan_release_token(ctx))
        if plan.reduction == "none":
            ctx.grads = None
            loss = plan.soft_weight * soft + plan.hard_weight * hard
        else:
            ctx.grads = (result.grad_input, result.grad_weight, result.grad_bias)
            soft, hard = soft.sum(), hard.sum()
            loss = plan.soft_weight * soft + plan.hard_weight * hard
        ctx.mark_non_differentiable(soft, hard)
        return loss, soft, hard

    @staticmethod
    def backward(ctx, grad_loss, _grad_soft, _grad_hard):
        ctx.backward_ran = True  # from now on the plan may go with the saved inputs
        if ctx.grads is not None:
            # the usual case: gradients from the forward, scaled in place and handed over (a copy would double
            # the V x H weight gradient for a moment); a later backward through a retained graph recomputes
            grads, ctx.grads = ctx.grads, None
            grads = tuple(None if g is None else scale_(g, grad_loss) for g in grads)
        else:
            student_input, student_weight, student_bias, labels, row_weight, _ = ctx.saved_tensors
            with no_autocast(student_input.device):  # a backward called under autocast: the logits stay fp32
                result = _run(
                    ctx.plan,
                    student_input,
                    student_weight,
                    student_bias,
                    labels,
                    row_weight * grad_loss,
                    ctx.needs_grad,
                )
            grads = (result.grad_input, result.grad_weight, result.grad_bias)
        # an fp32-accumulated weight grad is cast to the weight's dtype by autograd itself
        return (*grads, None, None, None)


def _run(plan: ChunkPlan, student_input, student_weight, student_bias, labels, row_weight, needs_grad) -> ChunkedResult:
    return run_chunked(
        student_input,
        student_weight,
        student_bias,
        plan.teacher_chunk,
        labels,
        row_weight * plan.soft_weight,
        row_weight * plan.hard_weight,
        plan.kernel,
        chunk_size=plan.chunk_size,
        needs_grad=needs_grad,
        vocab=plan.vocab,
        columns=plan.columns,
        temperature=plan.temperature,
        fp32_weight_grad=plan.fp32_weight_grad,
        student_product=plan.student_product,
        grad_rows=plan.grad_rows,
    )


def hard_ce_rows_and_grad(
    capped: torch.Tensor, labels: torch.Tensor, ignore_index: int, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Cross-entropy at T=1 per row (0 where ignored) and its gradient wrt the capped logits (unweighted).
    A label outside [0, V) (only reachable with check_inputs=False) counts as ignored here, as in the Triton
    kernel: never an out-of-bounds read."""
    log_q = F.log_softmax(capped, dim=-1)
    valid = (labels != ignore_index) & (labels >= 0) & (labels < capped.shape[-1])
    safe = torch.where(valid, labels, torch.zeros_like(labels)).long()
    rows = -log_q.gather(-1, safe[:, None]).squeeze(-1) * valid
    if not need_grad:
        return rows, None
    grad = log_q.exp()
    grad.scatter_add_(-1, safe[:, None], -valid[:, None].to(grad.dtype))
    return rows, grad


def finish_chunk(
    soft: torch.Tensor,
    grad_u: Callable[[], torch.Tensor],
    capped: torch.Tensor,
    labels: torch.Tensor,
    w_soft: torch.Tensor,
    w_hard: torch.Tensor,
    grad_dtype: torch.dtype | None,
    cfg,
    grad_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What every PyTorch chunk kernel does after its own divergence: the hard CE term, then dLoss/du (u = the
    tempered capped logits, from `grad_u()`, only called when a gradient is wanted) weighted per row and
    chained back to the raw logits through 1/T and the soft-cap (into `grad_out` when given)."""
    hard, hard_grad = torch.zeros_like(soft), None
    if cfg.hard_weight:
        hard, hard_grad = hard_ce_rows_and_grad(capped, labels, cfg.ignore_index, grad_dtype is not None)
    if grad_dtype is None:
        return soft, hard, None
    grad = grad_u()
    grad *= (w_soft.to(grad.dtype) / cfg.temperature)[:, None]
    if hard_grad is not None:
        grad += hard_grad * w_hard.to(grad.dtype)[:, None]
    if cfg.softcap is not None:
        grad *= 1 - (capped / cfg.softcap) ** 2
    if grad_out is not None:
        return soft, hard, grad_out.copy_(grad)
    return soft, hard, grad.to(grad_dtype)
