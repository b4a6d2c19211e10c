"""Choices that the fused kernels and the reference oracle must share because they are conventions, not math:
which top-k slots are padding, the floor of a tail bucket's mass, how a top-k teacher is tempered (where its
unknown tail mass goes), what a model's soft-cap is, and which vocabulary ids are real.

Everything else in `reference/` is written independently of the kernels; only these definitions are imported
by both, so a kernel and the oracle cannot disagree about what the input means.
"""

from __future__ import annotations

import math

import torch

# Inference servers pad missing top-k slots with -inf or a large negative number (vLLM: -9999.0); any log-prob
# at or below this is a padding slot, as is a negative id. exp(-1000) is 0 in every float format anyway.
LOGPROB_PLACEHOLDER = -1e3
# The tail bucket's mass is 1 - sum(top-k probs): rounding noise when the top-k holds nearly all the mass (and
# bf16 log-probs can even sum above 1). Both sides' tail masses are floored here so the loss stays finite.
TAIL_FLOOR = 1e-6


def topk_valid_slots(teacher_token_ids: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """True where a top-k slot carries teacher data (not a padding slot)."""
    return (teacher_token_ids >= 0) & (teacher_logprobs > LOGPROB_PLACEHOLDER) & torch.isfinite(teacher_logprobs)


def resolve_vocab(student_rows: int, teacher_rows: int | None, vocab_size: int | None) -> int:
    """How many leading vocabulary ids both distributions (and the CE term) are taken over.

    Heads padded to different sizes for sharding share their first `vocab_size` rows (the tokenizer's ids);
    the rows past it are never a real token, so both sides are restricted to ids [0, vocab_size). Without
    `vocab_size` the two heads must have one size. `teacher_rows` is None for a teacher given as top-k data.
    """
    if vocab_size is not None:
        for role, rows in (("student", student_rows), ("teacher", teacher_rows)):
            if rows is not None and vocab_size > rows:
                raise ValueError(
                    f"vocab_size={vocab_size} is larger than the {role} lm_head ({rows} rows); vocab_size counts "
                    f"the real token ids, which every head holds: use len(tokenizer)"
                )
        return vocab_size
    if teacher_rows is not None and teacher_rows != student_rows:
        raise ValueError(
            f"the student lm_head has {student_rows} rows and the teacher's {teacher_rows}; distillation compares "
            f"distributions over one vocabulary. If the two share a tokenizer and their heads are padded to "
            f"different sizes (Qwen2.5: 151936 and 152064 rows), pass vocab_size=len(tokenizer) so both are taken "
            f"over the real ids [0, vocab_size); otherwise map the tokenizers first"
        )
    return student_rows


# cuBLAS runs a product at full speed only when its rows are a multiple of 16 bytes long. An odd vocab_size (Qwen2.5's
# 151665 real tokens) sends every logit and gradient product of the chunk loop down a slow path (several times slower:
# benchmarks/loss/bench_fused_linear_jsd.py --only padded). Where both heads hold the rows, the chunks therefore compute
# a few more columns, up to a multiple of COLUMN_ALIGN, and give the extra ones a bias of PAD_LOGIT * max(1, T): their
# logit is at most PAD_LOGIT at any temperature used, so their probability is exactly 0 (exp(-3e4) underflows in float32
# and float64 alike), and so are their gradient and every term they enter. With a soft-cap the padding logit would be
# capped to -c, no longer negligible: there the columns stay [0, vocab_size).
COLUMN_ALIGN = 64
PAD_LOGIT = -3.0e4
_MIN_PADDED_TEMPERATURE = 1e-2  # PAD_LOGIT / T stays far from float32's range for T at or above this


def computed_columns(vocab: int, head_rows: list[int], softcaps: list[float | None], temperature: float) -> int:
    """How many leading lm_head rows the chunks compute: `vocab`, or `vocab` rounded up for aligned products."""
    if vocab % 8 == 0 or any(c is not None for c in softcaps) or temperature < _MIN_PADDED_TEMPERATURE:
        return vocab
    room = min(head_rows)
    for align in (COLUMN_ALIGN, 8):
        columns = -(-vocab // align) * align
        if columns <= room:
            return columns
    return vocab


def column_bias(bias, vocab: int, columns: int, temperature: float, like):
    """The bias of the computed columns: the head's own for [0, vocab) (or None), PAD_LOGIT past it."""
    if columns == vocab:
        return None if bias is None else bias[:vocab]
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    real = bias[:vocab].to(dtype) if bias is not None else torch.zeros(vocab, dtype=dtype, device=like.device)
    pad = torch.full((columns - vocab,), PAD_LOGIT * max(1.0, temperature), dtype=dtype, device=like.device)
    return torch.cat([real, pad])


def apply_softcap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-2 style final-logit soft-capping: tanh(x / c) * c (identity when softcap is None)."""
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def tempered_topk_teacher(
    teacher_token_ids: torch.Tensor, teacher_logprobs: torch.Tensor, vocab: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher log-probs at temperature T from top-k log-probs taken at T = 1 over the full vocabulary.

    Returns (valid slots, log P_j on the top-k (-inf on padding), log P_tail (-inf when there is no tail)).
    Log-probs are logits minus a constant, so softmax(logp / T) is the tempered teacher: exact within the
    top-k. The unknown tail is assumed spread evenly over the V - k tokens outside the top-k, each holding
    m / (V - k) of the remaining mass m; at T = 1 (or k = V) that assumption plays no role.
    """
    valid = topk_valid_slots(teacher_token_ids, teacher_logprobs)
    lp = torch.where(
        valid,
        teacher_logprobs.to(torch.float64 if teacher_logprobs.dtype == torch.float64 else torch.float32),
        -math.inf,
    )
    n_tail = vocab - valid.sum(-1)
    mass = lp.exp().sum(-1)
    tail = (1 - mass).clamp(min=TAIL_FLOOR)
    has_tail = n_tail > 0
    log_n = n_tail.clamp(min=1).to(lp.dtype).log()
    log_tail_t = torch.where(has_tail, log_n + (tail.log() - log_n) / temperature, -math.inf)
    scaled = lp / temperature
    log_z = torch.logaddexp(torch.logsumexp(scaled, -1), log_tail_t)
    return valid, scaled - log_z[..., None], log_tail_t - log_z


def dense_topk_teacher(
    teacher_token_ids: torch.Tensor, teacher_logprobs: torch.Tensor, vocab: int, temperature: float
) -> torch.Tensor:
    """(rows, vocab) teacher log-probs at temperature T from (rows, K) top-k data, by `tempered_topk_teacher`'s
    convention: the top-k ids get their tempered log-prob, every other id an even share of the tempered tail.
    Each row is normalised; with K = vocab valid slots it is exactly log_softmax(logp / T). Ids must be unique
    and below `vocab` on valid slots (padding slots are dropped)."""
    valid, log_p, log_tail = tempered_topk_teacher(teacher_token_ids, teacher_logprobs, vocab, temperature)
    n_tail = (vocab - valid.sum(-1)).clamp(min=1).to(log_p.dtype)
    dense = (log_tail - n_tail.log())[:, None].expand(-1, vocab).clone()
    rows = torch.arange(valid.shape[0], device=valid.device)[:, None].expand_as(valid)
    return dense.index_put_((rows[valid], teacher_token_ids[valid].long()), log_p[valid])


def require_sampled_objective(cfg) -> None:
    """Sampled teacher tokens give an unbiased estimate of forward KL(P || S) only (beta = 0; see
    reference.sampled_kd_per_row): refuse the rest before any work."""
    if cfg.beta != 0:
        raise ValueError(
            f"beta={cfg.beta!r}: sampled teacher tokens estimate forward KL(P || S) (beta=0) without bias at a usable "
            f"variance; the reverse-KL / JSD terms on tokens the student likes are reached from teacher draws only "
            f"through the weights S(v) / P(v), whose variance grows without bound as P(v) -> 0. Set beta=0, or use "
            f"top-k or a live teacher for beta > 0"
        )
    if getattr(cfg, "estimator", None) is not None:
        raise ValueError(
            f"estimator={cfg.estimator!r} scores tokens sampled from the student; sampled teacher data are tokens "
            f"sampled from the teacher: leave estimator=None"
        )
