"""The sampled-token losses of on-policy distillation, on the student's own rollouts: the policy gradient of the
per-token reverse KL ("pg": Thinking Machines' recipe, TRL's DistillationTrainer) and the k1 / k3 estimators
differentiated as losses (verl's). Each needs, per completion token y_t, the student's log q(y_t) (with grad) and
the teacher's log p(y_t): one token per row, so the full-vocabulary divergence is never formed.

Fused (use_kd_patch): the decoders' last hidden states go through ops.token_logprobs (one chunk of logits at a
time, prompt rows skipped). Materialised (use_kd_patch=False): the models' own logits, log_softmax, gather — the
reference the fused path is tested against.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..losses import kl_estimator
from ..models import output_head, run_backbone, scaled_head_inputs, softcap_of, targets_of, unwrap_model
from ..ops.token_logprobs import linear_token_logprobs

SAMPLED_TOKEN_LOSSES = ("pg", "k1", "k3")
FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids")


def _model_and_context(model: nn.Module):
    """The module that runs, and the context it runs in (a PEFT student's base model: adapter disabled)."""
    module = getattr(model, "module", None)
    if hasattr(model, "module") and hasattr(module, "disable_adapter") and not isinstance(model, nn.parallel.DistributedDataParallel):
        return module, module.disable_adapter()  # AdapterDisabledTeacher (kd_self_distill)
    return model, contextlib.nullcontext()


def token_logprobs(model: nn.Module, inputs: dict[str, Any], targets: torch.Tensor, *, fused: bool) -> torch.Tensor:
    """(B, T) log-probs at T = 1 of `targets` (row-aligned: position t scores targets[:, t]; ignore_index < 0 rows
    give 0) under `model`, differentiable when grad is enabled."""
    module, context = _model_and_context(model)
    with context:
        inner = unwrap_model(module)
        batch = {k: inputs[k] for k in FORWARD_KEYS if inputs.get(k) is not None}
        if not fused:
            logits = module(**batch, use_cache=False).logits.float()
            picked = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp_min(0)[..., None]).squeeze(-1)
            return torch.where(targets >= 0, picked, 0.0)
        kwargs = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
        hidden = run_backbone(inner, batch["input_ids"], batch.get("attention_mask"), {**kwargs, "use_cache": False})[0]
        head = output_head(inner, "student")
        hidden, bias = scaled_head_inputs(inner, hidden, head.bias)
        flat = linear_token_logprobs(
            hidden.reshape(-1, hidden.shape[-1]), head.weight, targets.reshape(-1), bias,
            softcap=softcap_of(inner.config),
        )  # fmt: skip
        return flat.view(targets.shape)


def sampled_token_loss(
    student: nn.Module,
    teacher: nn.Module,
    inputs: dict[str, Any],
    kind: str,
    num_items_in_batch: int | torch.Tensor | None,
    *,
    fused: bool,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, the per-batch KL estimate, detached) of one micro-batch of rollouts.

    Args:
        student, teacher: causal LMs sharing a tokenizer (the teacher runs without grad).
        inputs: input_ids / attention_mask / labels (B, T), labels on the completion only (HF style, unshifted).
        kind: "pg", "k1" or "k3" (see losses.kl_estimator).
        num_items_in_batch: the scored tokens of the whole optimizer step (exact gradient accumulation); None:
            this micro-batch's.

    Returns:
        loss = sum of the per-token terms / num_items_in_batch, and the same sum of k1 (the reverse-KL estimate,
        which is the value of the pg loss) for logging.
    """
    targets = targets_of(inputs["labels"], inputs.get("shift_labels"), ignore_index)
    targets = torch.where(targets == ignore_index, -1, targets)
    mask = targets >= 0
    student_lp = token_logprobs(student, inputs, targets, fused=fused)
    with torch.no_grad():
        teacher_lp = token_logprobs(teacher, inputs, targets, fused=fused)
    total = kl_estimator(student_lp, teacher_lp, kind, mask=mask, reduction="sum")
    count = mask.sum() if num_items_in_batch is None else num_items_in_batch
    if isinstance(count, torch.Tensor):
        count = count.to(total.device)
    denominator = count.clamp(min=1) if isinstance(count, torch.Tensor) else max(int(count), 1)
    estimate = kl_estimator(student_lp.detach(), teacher_lp, "k1", mask=mask, reduction="sum", check_inputs=False)
    return total / denominator, estimate / denominator
