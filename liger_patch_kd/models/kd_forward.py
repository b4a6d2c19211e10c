"""One KD forward for every *ForCausalLM: the model's own decoder, then the fused loss on its last hidden
states and lm_head weight. Nothing here is specific to an architecture; quirks come from the registry and the
model's config (soft-capping), and every keyword the caller passes goes through to the decoder untouched, so
the forward survives transformers renaming them (`past_key_values` -> `cache`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import KDLossConfig, override_options
from ..distributed import gathered_weights, release_root_parameters
from ..losses import KDLossOutput, fused_linear_jsd, fused_linear_sampled_kd, fused_linear_topk_kd
from ..ops.backend import eager
from .backbone import (
    backbone_masks,
    router_aux_loss,
    run_backbone,
    teacher_vision_inputs,
    with_router_aux_loss,
)
from .heads import HeadWeights, output_head
from .kd_io import KDCausalLMOutput, TeacherInputs, behaviour_targets, kd_output, targets_of
from .materialised import TEACHER_INPUT_KEYS, materialised_kd
from .privileged import PrivilegedInputs
from .registry import softcap_of
from .spec import spec_for_model
from .state import INSTANCE_ATTR, PATCHED_INSTANCES, PatchState, class_state, patch_state, unwrap_model
from .teachers import TeacherSet, materialised_teacher_set, teacher_set_forward
from .transforms import scaled_head_inputs

__all__ = [
    "call_student",
    "call_teacher",
    "install_kd_forward",
    "kd_causal_lm_forward",
]


def resolve_config(model: nn.Module, kd_config: KDLossConfig | dict | None) -> KDLossConfig:
    base = patch_state(model).config
    if kd_config is None:
        return base
    if isinstance(kd_config, KDLossConfig):
        return kd_config
    return override_options(base, kd_config)  # this call's options replace the patch-time ones


TeacherCallback = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", "float | None"], Any]


def kd_causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    *,
    teacher_model: nn.Module | None = None,
    teacher_hidden_states: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    teacher_token_ids: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    teacher_sample_ids: torch.Tensor | None = None,
    teacher_sample_counts: torch.Tensor | None = None,
    teacher_sample_logprobs: torch.Tensor | None = None,
    kd_config: KDLossConfig | dict | None = None,
    return_logits: bool = False,
    kd_teacher_callback: TeacherCallback | None = None,
    kd_student_callback: TeacherCallback | None = None,
    kd_log_agreement: bool = False,
    kd_teacher_set: TeacherSet | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs,
):
    """The patched *ForCausalLM.forward.

    With labels and a teacher (`teacher_model`, or `teacher_hidden_states` + `teacher_weight`, or
    `teacher_token_ids` + `teacher_logprobs` of shape (B, T, K) aligned with the positions like logits are, or
    sampled teacher tokens `teacher_sample_ids` + `_counts` + `_logprobs` (B, T, m), alone or with the top-k)
    it returns the model's output with `.loss` the distillation loss and `.logits` None (fused) or the logits
    (patched with fused_linear_jsd=False, or return_logits=True). Without labels or a teacher it is the
    original forward, so generation and plain CE training behave exactly as before. `kd_config` (a
    KDLossConfig or a dict of its fields) overrides the options given at patch time for this call.
    `kd_log_agreement` adds `.kd_top1_agreement`: how often the student's most likely token is the teacher's,
    on up to 256 scored rows (one host sync; the trainer asks on logging steps only).
    `kd_behaviour_logprobs` (B, T), aligned with the labels: for the "pg" estimator, each label's log-prob under the
    policy that sampled it (an engine's weights some steps old), the importance ratio's denominator.
    `kd_teacher_set` (models.teachers.TeacherSet): several teachers instead of one, each row scored against its
    own or a mixture of them (`kd_log_agreement` then measures each teacher's divergence and agreement).
    `kd_teacher_callback` is internal: another model's KD forward asks this model, as its teacher, for its
    last hidden states inside this model's own forward, where FSDP has its parameters gathered.
    `kd_student_callback` is internal too: a loss computed outside the models (across tokenizers) gets this model's
    last hidden states and lm_head the same way, with gradients, and the forward returns what the callback returns.
    """
    state = patch_state(self)
    if kd_teacher_callback is not None or kd_student_callback is not None:
        callback, trainable = kd_student_callback or kd_teacher_callback, kd_student_callback is not None
        return _serve_head(self, input_ids, attention_mask, callback, kwargs, trainable)
    teacher = TeacherInputs(
        teacher_model, teacher_hidden_states, teacher_weight, teacher_bias, teacher_token_ids, teacher_logprobs,
        teacher_sample_ids, teacher_sample_counts, teacher_sample_logprobs,
    )  # fmt: skip
    behaviour = kwargs.pop("kd_behaviour_logprobs", None)  # (B, T) label-aligned; the "pg" estimator's log b
    privileged = PrivilegedInputs.pop(kwargs)  # the teacher's own prompt, when it has one (models/privileged.py)
    if labels is None or not (teacher.given or kd_teacher_set is not None):
        # logits_to_keep is in this signature so that generate() finds it (inspect.signature) and asks for the last
        # position's logits only at prefill, as it does of the unpatched model
        return state.original_forward(
            self, input_ids=input_ids, attention_mask=attention_mask, labels=labels, logits_to_keep=logits_to_keep,
            **kwargs,
        )  # fmt: skip

    live = teacher.model is not None or kd_teacher_set is not None
    if live and input_ids is None and privileged is None:  # the teacher reads the student's tokens, not its embeddings
        raise ValueError(
            "a live teacher (teacher_model / kd_teacher_set) reads the student's input_ids, and this call gave "
            "inputs_embeds only: pass input_ids instead, the teacher's own teacher_input_ids, "
            "or the teacher's signal (teacher_hidden_states + teacher_weight, or teacher_token_ids + _logprobs)"
        )
    cfg = resolve_config(self, kd_config).replace(softcap=softcap_of(self.config))
    # a loss needs no KV cache; without one transformers also keeps packed sequences (position ids restarting,
    # no attention mask) from attending across their boundaries
    kwargs.setdefault("use_cache", False)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    given_shift = kwargs.pop("shift_labels", None)  # transformers passes pre-shifted labels for packed sequences
    targets = targets_of(labels, given_shift, cfg.ignore_index)
    behaviour = behaviour_targets(behaviour, given_shift, teacher)
    if kd_teacher_set is not None:
        if teacher.given:
            raise ValueError("pass one teacher (teacher_model, ...) or a kd_teacher_set of several, not both")
        if privileged is not None:
            raise ValueError(
                "teacher_input_ids (a teacher prompt of its own) with several teachers is not supported: give the "
                "rows one teacher, or drop the teacher_prompt / teacher_input_ids column"
            )
        return _teacher_set_call(self, state, input_ids, attention_mask, labels, targets, cfg, num_items_in_batch,
                                 kwargs, kd_teacher_set, kd_log_agreement, return_logits)  # fmt: skip
    if not state.fused or return_logits:
        student_forward = functools.partial(state.original_forward, self)
        model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **kwargs}
        return materialised_kd(
            self, student_forward, teacher, targets, cfg, num_items_in_batch, model_inputs, kd_log_agreement,
            behaviour_logprobs=behaviour, privileged=privileged,
        )  # fmt: skip

    align = None
    if privileged is not None:  # the teacher's own rows: the pairing checked before any model runs
        teacher, align = privileged.prepare(teacher, targets, cfg.ignore_index)
    readers = [self] if teacher.model is None or privileged is not None else [self, teacher.model]
    student_mask, *teacher_masks = backbone_masks(readers, attention_mask, targets, cfg.ignore_index, kwargs)
    decoder_out = run_backbone(self, input_ids, student_mask, kwargs, labels)
    hidden = decoder_out.last_hidden_state
    with gathered_weights(self.get_output_embeddings(), owner=self):
        head = output_head(self, "student")
        hidden, student_bias = scaled_head_inputs(self, hidden, head.bias)
        common = dict(student_bias=student_bias, num_items_in_batch=num_items_in_batch, return_components=True)
        agreement = None
        if teacher.sample_ids is not None:  # sampled teacher tokens (+ the hybrid's top-k); no agreement logged
            out = fused_linear_sampled_kd(
                hidden, head.weight, teacher.sample_ids, teacher.sample_counts, teacher.sample_logprobs, targets,
                teacher_token_ids=teacher.token_ids, teacher_logprobs=teacher.logprobs, config=cfg, **common,
            )  # fmt: skip
        elif teacher.token_ids is not None:
            out = fused_linear_topk_kd(
                hidden, head.weight, teacher.token_ids, teacher.logprobs, targets, config=cfg, **common
            )
            if kd_log_agreement:
                top1 = _topk_top1(teacher.token_ids, teacher.logprobs)
                agreement = _top1_agreement(hidden, head, targets, cfg, top1)
        elif teacher.hidden_states is not None:
            out = fused_linear_jsd(
                hidden, head.weight, teacher.hidden_states, teacher.weight, targets, teacher_bias=teacher.bias,
                config=cfg, behaviour_logprobs=behaviour, **common,
            )  # fmt: skip
            if kd_log_agreement:
                top1 = _linear_top1(teacher.hidden_states, teacher.weight, teacher.bias, cfg.vocab_size)
                agreement = _top1_agreement(hidden, head, targets, cfg, top1)
        else:
            grad_enabled = torch.is_grad_enabled()
            measured = {}

            def loss_on(h_t, w_t, b_t, cap_t):
                if kd_log_agreement:
                    measured["agreement"] = _top1_agreement(
                        hidden, head, targets, cfg, _linear_top1(h_t, w_t, b_t, cfg.vocab_size)
                    )
                with torch.set_grad_enabled(grad_enabled):
                    return fused_linear_jsd(
                        hidden, head.weight, h_t, w_t, targets, teacher_bias=b_t,
                        config=cfg.replace(teacher_softcap=cap_t), behaviour_logprobs=behaviour, **common,
                    )  # fmt: skip

            if privileged is None:
                out = call_teacher(teacher.model, input_ids, teacher_masks[0], kwargs, loss_on)
            else:
                out = _call_privileged_teacher(teacher.model, privileged, align, loss_on)
            agreement = measured.get("agreement")
    aux_loss = router_aux_loss(self, decoder_out, attention_mask)
    return _output(out, decoder_out, agreement, aux_loss, with_router_aux_loss(self, out.loss, aux_loss))


def _teacher_set_call(self, state, input_ids, attention_mask, labels, targets, cfg, num_items_in_batch, kwargs,
                      teachers: TeacherSet, log_metrics: bool, return_logits: bool):  # fmt: skip
    """Several teachers (models/teachers.py): fused, or on materialised logits like the single-teacher path."""
    if not state.fused or return_logits:
        student_forward = functools.partial(state.original_forward, self)
        model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **kwargs}
        return materialised_teacher_set(
            self, student_forward, teachers, targets, cfg, num_items_in_batch, model_inputs, log_metrics
        )
    return teacher_set_forward(
        self, input_ids, attention_mask, labels, targets, cfg, num_items_in_batch, kwargs, teachers, log_metrics,
        call_teacher,
    )  # fmt: skip


def _call_privileged_teacher(teacher, privileged: PrivilegedInputs, align, loss_on):
    """The teacher reads its own rows; its hidden states come back in the student's position order (`align`)."""
    ids, mask, layout = privileged.input_ids, privileged.attention_mask, privileged.teacher_kwargs()
    return call_teacher(teacher, ids, mask, layout, lambda h_t, w_t, b_t, cap_t: loss_on(align(h_t), w_t, b_t, cap_t))


def _linear_top1(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, vocab_size: int | None):
    """rows -> the teacher's most likely real token on those rows (soft-capping is monotone: argmax unchanged)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    weight, bias = weight[:vocab_size], None if bias is None else bias[:vocab_size]
    return lambda rows: F.linear(flat[rows].to(weight.dtype), weight, bias).argmax(-1)


def _topk_top1(ids: torch.Tensor, logprobs: torch.Tensor):
    flat_ids, flat_lp = ids.reshape(-1, ids.shape[-1]), logprobs.reshape(-1, ids.shape[-1])
    return lambda rows: flat_ids[rows].gather(-1, flat_lp[rows].float().argmax(-1, keepdim=True)).squeeze(-1)


@torch.no_grad()
def _top1_agreement(hidden, head: HeadWeights, targets, cfg: KDLossConfig, teacher_top1, max_rows: int = 256):
    flat_targets = targets.reshape(-1)
    rows = (flat_targets != cfg.ignore_index).nonzero().squeeze(-1)[:max_rows]
    if rows.numel() == 0:
        return torch.zeros((), device=hidden.device)
    weight = head.weight[: cfg.vocab_size]
    bias = None if head.bias is None else head.bias[: cfg.vocab_size]
    flat = hidden.reshape(-1, hidden.shape[-1])[rows]
    student_top1 = F.linear(flat.to(weight.dtype), weight, bias).argmax(-1)
    return (student_top1 == teacher_top1(rows).to(student_top1.device)).float().mean()


kd_causal_lm_forward.__liger_kd__ = True


def _output(out: KDLossOutput, decoder_out, agreement, aux_loss, loss) -> KDCausalLMOutput:
    return kd_output(
        decoder_out, loss=loss, logits=None, kd_soft_loss=out.soft, kd_hard_loss=out.hard,
        kd_top1_agreement=agreement, aux_loss=aux_loss,
    )  # fmt: skip


def call_teacher(teacher: nn.Module, input_ids, attention_mask, student_kwargs: dict, loss_on: TeacherCallback):
    """Run `loss_on(teacher hidden, teacher lm_head weight, bias, softcap)` inside the teacher's own forward.

    Going through the teacher's top-level call (FSDP1/FSDP2/PEFT wrappers included) is what gathers its
    sharded parameters; the teacher's decoder runs under no_grad, and FSDP registers no backward hooks for it.
    """
    install_kd_forward(teacher)
    keys = (*TEACHER_INPUT_KEYS[2:], "use_cache")  # input_ids and attention_mask are passed explicitly
    passthrough = {k: student_kwargs[k] for k in keys if student_kwargs.get(k) is not None}
    passthrough.update(teacher_vision_inputs(teacher, student_kwargs))
    # the loss leaves through this dict, not as the teacher's output: wrappers rebuild a module's outputs inside
    # its call, under the teacher's no_grad (DeepSpeed ZeRO-3 does), which would cut the loss from the graph
    result = {}

    def keep(*args):
        result["loss"] = loss_on(*args)

    with torch.no_grad():
        teacher(input_ids=input_ids, attention_mask=attention_mask, kd_teacher_callback=keep, **passthrough)
    release_root_parameters(teacher)
    return result["loss"]


def call_student(model: nn.Module, input_ids, attention_mask, loss_on: TeacherCallback):
    """Return `loss_on(hidden, lm_head weight, bias, softcap)` computed inside the student's own top-level forward,
    with gradients: for a loss the KD forward does not compute itself (the cross-tokenizer one). Through the
    top-level call the wrappers do what they do for the KD forward: FSDP gathers the root's parameters (lm_head
    whole) and reduce-scatters their gradients, DDP all-reduces the gradients, accelerate's autocast applies.
    The model must run the KD forward already (apply_kd_patch, or install_kd_forward before a wrapper replaces
    the instance's forward); a model given none yet, whose forward nothing wraps, is given it here."""
    inner = unwrap_model(model)
    if not _has_kd_forward(inner):
        if "forward" in inner.__dict__:  # a wrapper (accelerate's autocast) around a forward that is not the KD one
            raise ValueError(
                f"the student {type(inner).__name__} has a wrapped forward but not the KD forward: call "
                f"liger_patch_kd.apply_kd_patch(model=...) (or models.kd_forward.install_kd_forward) before "
                f"preparing it (KDTrainer does this itself)"
            )
        install_kd_forward(inner)
    return model(input_ids=input_ids, attention_mask=attention_mask, kd_student_callback=loss_on, use_cache=False)


@eager  # runs once per model; dynamo on torch 2.11 cannot trace building the PatchState
def install_kd_forward(model: nn.Module) -> None:
    """Give an unpatched model (a teacher, or the student of a loss computed outside the models) the KD forward
    (fused path only, no kernels): its behaviour is unchanged except when it is asked for its hidden states and
    lm_head (kd_teacher_callback / kd_student_callback). `revert_kd_patch()` takes it off again."""
    inner = unwrap_model(model)
    if _is_kd_forward(inner):
        return
    spec_for_model(inner)  # a model whose forward transforms its logits in a way the registry does not know: refused
    inner.__dict__[INSTANCE_ATTR] = PatchState(original_forward=type(inner).forward)
    inner.forward = kd_causal_lm_forward.__get__(inner)
    PATCHED_INSTANCES.add(inner)


def _is_kd_forward(model: nn.Module) -> bool:
    return getattr(model.forward, "__func__", None) is kd_causal_lm_forward


def _has_kd_forward(model: nn.Module) -> bool:
    """Patched (class or instance), whatever wraps the forward since (accelerate's autocast calls the KD one)."""
    return _is_kd_forward(model) or INSTANCE_ATTR in model.__dict__ or class_state(type(model)) is not None


def _serve_head(self, input_ids, attention_mask, callback: TeacherCallback, kwargs: dict, trainable: bool):
    """callback(hidden, lm_head weight, bias, softcap) inside this forward, where FSDP has the root's parameters
    gathered. A teacher's (not trainable) under no_grad and detached; a student's with gradients."""
    with torch.set_grad_enabled(trainable and torch.is_grad_enabled()):
        hidden = run_backbone(self, input_ids, attention_mask, kwargs).last_hidden_state
    with gathered_weights(self.get_output_embeddings(), owner=self):
        head = output_head(self, "student" if trainable else "teacher")
        weight, bias = head.weight, head.bias
        if not trainable:
            hidden, weight, bias = hidden.detach(), weight.detach(), None if bias is None else bias.detach()
        hidden, bias = scaled_head_inputs(self, hidden, bias)
        return callback(hidden, weight, bias, softcap_of(self.config))
