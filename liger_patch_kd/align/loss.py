"""The fused cross-tokenizer distillation loss: student and teacher hidden states and lm_heads in, the loss of
align.reference.cross_tokenizer_kd_loss out, never more than one chunk of (rows x V) logits in memory.

It runs on ops.chunked's row-chunk loop, on the chunk layout of align.layout (a group never straddles two
chunks). Per chunk the teacher's logits are computed for the teacher rows of that chunk's groups only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..batch.columns import TEACHER_LABELS
from ..conventions import TAIL_FLOOR, apply_softcap, dense_topk_teacher
from ..losses.checks import check_topk_shapes, run_device_checks, topk_checks
from ..ops.backend import compute_dtype, eager, logits_fp32, no_autocast
from ..ops.chunked import ChunkPlan, FusedLinearKDFunction, choose_chunk_size, finish_chunk
from ..ops.divergence import softmax_grad, terms_and_a
from .chain import allowed_classes, chain_pairs, continuation_masses, restricted_log
from .config import CrossTokenizerConfig, check_num_items
from .fused_math import group_loss_and_a
from .layout import ChunkMeta, plan_layout, to_meta
from .vocab import NO_BYTE, VocabMap, project_to_bytes


class CrossTokenizerLossOutput(NamedTuple):
    loss: torch.Tensor
    soft: torch.Tensor  # the distillation term (detached), same reduction
    hard: torch.Tensor  # the CE term (detached)


def _merge(log_probs: torch.Tensor, targets: torch.Tensor, row_group: torch.Tensor, last: torch.Tensor, n: int):
    """Merged log-distributions (n, V) of a chunk's groups: the last row's log-probs plus the log-probs of the
    actual tokens of the group's earlier rows. Also returns the mask of those earlier rows."""
    rows = torch.arange(row_group.numel(), device=row_group.device)
    is_last = torch.zeros_like(row_group, dtype=torch.bool)
    is_last[last] = True
    earlier = (row_group >= 0) & ~is_last
    label_lp = log_probs[rows[earlier], targets[earlier]]
    log_scale = torch.zeros(n, dtype=log_probs.dtype, device=log_probs.device).index_add(
        0, row_group[earlier], label_lp
    )
    return log_probs[last] + log_scale[:, None], earlier


def _chunk_kernel(logits, teacher, labels, w_soft, w_hard, grad_dtype, cfg, vocab_map):
    log_p, meta = teacher
    capped = apply_softcap(logits, cfg.softcap)
    log_s = torch.log_softmax(capped / cfg.temperature, dim=-1)
    if cfg.kind == "next_byte":
        return _next_byte_chunk(log_s, log_p, meta, capped, labels, w_soft, w_hard, grad_dtype, cfg, vocab_map)
    if cfg.kind == "chain":
        return _chain_chunk(log_s, log_p, meta, capped, labels, w_soft, w_hard, grad_dtype, cfg, vocab_map)
    targets = labels.clamp(min=0)
    n_groups = meta.last_row.numel()
    log_q, earlier = _merge(log_s, targets, meta.row_group, meta.last_row, n_groups)
    loss_g, a = group_loss_and_a(log_q, log_p.to(log_q.dtype), vocab_map, meta.exact_ok, cfg)
    soft = torch.zeros_like(log_s[:, 0]).index_put_((meta.last_row,), loss_g)

    def grad_u():
        weight = w_soft[meta.last_row].to(a.dtype)  # the group's share of the reduction (and grad_output)
        total = a.sum(-1) * weight
        probs = log_s.exp()
        grad = torch.zeros_like(log_s)
        grad[meta.last_row] = softmax_grad(a * weight[:, None], probs[meta.last_row], total[:, None])
        rows = torch.nonzero(earlier).flatten()
        coef = total[meta.row_group[rows]]
        grad[rows] = -coef[:, None] * probs[rows]
        grad[rows, targets[rows]] += coef
        return grad

    # group weights are applied inside grad_u; finish_chunk adds the CE term and chains through 1/T and the cap
    return finish_chunk(soft, grad_u, capped, labels, torch.ones_like(w_soft), w_hard, grad_dtype, cfg)


def _next_byte_chunk(log_s, byte_p, meta, capped, labels, w_soft, w_hard, grad_dtype, cfg, vocab_map):
    """kind="next_byte": each group's loss from its first row alone (no coupling between rows)."""
    first = meta.first_row
    probs = log_s[first].exp()
    q = torch.zeros(first.numel(), NO_BYTE + 1, dtype=probs.dtype, device=probs.device)
    q.index_add_(1, vocab_map.student_first_byte, probs)
    byte_p = byte_p.to(q.dtype)
    present = (q > 0) | (byte_p > 0)
    terms, a_class = terms_and_a(q.clamp(min=TAIL_FLOOR).log(), byte_p.clamp(min=TAIL_FLOOR).log(), cfg.beta, present)
    soft = torch.zeros_like(log_s[:, 0]).index_put_((meta.last_row,), terms.sum(-1))

    def grad_u():
        # dL/dq_c where the class mass is above its floor (as clamp's own gradient), then a_v = S_v dL/dq_c(v)
        d_class = torch.where(q > TAIL_FLOOR, a_class / q.clamp(min=TAIL_FLOOR), torch.zeros_like(q))
        a = probs * d_class[:, vocab_map.student_first_byte]
        weight = w_soft[meta.last_row].to(a.dtype)
        grad = torch.zeros_like(log_s)
        grad[first] = softmax_grad(a, probs) * weight[:, None]
        return grad

    return finish_chunk(soft, grad_u, capped, labels, torch.ones_like(w_soft), w_hard, grad_dtype, cfg)


def _chain_chunk(log_s, teacher, meta, capped, labels, w_soft, w_hard, grad_dtype, cfg, vocab_map):
    """kind="chain" (align.chain): per group, the depths of its first student token where a teacher token
    starts; one pass per depth over the groups that reach it. a_v = S_v dL/dS_v = S_v g_c(v) / m_c(v) on the
    tokens counted in byte class c, g_c = dL/dlog m_c (the restriction's renormalisation included)."""
    byte_p, byte_len = teacher
    trie = vocab_map.student_trie
    y = labels[meta.first_row].clamp(min=0)
    depth, scored = chain_pairs(meta.teacher_group, trie.length[y], byte_len, trie.depth)
    group_loss = torch.zeros_like(log_s[:, 0]).new_zeros(meta.first_row.numel())
    a_rows = []  # (chunk rows, a over the vocabulary) per depth
    for d in torch.unique(depth[scored]).tolist():
        pick = torch.nonzero(scored & (depth == d)).flatten()
        g = meta.teacher_group[pick]
        rows = meta.first_row[g]
        probs = log_s[rows].exp()
        mass, member, byte = continuation_masses(probs, y[g], d, trie)
        p = byte_p[pick].to(mass.dtype)
        allowed = allowed_classes(member, byte, p)
        log_q = restricted_log(mass, allowed)
        terms, a_class = terms_and_a(log_q, restricted_log(p, allowed), cfg.beta, allowed)
        group_loss.index_add_(0, g, terms.sum(-1))
        # through the renormalisation (d log q_c / d log m_c' = [c = c'] - q_c'), then to each counted token
        g_class = softmax_grad(a_class, torch.where(allowed, log_q.exp(), 0.0))
        per_mass = torch.where(mass > TAIL_FLOOR, g_class / mass.clamp(min=TAIL_FLOOR), torch.zeros_like(mass))
        a_rows.append((rows, probs * member * per_mass[:, byte]))
    soft = torch.zeros_like(log_s[:, 0]).index_put_((meta.last_row,), group_loss)

    def grad_u():
        grad = torch.zeros_like(log_s)
        row_weight = torch.zeros_like(log_s[:, 0]).index_put_((meta.first_row,), w_soft[meta.last_row].to(log_s.dtype))
        for rows, a in a_rows:
            probs = log_s[rows].exp()
            grad.index_add_(0, rows, softmax_grad(a, probs) * row_weight[rows, None])
        return grad

    return finish_chunk(soft, grad_u, capped, labels, torch.ones_like(w_soft), w_hard, grad_dtype, cfg)


def _teacher_source(teacher_log_probs, t_labels, metas: dict[int, ChunkMeta], cfg: CrossTokenizerConfig, vocab_map):
    """The chunk loop's teacher side. `teacher_log_probs(rows)` gives the teacher's log-probs at temperature T
    on those flat teacher rows, (R, V_t): from its hidden states and lm_head, or rebuilt from top-k data."""

    def chunk(start: int, end: int, active: torch.Tensor | None = None):
        # `active` (the chunk loop's mask of scored rows) is unused: the layout holds scored groups only
        meta = metas[start]
        if cfg.kind == "next_byte":  # the teacher's next-byte distribution at each group's first row only
            probs = teacher_log_probs(meta.teacher_rows[meta.teacher_first]).exp()
            return project_to_bytes(probs, vocab_map.teacher_first_byte), meta
        if cfg.kind == "chain":  # next-byte distributions at every teacher row of the chunk's groups
            probs = teacher_log_probs(meta.teacher_rows).exp()
            byte_len = vocab_map.teacher_byte_len[t_labels[meta.teacher_rows].clamp(min=0)]
            return (project_to_bytes(probs, vocab_map.teacher_first_byte), byte_len), meta
        log_probs = teacher_log_probs(meta.teacher_rows)
        targets = t_labels[meta.teacher_rows].clamp(min=0)
        log_p, _ = _merge(log_probs, targets, meta.teacher_group, meta.teacher_last, meta.last_row.numel())
        return log_p, meta

    return chunk


def _model_teacher(h_t, w_t, b_t, cfg: CrossTokenizerConfig):
    """A teacher in process: log_softmax(softcap(h_t W_t^T + b_t) / T) on the rows asked for."""

    def log_probs(rows: torch.Tensor) -> torch.Tensor:
        logits = logits_fp32(h_t[rows], w_t, b_t)
        return torch.log_softmax(apply_softcap(logits, cfg.teacher_softcap) / cfg.temperature, dim=-1)

    return log_probs


def _topk_teacher(ids: torch.Tensor, logprobs: torch.Tensor, vocab: int, cfg: CrossTokenizerConfig):
    """A teacher given as top-k log-probs (a store or a server): the dense rows of conventions.dense_topk_teacher."""

    def log_probs(rows: torch.Tensor) -> torch.Tensor:
        return dense_topk_teacher(ids[rows], logprobs[rows], vocab, cfg.temperature)

    return log_probs


def _check(name: str, t: torch.Tensor, leading: torch.Size) -> None:
    if t.shape != leading:
        raise ValueError(
            f"{name} must have the leading shape of its hidden states {tuple(leading)}; got {tuple(t.shape)} "
            f"(rows are HF-shifted: row r holds what concerns the token r + 1)"
        )


def _check_head_input(role: str, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{role}_input has hidden size {hidden.shape[-1]} (shape {tuple(hidden.shape)}) but {role}_weight has "
            f"shape {tuple(weight.shape)}; pass the last hidden states of the model that owns this lm_head"
        )


def _check_student_side(student_input, student_weight, student_labels, student_groups, exact_ok, cfg, vocab_map):
    _check_head_input("student", student_input, student_weight)
    _check("student_labels", student_labels, student_input.shape[:-1])
    _check("student_groups", student_groups, student_input.shape[:-1])
    if exact_ok is not None:
        _check("exact_ok", exact_ok, student_input.shape[:-1])
    if cfg.kind == "next_byte" and (vocab_map is None or vocab_map.student_first_byte is None):
        raise ValueError("kind='next_byte' needs a VocabMap with first-byte classes: VocabMap.build(student, teacher)")
    if cfg.kind == "chain" and (vocab_map is None or vocab_map.student_trie is None):
        raise ValueError("kind='chain' needs a VocabMap with the student's token trie: VocabMap.build(student, ...)")
    if cfg.kind in ("exact", "hybrid") and (vocab_map is None or len(vocab_map) == 0):
        raise ValueError(f"kind={cfg.kind!r} needs a non-empty vocab_map (VocabMap.build(student_tok, teacher_tok))")


@eager  # a clean graph break under torch.compile, as the fused losses
def fused_linear_cross_tokenizer_kd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    student_labels: torch.Tensor,
    teacher_labels: torch.Tensor,
    student_groups: torch.Tensor,
    teacher_groups: torch.Tensor,
    vocab_map: VocabMap | None = None,
    exact_ok: torch.Tensor | None = None,
    *,
    config: CrossTokenizerConfig | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    return_components: bool = False,
    row_scale: torch.Tensor | None = None,
    **options,
) -> torch.Tensor | CrossTokenizerLossOutput:
    """Equals `align.reference.cross_tokenizer_kd_loss(h_s W_s^T + b_s, h_t W_t^T + b_t, ...)`.

    student_input (..., H_s) with student_labels / student_groups / exact_ok of its leading shape, shifted
    HF style (row r: label = token r + 1, group of token r + 1); teacher_input (..., H_t) with teacher_labels /
    teacher_groups of its own leading shape (the teacher's sequence length differs). `config` and / or its
    fields as keywords, merged by CrossTokenizerConfig.build (a keyword that conflicts with `config` is a
    ValueError). Gradients flow to the student input, weight and bias. `row_scale` (student_labels' shape, >= 0,
    default 1): each student row's share of the loss, its groups' and CE terms alike (a row's group takes the
    share of the row predicting its last token): the part of the row's objective this teacher holds when other
    losses score the rest (several teachers, trainer/teachers/mixture_loss.py).
    """
    cfg = CrossTokenizerConfig.build(config, **options)
    _check_student_side(student_input, student_weight, student_labels, student_groups, exact_ok, cfg, vocab_map)
    _check_head_input("teacher", teacher_input, teacher_weight)
    _check(TEACHER_LABELS, teacher_labels, teacher_input.shape[:-1])
    _check("teacher_groups", teacher_groups, teacher_input.shape[:-1])
    dtype = compute_dtype(student_input.device, student_input)
    h_t = teacher_input.reshape(-1, teacher_input.shape[-1]).detach().to(dtype)
    b_t = None if teacher_bias is None else teacher_bias.detach()
    teacher = _model_teacher(h_t, teacher_weight.detach().to(dtype), b_t, cfg)
    return _fused_loss(
        student_input, student_weight, student_bias, student_labels, student_groups, teacher, teacher_weight.shape[0],
        teacher_labels, teacher_groups, vocab_map, exact_ok, cfg, num_items_in_batch, return_components, row_scale,
    )  # fmt: skip


@eager  # a clean graph break under torch.compile, as the fused losses
def fused_linear_cross_tokenizer_topk_kd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_token_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    student_labels: torch.Tensor,
    teacher_labels: torch.Tensor,
    student_groups: torch.Tensor,
    teacher_groups: torch.Tensor,
    vocab_map: VocabMap | None = None,
    exact_ok: torch.Tensor | None = None,
    *,
    teacher_vocab_size: int | None = None,
    config: CrossTokenizerConfig | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    student_bias: torch.Tensor | None = None,
    return_components: bool = False,
    **options,
) -> torch.Tensor | CrossTokenizerLossOutput:
    """`fused_linear_cross_tokenizer_kd` with the teacher given as top-k data (a store or a server) instead of
    its hidden states and lm_head: equals `align.reference.cross_tokenizer_topk_kd_loss(h_s W_s^T + b_s, ...)`.

    teacher_token_ids / teacher_logprobs (..., K) on the teacher's rows (row t: its top-k for the token after
    teacher position t, log-probs at T = 1 over its whole vocabulary; padding slots as conventions.
    topk_valid_slots), with teacher_labels / teacher_groups of their leading shape. Each chunk rebuilds its
    teacher rows densely (conventions.dense_topk_teacher: the unknown tail spread evenly over the other ids), so
    memory stays one chunk. teacher_vocab_size: the teacher's vocabulary (its lm_head rows), default
    vocab_map.teacher_vocab_size. The log-probs already carry any soft-cap, so teacher_softcap must be None.
    """
    cfg = CrossTokenizerConfig.build(config, **options)
    _check_student_side(student_input, student_weight, student_labels, student_groups, exact_ok, cfg, vocab_map)
    if cfg.teacher_softcap is not None:
        raise ValueError(
            f"teacher_softcap={cfg.teacher_softcap} with top-k teacher data: the log-probs are already the capped "
            f"model's; leave teacher_softcap=None"
        )
    vocab = teacher_vocab_size if teacher_vocab_size is not None else getattr(vocab_map, "teacher_vocab_size", None)
    if vocab is None:
        raise ValueError("teacher_vocab_size is needed with top-k teacher data (the teacher's lm_head rows) "
                         "unless a vocab_map gives it")  # fmt: skip
    leading = teacher_token_ids.shape[:-1]
    check_topk_shapes(teacher_token_ids, teacher_logprobs, leading, vocab)
    _check(TEACHER_LABELS, teacher_labels, leading)
    _check("teacher_groups", teacher_groups, leading)
    device = student_input.device
    ids = teacher_token_ids.reshape(-1, teacher_token_ids.shape[-1]).to(device)
    logprobs = teacher_logprobs.reshape(-1, teacher_logprobs.shape[-1]).to(device).detach()
    counted = (teacher_groups.reshape(-1) >= 0).to(device)  # only the rows in a group are read
    run_device_checks(topk_checks(ids, logprobs, counted, vocab))
    return _fused_loss(
        student_input, student_weight, student_bias, student_labels, student_groups,
        _topk_teacher(ids, logprobs, vocab, cfg), vocab, teacher_labels, teacher_groups, vocab_map, exact_ok, cfg,
        num_items_in_batch, return_components,
    )  # fmt: skip


def _fused_loss(
    student_input, student_weight, student_bias, student_labels, student_groups, teacher_log_probs,
    teacher_vocab: int, teacher_labels, teacher_groups, vocab_map, exact_ok, cfg, num_items_in_batch,
    return_components, row_scale=None,
):  # fmt: skip
    """The chunk loop shared by both teacher sources (`teacher_log_probs(rows)`, see _teacher_source)."""
    check_num_items(num_items_in_batch)
    if vocab_map is not None:
        vocab_map.check(student_weight.shape[0], teacher_vocab)
        vocab_map = vocab_map.to(student_input.device)
    device = student_input.device
    dtype = compute_dtype(device, student_input)
    h_s = student_input.reshape(-1, student_input.shape[-1])
    s_labels = student_labels.reshape(-1).to(device)
    s_valid = s_labels != cfg.ignore_index
    host = lambda t: None if t is None else t.reshape(-1).long().cpu()  # noqa: E731
    vocab = max(student_weight.shape[0], teacher_vocab)
    rows_hint = int(s_valid.sum()) if cfg.chunk_size is None else 0
    chunk_size = cfg.chunk_size or choose_chunk_size(max(1, rows_hint), vocab, device, bytes_per_logit=32)
    layout, raw_metas, chunk_size = plan_layout(
        host(student_groups), host(s_valid), host(teacher_groups), host(exact_ok), chunk_size
    )
    layout = layout.to(device)
    pad = layout < 0
    safe = layout.clamp(min=0)
    h_layout = h_s.index_select(0, safe).to(dtype)
    labels_layout = torch.where(pad, cfg.ignore_index, s_labels[safe])
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    valid_layout = (labels_layout != cfg.ignore_index).to(acc)
    if cfg.reduction == "batchmean":
        denom = num_items_in_batch if num_items_in_batch is not None else s_valid.sum().clamp(min=1)
        count = torch.as_tensor(denom, dtype=acc, device=device)
        row_weight = valid_layout * torch.where(count > 0, 1 / count, 0)  # no items: weight 0, loss 0, no NaN
    else:
        row_weight = valid_layout
    if row_scale is not None:
        _check("row_scale", row_scale, student_input.shape[:-1])
        scale = row_scale.detach().reshape(-1).to(device=device, dtype=acc)
        if not bool(torch.isfinite(scale).all() and (scale >= 0).all()):  # the layout is read on the host anyway
            raise ValueError("row_scale (each row's share of the loss) must be finite and >= 0; got a NaN, inf or "
                             "negative share")  # fmt: skip
        row_weight = row_weight * scale.index_select(0, safe)
    metas = {i * chunk_size: to_meta(raw, min(chunk_size, layout.numel() - i * chunk_size), device)
             for i, raw in enumerate(raw_metas)}  # fmt: skip
    t_labels = teacher_labels.reshape(-1).to(device)
    plan = ChunkPlan(
        teacher_chunk=_teacher_source(teacher_log_probs, t_labels, metas, cfg, vocab_map),
        kernel=lambda *args: _chunk_kernel(*args, cfg, vocab_map),
        chunk_size=chunk_size,
        reduction=cfg.reduction,
        soft_weight=cfg.soft_weight,
        hard_weight=cfg.hard_weight,
        vocab=student_weight.shape[0],  # the student's whole head: its rows map through vocab_map
    )
    with no_autocast(device):
        loss, soft, hard = FusedLinearKDFunction.apply(
            h_layout, student_weight.to(dtype), student_bias, labels_layout, row_weight, plan
        )
    if cfg.reduction == "none":
        keep = ~pad
        leading = student_input.shape[:-1]
        loss, soft, hard = (
            torch.zeros(h_s.shape[0], dtype=t.dtype, device=device).index_add(0, layout[keep], t[keep]).reshape(leading)
            for t in (loss, soft, hard)
        )
    return CrossTokenizerLossOutput(loss, soft, hard) if return_components else loss
