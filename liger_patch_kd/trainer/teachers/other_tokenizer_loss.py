"""The cross-tokenizer loss of one batch on two live models (or the student and the teacher's top-k in the
batch): each model's last hidden states and lm_head taken inside its own forward, as the KD forward takes
them, then align's fused loss. What KDTrainer runs across tokenizers (trainer/teachers/other_tokenizer.py sets it up
from the arguments); nothing here reads them."""

from __future__ import annotations

import torch
from torch import nn

from ... import distributed
from ...align import (
    CrossTokenizerConfig,
    CrossTokenizerLossOutput,
    VocabMap,
    fused_linear_cross_tokenizer_kd,
    fused_linear_cross_tokenizer_topk_kd,
)
from ...batch.columns import (
    ALIGN_EXACT_OK,
    STUDENT_ALIGN_GROUPS,
    TEACHER_ALIGN_GROUPS,
    TEACHER_ATTENTION_MASK,
    TEACHER_INPUT_IDS,
    TEACHER_LABELS,
    TEACHER_LOGPROBS,
    TEACHER_TOKEN_IDS,
)
from ...losses.checks import run_device_checks
from ...models.heads import output_head
from ...models.kd_forward import call_student, call_teacher
from ...models.privileged import embedding_rows, teacher_id_check
from ...models.registry import FAMILIES, REGISTRY, softcap_of
from ...models.state import unwrap_model
from ...models.transforms import scaled_head_inputs

__all__ = [
    "check_spread", "compute_cross_tokenizer_loss", "is_registered", "last_hidden_and_head", "live_teacher_loss",
    "model_head_inputs", "run_with_head",
]  # fmt: skip


def last_hidden_and_head(model: nn.Module, input_ids, attention_mask) -> tuple[torch.Tensor, nn.Linear]:
    """The decoder's last hidden states and the lm_head, without computing logits (a patched model too)."""
    inner = unwrap_model(model)
    hidden = inner.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return hidden.last_hidden_state, output_head(inner, "model")


# config fields by which a forward the registry does not know might scale its logits after lm_head
_UNAUDITED_SCALES = ("logits_scaling", "logit_scale", "lm_head_multiplier")


def is_registered(model: nn.Module) -> bool:
    """The registry has an entry for the model's type: its forward can hand over its hidden states and lm_head
    (models.kd_forward.call_student / call_teacher), under any wrapper."""
    model_type = getattr(getattr(unwrap_model(model), "config", None), "model_type", None)
    return model_type in REGISTRY or model_type in FAMILIES


def model_head_inputs(model: nn.Module, hidden: torch.Tensor, bias: torch.Tensor | None):
    """(hidden, bias) with the model's own logit transform folded in, so that hidden @ W^T + bias are the
    logits its forward returns (before soft-capping, which the loss applies from softcap_of): Granite divides
    by config.logits_scaling, Cohere multiplies by logit_scale (models.scaled_head_inputs, the registry's
    audited entry, as the same-tokenizer path). A model_type the registry does not know is taken as lm_head(h)
    unless its config declares a logit scale, which is refused (no audit says how its forward applies it)."""
    inner = unwrap_model(model)
    config = getattr(inner, "config", None)
    if is_registered(inner):
        return scaled_head_inputs(inner, hidden, bias)
    declared = {k: getattr(config, k) for k in _UNAUDITED_SCALES if getattr(config, k, None) not in (None, 1, 1.0)}
    if declared:
        raise ValueError(
            f"{type(inner).__name__} (model_type {getattr(config, 'model_type', None)!r}) declares a logit scale "
            f"{declared} that liger_patch_kd has no registry entry for, so the cross-tokenizer loss cannot reproduce "
            f"its logits; supported: {sorted(REGISTRY)}"
        )
    return hidden, bias


def check_spread(model: nn.Module, role: str, spread: str | None = None) -> None:
    """Refuse what the cross-tokenizer loss cannot run under (`spread`: how the model is spread over processes,
    default distributed.spread_as(model)): FSDP1 and ZeRO-3 (untested across tokenizers), and a model the
    registry does not know under DDP or FSDP2 (its hidden states would be taken outside its forward, where DDP
    syncs no gradient and FSDP gathers no weight)."""
    spread = spread or distributed.spread_as(model)
    if spread in ("FSDP1", "ZeRO-3"):
        raise ValueError(
            f"cross-tokenizer distillation under {spread} is not supported (the {role} is sharded that way): use "
            f"FSDP2 (fsdp_version: 2 in the accelerate config) or DDP, or a teacher of the student's tokenizer"
        )
    if spread is not None and not is_registered(model):
        raise ValueError(
            f"the {role} {type(unwrap_model(model)).__name__} has no registry entry, so under {spread} its loss "
            f"inputs cannot be taken inside its own forward: run it in one process, or use a model of "
            f"{sorted(REGISTRY)}"
        )


def run_with_head(model: nn.Module, input_ids, attention_mask, loss_on, trainable: bool):
    """loss_on(hidden, lm_head weight, bias, softcap) on `model`'s last hidden states, the model's logit scale
    folded into hidden and bias. A registered model hands them over inside its own top-level forward (through
    DDP, FSDP2 and PEFT: the root's parameters are gathered there, and gradients go back through the wrappers'
    hooks), as in the same-tokenizer path; another runs its decoder directly, in one process only."""
    check_spread(model, "student" if trainable else "teacher")
    if is_registered(model):
        if trainable:
            return call_student(model, input_ids, attention_mask, loss_on)
        return call_teacher(model, input_ids, attention_mask, {"use_cache": False}, loss_on)
    with torch.set_grad_enabled(trainable and torch.is_grad_enabled()):
        hidden, head = last_hidden_and_head(model, input_ids, attention_mask)
        weight, bias = head.weight, head.bias
        if not trainable:
            weight, bias = weight.detach(), None if bias is None else bias.detach()
        hidden, bias = model_head_inputs(model, hidden, bias)
        softcap = softcap_of(getattr(unwrap_model(model), "config", None))
    return loss_on(hidden, weight, bias, softcap)


def _shift(t: torch.Tensor, fill) -> torch.Tensor:
    """Row r gets what concerns token r + 1 (labels HF style)."""
    return torch.cat([t[:, 1:], torch.full_like(t[:, :1], fill)], dim=1)


def compute_cross_tokenizer_loss(
    model: nn.Module,
    teacher_model: nn.Module | None,
    inputs: dict[str, torch.Tensor],
    config: CrossTokenizerConfig,
    vocab_map: VocabMap,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> CrossTokenizerLossOutput:
    """One batch from CrossTokenizerCollator -> (loss, soft, hard). Runs the student's decoder (with grad) and
    the teacher's (without), then the fused loss on their hidden states and lm_heads. Each model's logit scale
    is folded into its hidden states and bias and its soft-capping read from its config, so the loss is the
    reference's on the models' own logits. The loss runs inside the student's forward, with the teacher's
    hidden states and lm_head handed over inside the teacher's (run_with_head): under FSDP2 both lm_heads are
    gathered there as in the same-tokenizer path (keep lm_head in the root unit), and under DDP the gradients are
    synced; FSDP1 and ZeRO-3 are refused (check_spread).
    A batch carrying teacher_token_ids / teacher_logprobs (offline data) runs no teacher: its top-k goes to
    fused_linear_cross_tokenizer_topk_kd over vocab_map.teacher_vocab_size ids."""
    offline = inputs.get(TEACHER_TOKEN_IDS) is not None
    if teacher_model is None and not offline:
        raise ValueError(
            "cross-tokenizer distillation needs a live teacher_model or batches with the teacher's top-k "
            "(teacher_token_ids / teacher_logprobs on its rows; see CrossTokenizerCollator)"
        )
    if not offline:
        check_spread(teacher_model, "teacher")  # before the student's forward starts
    ignore = config.ignore_index
    s_labels, t_labels = _shift(inputs["labels"], ignore), _shift(inputs[TEACHER_LABELS], ignore)
    groups = (inputs[STUDENT_ALIGN_GROUPS], inputs[TEACHER_ALIGN_GROUPS], vocab_map, inputs.get(ALIGN_EXACT_OK))
    grad_enabled = torch.is_grad_enabled()

    def on_student(h_s, w_s, b_s, cap_s):
        if offline:  # as in the same-tokenizer trainer, the batch's teacher data win over a teacher_model
            return fused_linear_cross_tokenizer_topk_kd(
                h_s, w_s, inputs[TEACHER_TOKEN_IDS], inputs[TEACHER_LOGPROBS], s_labels, t_labels, *groups,
                config=config.replace(softcap=cap_s), num_items_in_batch=num_items_in_batch, student_bias=b_s,
                return_components=True,
            )  # fmt: skip
        with torch.set_grad_enabled(grad_enabled):
            return live_teacher_loss((h_s, w_s, b_s, s_labels), teacher_model, inputs, config.replace(softcap=cap_s),
                                     vocab_map, num_items_in_batch)  # fmt: skip

    return run_with_head(model, inputs["input_ids"], inputs.get("attention_mask"), on_student, trainable=True)


def live_teacher_loss(
    student: tuple, teacher_model: nn.Module, inputs: dict, config: CrossTokenizerConfig, vocab_map: VocabMap,
    num_items_in_batch=None, row_scale: torch.Tensor | None = None, keep: dict | None = None,
) -> CrossTokenizerLossOutput:  # fmt: skip
    """The fused loss of the student's head inputs `student` = (hidden, weight, bias, shifted labels) against a
    teacher in process, run (no grad) on its own tokens (`inputs`' teacher_input_ids / teacher_attention_mask /
    teacher_labels and CrossTokenizerCollator's groups), the loss taken inside the teacher's forward
    (run_with_head). `config` carries the student's soft-cap, the teacher's comes from its own. `row_scale`: each
    student row's share of this loss (several teachers); `keep`, when given, receives the teacher's head inputs
    (hidden, weight, bias) for logging (one process: under FSDP2 the weight is gathered only inside the forward)."""
    h_s, w_s, b_s, s_labels = student
    t_labels = _shift(inputs[TEACHER_LABELS], config.ignore_index)
    groups = (inputs[STUDENT_ALIGN_GROUPS], inputs[TEACHER_ALIGN_GROUPS], vocab_map, inputs.get(ALIGN_EXACT_OK))
    grad_enabled = torch.is_grad_enabled()

    def on_teacher(h_t, w_t, b_t, cap_t):
        if keep is not None:
            keep.update(hidden=h_t, weight=w_t, bias=b_t)
        with torch.set_grad_enabled(grad_enabled):  # the teacher's forward runs under no_grad
            return fused_linear_cross_tokenizer_kd(
                h_s, w_s, h_t, w_t, s_labels, t_labels, *groups, config=config.replace(teacher_softcap=cap_t),
                num_items_in_batch=num_items_in_batch, student_bias=b_s, teacher_bias=b_t, return_components=True,
                row_scale=row_scale,
            )  # fmt: skip

    ids, mask = inputs[TEACHER_INPUT_IDS], inputs.get(TEACHER_ATTENTION_MASK)
    vocab = embedding_rows(teacher_model)
    if vocab is not None:  # the teacher's own tokenizer's ids, checked before its embedding reads them
        run_device_checks([teacher_id_check(ids, mask, vocab)])
    return run_with_head(teacher_model, ids, mask, on_teacher, trainable=False)
