"""The sampled-token estimators of KL(student || teacher) from hidden states: `fused_linear_jsd` with
`config.estimator` set ("pg", "k1", "k2", "k3") scores each row's label, a token sampled from the student, instead
of the full-vocabulary divergence. Twin of `reference.kd_loss` with the same config.

Each row needs log q(y) and log p(y) of one token, which `ops.token_logprobs` computes one chunk of logits at a
time, skipping ignored rows (a rollout's prompt and padding): memory is one chunk, whatever the number of rows.
"""

from __future__ import annotations

import torch

from .. import reference
from ..config import KDLossConfig
from ..ops.token_logprobs import linear_token_logprobs
from .checks import check_num_items, label_check, logprob_checks, run_device_checks

VLLM_NEG_INF = -9999.0  # how vLLM's OpenAI server writes a log-prob of -inf (JSON has no infinity)


def sampled_token_kd(
    student_input: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher_input: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    flat_labels: torch.Tensor,
    cfg: KDLossConfig,
    num_items_in_batch: int | torch.Tensor | None,
    vocab: int,
    behaviour_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, soft, hard) with cfg.reduction, shaped like the labels for "none".

    Args:
        student_input: (..., H_s) the student's last hidden states (grad flows to it, the weight and the bias).
        student_weight / student_bias: (V_s, H_s) / (V_s,) the student's lm_head.
        teacher_input / teacher_weight / teacher_bias: the teacher's, (..., H_t), (V_t, H_t), (V_t,).
        flat_labels: (N,) row-aligned labels (the sampled tokens; ignore_index where nothing is scored).
        cfg: the loss options, `cfg.estimator` set.
        num_items_in_batch: divisor of "batchmean" (the whole accumulated batch's scored tokens), or None.
        vocab: the real tokens, ids [0, vocab) of both heads.
        behaviour_logprobs: (...) like the labels, "pg" only: log b of each label under the policy that sampled it
            (importance ratio exp(log q - log b), truncated at cfg.importance_cap, reference.policy_gradient_terms);
            None: b = q (ratio 1).

    Returns:
        the total soft_weight * estimator + hard_weight * CE (the CE of a sampled token is -log q), and the two
        terms alone, detached.
    """
    if cfg.reduction == "batchmean":
        check_num_items(num_items_in_batch)  # torch.tensor(-3) divided into 0 before: a skipped batch, silently
    checks = [label_check(flat_labels, vocab, cfg)]  # every label names a class here
    if behaviour_logprobs is not None:
        flat_b = behaviour_logprobs.reshape(-1)
        if flat_b.shape != flat_labels.shape:
            raise ValueError(
                f"behaviour_logprobs has {flat_b.numel()} values for {flat_labels.numel()} rows: give one per label"
            )
        # as kl_estimator refuses them: NaN or a log-prob > 0 made the loss NaN, and -inf (vLLM writes it -9999,
        # a fault) an infinite importance ratio; ignored rows are never read
        scored = flat_labels.to(flat_b.device) != cfg.ignore_index
        checks += logprob_checks("behaviour_logprobs", flat_b, scored)
        checks.append((
            ((flat_b.isneginf() | (flat_b <= VLLM_NEG_INF)) & scored).any(),
            lambda: "behaviour_logprobs holds -inf (or vLLM's -9999) on a scored row, which the policy that sampled "
                    "its token cannot have sampled: mask that row out (label ignore_index) or fix the engine's reply",
        ))  # fmt: skip
    run_device_checks(checks)
    ids = torch.where(flat_labels == cfg.ignore_index, -1, flat_labels)
    leading = student_input.shape[:-1]

    def logprobs(hidden, weight, bias, softcap):
        bias = None if bias is None else bias[:vocab]
        flat = hidden.reshape(-1, hidden.shape[-1])
        return linear_token_logprobs(flat, weight[:vocab], ids, bias, softcap=softcap, chunk_size=cfg.chunk_size)

    log_q = logprobs(student_input, student_weight, student_bias, cfg.softcap)
    with torch.no_grad():
        log_p = logprobs(teacher_input.detach(), teacher_weight.detach(), teacher_bias, cfg.teacher_softcap)
    if behaviour_logprobs is None:
        soft = reference.kl_estimator_terms(log_q, log_p.to(log_q.dtype), cfg.estimator)
    else:
        flat_b = flat_b.to(device=log_q.device, dtype=log_q.dtype)
        flat_b = torch.where(ids < 0, log_q.detach(), flat_b)  # ignored rows: never read (ratio 1, term 0)
        soft = reference.policy_gradient_terms(log_q, log_p.to(log_q.dtype), flat_b, importance_cap=cfg.importance_cap)
    hard = -log_q

    def reduce(per_row):
        out = reference.reduce_rows(
            per_row, flat_labels, reduction=cfg.reduction, ignore_index=cfg.ignore_index,
            num_items_in_batch=num_items_in_batch,
        )  # fmt: skip
        return out.view(leading) if cfg.reduction == "none" else out

    total = cfg.soft_weight * soft + (cfg.hard_weight * hard if cfg.hard_weight else 0.0)
    hard_out = reduce(hard.detach()) if cfg.hard_weight else reduce(torch.zeros_like(soft.detach()))
    return reduce(total), reduce(soft.detach()), hard_out
