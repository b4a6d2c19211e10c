"""One KD forward for every *ForCausalLM: the model's own decoder, then the fused loss on its last hidden
states and lm_head weight. Nothing here is specific to an architecture; quirks come from the registry and the
model's config (soft-capping), and every keyword the caller passes goes through to the decoder untouched, so
the forward survives transformers renaming them (`past_key_values` -> `cache`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..batch.columns import BEHAVIOUR
from ..config import KDLossConfig
from ..ops.backend import eager
from .backbone import PaddingCheck, router_aux_loss, run_backbone, with_router_aux_loss
from .facts import forward_facts
from .heads import gathered_head
from .kd_io import kd_output, shift_labels
from .materialised import materialised_kd
from .privileged import PRIVILEGED_KEYS, PrivilegedInputs
from .signals import Scored, StudentRows, bind_rows, parse_signal
from .signals.host import HeadCompute, HeadRequest, run_teacher_head
from .spec import spec_for_model
from .state import INSTANCE_ATTR, PATCHED_INSTANCES, PatchState, class_state, unwrap_model
from .teachers import TeacherSet

__all__ = [
    "call_student",
    "call_teacher",
    "install_kd_forward",
    "kd_causal_lm_forward",
]


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
    kd_log_agreement: bool = False,
    kd_teacher_set: TeacherSet | None = None,
    kd_head_request: HeadRequest | None = None,
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
    `kd_head_request` (models.signals.host.HeadRequest) makes the forward a host: it returns `request.compute(hidden,
    lm_head weight, bias, softcap)` on its last hidden states, computed here, where FSDP has the parameters
    gathered (a teacher's for another model's loss: run_teacher_head; the student's for a loss computed outside
    the models: call_student).

    The teacher arguments are parsed once into a typed signal (models/signals/); the forward runs the
    backbone, gathers the head and calls the signal's loss.
    """
    if kd_head_request is not None:
        return _serve_head(self, input_ids, attention_mask, kwargs, kd_head_request)
    facts = forward_facts(self)  # the model's patch state, registry entry, options, soft-cap: found once, kept
    columns = dict(
        teacher_hidden_states=teacher_hidden_states, teacher_weight=teacher_weight, teacher_bias=teacher_bias,
        teacher_token_ids=teacher_token_ids, teacher_logprobs=teacher_logprobs, teacher_sample_ids=teacher_sample_ids,
        teacher_sample_counts=teacher_sample_counts, teacher_sample_logprobs=teacher_sample_logprobs,
    )  # fmt: skip
    signal = parse_signal(columns, teacher_model, kd_teacher_set)
    behaviour = kwargs.pop(BEHAVIOUR, None)  # (B, T) label-aligned; the "pg" estimator's log b
    privileged = None  # the teacher's own prompt, when it has one (models/privileged.py)
    if not kwargs.keys().isdisjoint(PRIVILEGED_KEYS):
        privileged = PrivilegedInputs.pop(kwargs)
    if labels is None or signal is None:
        # logits_to_keep is in this signature so that generate() finds it (inspect.signature) and asks for the last
        # position's logits only at prefill, as it does of the unpatched model
        return facts.state.original_forward(
            self, input_ids=input_ids, attention_mask=attention_mask, labels=labels, logits_to_keep=logits_to_keep,
            **kwargs,
        )  # fmt: skip
    cfg = facts.config if kd_config is None else facts.loss_config(kd_config)
    # a loss needs no KV cache; without one transformers also keeps packed sequences (position ids restarting,
    # no attention mask) from attending across their boundaries
    kwargs.setdefault("use_cache", False)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    given_shift = kwargs.pop("shift_labels", None)  # transformers passes pre-shifted labels for packed sequences
    targets = given_shift if given_shift is not None else shift_labels(labels, cfg.ignore_index)
    scored = Scored(targets, cfg, num_items_in_batch, kd_log_agreement)
    # the teacher models run in this call (they read the student's rows unless they have a prompt of their own)
    live = (teacher_model,) if teacher_model is not None else ()
    if kd_teacher_set is not None:
        live = tuple(kd_teacher_set.models.values())
    if live and input_ids is None and privileged is None:  # the teacher reads the student's tokens, not its embeddings
        raise ValueError(
            "a live teacher (teacher_model / kd_teacher_set) reads the student's input_ids, and this call gave "
            "inputs_embeds only: pass input_ids instead, the teacher's own teacher_input_ids, "
            "or the teacher's signal (teacher_hidden_states + teacher_weight, or teacher_token_ids + _logprobs)"
        )
    signal = bind_rows(signal, targets, cfg.ignore_index, behaviour=behaviour, given_shift=given_shift,
                       privileged=privileged)  # fmt: skip
    if not facts.state.fused or return_logits:
        student_forward = functools.partial(facts.state.original_forward, self)
        model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask, **kwargs}
        return materialised_kd(self, student_forward, signal, scored, model_inputs)
    for teacher in live:  # each live teacher hands its head inputs over inside its own KD forward
        if teacher not in PATCHED_INSTANCES:  # given it already: no call (a wrapped teacher asks install_kd_forward)
            install_kd_forward(teacher)
    # whether the mask only pads the end of rows is checked once, by the first backbone that would drop such a mask
    padding = PaddingCheck(attention_mask, targets, cfg.ignore_index, kwargs)
    decoder_out = run_backbone(self, input_ids, attention_mask, kwargs, labels, facts=facts, padding=padding)
    hidden = decoder_out.last_hidden_state
    with gathered_head(self, hidden, "student", facts.logit_scales) as student:
        rows = StudentRows(input_ids, attention_mask, padding if privileged is None else None, kwargs)
        terms = signal.fused(student, scored, rows)
    out = terms.out
    loss, aux_loss = out.loss, None
    if facts.spec.router_aux_loss:
        aux_loss = router_aux_loss(self, facts.spec, decoder_out, attention_mask)
        loss = with_router_aux_loss(self, loss, aux_loss)
    return kd_output(
        decoder_out, loss=loss, logits=None, kd_soft_loss=out.soft, kd_hard_loss=out.hard,
        kd_top1_agreement=terms.agreement, aux_loss=aux_loss, kd_teacher_metrics=terms.metrics,
    )  # fmt: skip


kd_causal_lm_forward.__liger_kd__ = True


def call_teacher(teacher: nn.Module, input_ids, attention_mask, student_kwargs: dict, loss_on: HeadCompute):
    """Run `loss_on(teacher hidden, teacher lm_head weight, bias, softcap)` inside the teacher's own forward (given
    the KD forward here if it has none): models.signals.host.run_teacher_head."""
    install_kd_forward(teacher)
    return run_teacher_head(teacher, input_ids, attention_mask, student_kwargs, loss_on)


def call_student(model: nn.Module, input_ids, attention_mask, loss_on: HeadCompute):
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
    request = HeadRequest(loss_on, trainable=True)
    return model(input_ids=input_ids, attention_mask=attention_mask, kd_head_request=request, use_cache=False)


@eager  # runs once per model; dynamo on torch 2.11 cannot trace building the PatchState
def install_kd_forward(model: nn.Module) -> None:
    """Give an unpatched model (a teacher, or the student of a loss computed outside the models) the KD forward
    (fused path only, no kernels): its behaviour is unchanged except when it is asked for its hidden states and
    lm_head (kd_head_request). `revert_kd_patch()` takes it off again."""
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


def _serve_head(self, input_ids, attention_mask, kwargs: dict, request: HeadRequest):
    """request.compute(hidden, lm_head weight, bias, softcap) inside this forward, where FSDP has the root's
    parameters gathered. A teacher's (not trainable) under no_grad and detached; a student's with gradients."""
    facts = forward_facts(self)
    trainable = request.trainable
    with torch.set_grad_enabled(trainable and torch.is_grad_enabled()):
        decoder_out = run_backbone(self, input_ids, attention_mask, kwargs, facts=facts, padding=request.padding)
    role = "student" if trainable else "teacher"
    with gathered_head(self, decoder_out.last_hidden_state, role, facts.logit_scales, detached=not trainable) as head:
        grad = torch.is_grad_enabled() if request.grad_enabled is None else request.grad_enabled
        with torch.set_grad_enabled(grad):
            result = request.compute(head.hidden, head.head.weight, head.bias, facts.softcap)
    request.results.append(result)
    return result
