"""Cross-tokenizer distillation, plainly, on materialised logits: the oracle the fused loss is tested against.

Rows are HF-shifted: student row r predicts student token r + 1, whose id is `student_labels[r]` (the same
on the teacher side). `student_groups[r]` / `teacher_groups[r]` name the aligned group (align.offsets) of the
token row r predicts, -1 outside every group; a group is a run of consecutive rows on each side.

Merging (GOLD's chain rule, its "bayesian" strategy): a group whose rows are r_1 < ... < r_k predicting tokens
y_1 ... y_k has the merged distribution
    q_g(v) = S_{r_1}(y_1) ... S_{r_{k-1}}(y_{k-1}) * S_{r_k}(v),
the probability of the group's earlier tokens followed by v. It sums to the product of the earlier tokens'
probabilities, not to 1 (as in GOLD), and gradients flow through every factor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..conventions import dense_topk_teacher
from ..reference import TAIL_FLOOR, apply_softcap, cross_entropy_per_row, divergence_terms
from .chain import allowed_classes, chain_pairs, continuation_masses, restricted_log
from .config import CrossTokenizerConfig, check_num_items
from .offsets import group_ids_consistent
from .vocab import VocabMap, project_to_bytes


def merged_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, groups: torch.Tensor, n_groups: int, temperature: float = 1.0
) -> torch.Tensor:
    """(n_groups, V) log q_g from (N, V) logits, (N,) shifted labels and (N,) group ids."""
    log_s = F.log_softmax(logits / temperature, dim=-1)
    rows = torch.arange(groups.numel(), device=groups.device)
    in_group = groups >= 0
    last = last_rows(groups, n_groups)
    earlier = in_group.clone()  # no groups at all (an empty completion): nothing to index
    earlier[in_group] = rows[in_group] != last[groups[in_group]]
    label_lp = log_s[rows[earlier], labels[earlier]]
    log_scale = torch.zeros(n_groups, dtype=log_s.dtype, device=log_s.device).index_add(0, groups[earlier], label_lp)
    return log_s[last] + log_scale[:, None]


def first_rows(groups: torch.Tensor, n_groups: int) -> torch.Tensor:
    """The row predicting each group's first token (on either side)."""
    rows = torch.arange(groups.numel(), device=groups.device)
    member = groups >= 0
    start = torch.full((n_groups,), groups.numel(), device=groups.device)
    return start.scatter_reduce(0, groups[member], rows[member], "amin")


def last_rows(groups: torch.Tensor, n_groups: int) -> torch.Tensor:
    """The row predicting each group's last token (on either side)."""
    rows = torch.arange(groups.numel(), device=groups.device)
    member = groups >= 0
    return torch.full((n_groups,), -1, device=groups.device).scatter_reduce(0, groups[member], rows[member], "amax")


def sorted_l1(q: torch.Tensor, p: torch.Tensor, top_k: int | None = None) -> torch.Tensor:
    """ULD per row: sum_i |sort(q)_i - sort(p)_i|, descending, zero-padded; with top_k, the first k sorted
    entries plus |rest of q - rest of p| (the rest: each row's total minus its top-k)."""
    width = max(q.shape[-1], p.shape[-1]) if top_k is None else top_k
    qs = F.pad(q.sort(-1, descending=True).values, (0, max(0, width - q.shape[-1])))[..., :width]
    ps = F.pad(p.sort(-1, descending=True).values, (0, max(0, width - p.shape[-1])))[..., :width]
    loss = (qs - ps).abs().sum(-1)
    if top_k is not None:
        loss = loss + ((q.sum(-1) - qs.sum(-1)) - (p.sum(-1) - ps.sum(-1))).abs()
    return loss


def exact_terms(
    log_q: torch.Tensor, log_p: torch.Tensor, vocab_map: VocabMap, beta: float, unmatched: str
) -> torch.Tensor:
    """Generalized JSD per row on the mapped tokens, plus (unmatched="bucket") one class for the rest of each
    side's mass: 1 - its mass on the mapped tokens, floored at TAIL_FLOOR (merged distributions sum to <= 1)."""
    lq, lp = log_q[:, vocab_map.student_ids], log_p[:, vocab_map.teacher_ids]
    loss = divergence_terms(lq, lp, beta, torch.ones_like(lq, dtype=torch.bool)).sum(-1)
    if unmatched == "bucket":
        tail_q = (1 - lq.exp().sum(-1)).clamp(min=TAIL_FLOOR).log()
        tail_p = (1 - lp.exp().sum(-1)).clamp(min=TAIL_FLOOR).log()
        loss = loss + divergence_terms(tail_q, tail_p, beta, torch.ones_like(tail_q, dtype=torch.bool))
    return loss


def group_losses(
    log_q: torch.Tensor,
    log_p: torch.Tensor,
    vocab_map: VocabMap | None,
    exact_ok: torch.Tensor,
    cfg: CrossTokenizerConfig,
) -> torch.Tensor:
    """Loss per group (see CrossTokenizerConfig) from merged log-distributions (G, V_s) and (G, V_t)."""
    q, p = log_q.exp(), log_p.exp()
    if cfg.kind == "uld" or vocab_map is None or len(vocab_map) == 0:
        if cfg.kind != "uld":
            raise ValueError(
                f"kind={cfg.kind!r} needs a non-empty vocab_map (VocabMap.build(student_tok, teacher_tok))"
            )
        return sorted_l1(q, p, cfg.uld_top_k)
    exact = exact_terms(log_q, log_p, vocab_map, cfg.beta, cfg.unmatched)
    if cfg.kind == "exact":
        return torch.where(exact_ok, exact, torch.zeros_like(exact))
    # hybrid: ULD over the unmatched tokens where the exact term applies, over all tokens elsewhere
    mask_q = torch.zeros_like(q, dtype=torch.bool)
    mask_q[:, vocab_map.student_ids] = True
    mask_p = torch.zeros_like(p, dtype=torch.bool)
    mask_p[:, vocab_map.teacher_ids] = True
    ok = exact_ok[:, None]
    uld = sorted_l1(q.masked_fill(mask_q & ok, 0), p.masked_fill(mask_p & ok, 0), cfg.uld_top_k)
    return torch.where(exact_ok, cfg.exact_weight * exact, torch.zeros_like(exact)) + cfg.uld_weight * uld


def next_byte_terms(log_s: torch.Tensor, log_p: torch.Tensor, vocab_map: VocabMap, beta: float) -> torch.Tensor:
    """Generalized JSD per row between next-byte distributions: probabilities summed by each token's first
    byte (VocabMap.*_first_byte). Class masses are floored at TAIL_FLOOR inside the logs (a byte one side
    cannot start a token with)."""
    if vocab_map is None:
        raise ValueError("kind='next_byte' needs a VocabMap (its first-byte classes): VocabMap.build(student, teacher)")
    q = project_to_bytes(log_s.exp(), vocab_map.student_first_byte)
    p = project_to_bytes(log_p.exp(), vocab_map.teacher_first_byte)
    lq, lp = q.clamp(min=TAIL_FLOOR).log(), p.clamp(min=TAIL_FLOOR).log()
    return divergence_terms(lq, lp, beta, (q > 0) | (p > 0)).sum(-1)


def chain_group_losses(
    s_capped: torch.Tensor,
    t_capped: torch.Tensor,
    s_labels: torch.Tensor,
    t_labels: torch.Tensor,
    s_groups: torch.Tensor,
    t_groups: torch.Tensor,
    n_groups: int,
    vocab_map: VocabMap,
    cfg: CrossTokenizerConfig,
) -> torch.Tensor:
    """kind="chain" (see align.chain), per group: the sum over the teacher rows starting inside the group's first
    student token of D(teacher's next byte || student's next byte given its token's text so far), both
    restricted to the bytes the student's token can go on with there."""
    trie = vocab_map.student_trie
    s_first = first_rows(s_groups, n_groups)
    y = s_labels[s_first].clamp(min=0)
    t_rows = torch.nonzero(t_groups >= 0).flatten()
    group = t_groups[t_rows]
    byte_len = vocab_map.teacher_byte_len[t_labels[t_rows].clamp(min=0)]
    depth, scored = chain_pairs(group, trie.length[y], byte_len, trie.depth)
    per_group = torch.zeros(n_groups, dtype=s_capped.dtype, device=s_capped.device)
    for d in torch.unique(depth[scored]).tolist():
        pick = scored & (depth == d)
        g = group[pick]
        probs = F.softmax(s_capped[s_first[g]] / cfg.temperature, dim=-1)
        mass, member, byte = continuation_masses(probs, y[g], d, trie)
        p = project_to_bytes(F.softmax(t_capped[t_rows[pick]] / cfg.temperature, dim=-1), vocab_map.teacher_first_byte)
        allowed = allowed_classes(member, byte, p.to(mass.dtype))
        terms = divergence_terms(restricted_log(mass, allowed), restricted_log(p.to(mass.dtype), allowed), cfg.beta,
                                 allowed)  # fmt: skip
        per_group = per_group.index_add(0, g, terms.sum(-1))
    return per_group


def cross_tokenizer_kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    student_labels: torch.Tensor,
    teacher_labels: torch.Tensor,
    student_groups: torch.Tensor,
    teacher_groups: torch.Tensor,
    vocab_map: VocabMap | None = None,
    exact_ok: torch.Tensor | None = None,
    config: CrossTokenizerConfig | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """soft_weight * sum_g loss_g + hard_weight * sum CE(student, labels), reduced (see CrossTokenizerConfig).

    student_logits (..., V_s) with student_labels / student_groups of the leading shape; the teacher likewise
    with its own shape. exact_ok: per student row, True on the rows of exact-eligible groups (None: all)."""
    cfg = config or CrossTokenizerConfig()
    check_num_items(num_items_in_batch)
    s_logits = student_logits.reshape(-1, student_logits.shape[-1])
    t_logits = teacher_logits.reshape(-1, teacher_logits.shape[-1])
    s_labels, t_labels = student_labels.reshape(-1), teacher_labels.reshape(-1)
    s_groups, t_groups = student_groups.reshape(-1).long(), teacher_groups.reshape(-1).long()
    n_groups = group_ids_consistent(s_groups, t_groups)
    s_capped = apply_softcap(s_logits, cfg.softcap)
    t_capped = apply_softcap(t_logits, cfg.teacher_softcap).detach()
    last = last_rows(s_groups, n_groups)
    if cfg.kind == "chain":
        per_group = chain_group_losses(s_capped, t_capped, s_labels, t_labels, s_groups, t_groups, n_groups,
                                       vocab_map, cfg)  # fmt: skip
    elif cfg.kind == "next_byte":
        s_first, t_first = first_rows(s_groups, n_groups), first_rows(t_groups, n_groups)
        log_s = F.log_softmax(s_capped[s_first] / cfg.temperature, dim=-1)
        log_p = F.log_softmax(t_capped[t_first] / cfg.temperature, dim=-1)
        per_group = next_byte_terms(log_s, log_p, vocab_map, cfg.beta)
    else:
        log_q = merged_log_probs(s_capped, s_labels.clamp(min=0), s_groups, n_groups, cfg.temperature)
        log_p = merged_log_probs(t_capped, t_labels.clamp(min=0), t_groups, n_groups, cfg.temperature)
        ok = torch.ones(n_groups, dtype=torch.bool, device=last.device)
        ok = ok if exact_ok is None else exact_ok.reshape(-1)[last].bool()
        per_group = group_losses(log_q, log_p, vocab_map, ok, cfg)
    per_row = torch.zeros(s_groups.numel(), dtype=per_group.dtype, device=per_group.device)
    per_row = per_row.index_add(0, last, per_group) * cfg.soft_weight
    if cfg.hard_weight:
        per_row = per_row + cfg.hard_weight * cross_entropy_per_row(s_capped, s_labels, cfg.ignore_index)
    # always in the student's graph (zero gradients where nothing is scored), never touching its values
    per_row = per_row + torch.where(torch.zeros_like(s_capped, dtype=torch.bool), s_capped, 0).sum(-1)
    valid = s_labels != cfg.ignore_index
    if cfg.reduction == "none":
        return per_row.reshape(student_labels.shape)
    total = per_row.sum()
    if cfg.reduction == "sum":
        return total
    count = valid.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    count = torch.as_tensor(count, dtype=total.dtype, device=total.device)
    return torch.where(count > 0, total / torch.where(count > 0, count, 1), 0)  # no items: 0, never x / 0


def cross_tokenizer_topk_kd_loss(
    student_logits: torch.Tensor,
    teacher_token_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    teacher_vocab_size: int,
    student_labels: torch.Tensor,
    teacher_labels: torch.Tensor,
    student_groups: torch.Tensor,
    teacher_groups: torch.Tensor,
    vocab_map: VocabMap | None = None,
    exact_ok: torch.Tensor | None = None,
    config: CrossTokenizerConfig | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """`cross_tokenizer_kd_loss` with the teacher as top-k log-probs (..., K) at T = 1 on its own rows: the
    dense tempered teacher of conventions.dense_topk_teacher, L, is a normalised log-distribution, so
    log_softmax(T * L / T) = L and T * L stands in for the teacher's logits (uncapped: the data carry the cap)."""
    cfg = config or CrossTokenizerConfig()
    if cfg.teacher_softcap is not None:
        raise ValueError("teacher_softcap must be None with top-k teacher data (the log-probs carry the cap)")
    k = teacher_token_ids.shape[-1]
    dense = dense_topk_teacher(teacher_token_ids.reshape(-1, k), teacher_logprobs.reshape(-1, k).double(),
                               teacher_vocab_size, cfg.temperature)  # fmt: skip
    logits = (dense * cfg.temperature).reshape(*teacher_token_ids.shape[:-1], teacher_vocab_size)
    return cross_tokenizer_kd_loss(student_logits, logits, student_labels, teacher_labels, student_groups,
                                   teacher_groups, vocab_map, exact_ok, cfg, num_items_in_batch)  # fmt: skip
