"""One KD forward for every *ForCausalLM: the model's own decoder, then the fused loss on its last hidden
states and lm_head weight. Nothing here is specific to an architecture; quirks come from the registry and the
model's config (soft-capping), and every keyword the caller passes goes through to the decoder untouched, so
the forward survives transformers renaming them (`past_key_values` -> `cache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from .. import reference
from ..config import KDLossConfig
from ..distributed import check_full_weight, gathered_weights, release_root_parameters
from ..losses import KDLossOutput, fused_linear_jsd, fused_linear_topk_kd
from .registry import softcap_of


@dataclass
class PatchState:
    """What a patched class or instance remembers: its original forward and its loss options."""

    original_forward: Callable
    config: KDLossConfig = field(default_factory=KDLossConfig)
    fused: bool = True


_CLASS_STATE: dict[type, PatchState] = {}
_INSTANCE_ATTR = "_liger_kd_state"


def patch_state(model: nn.Module) -> PatchState:
    state = model.__dict__.get(_INSTANCE_ATTR)
    if state is not None:
        return state
    for cls in type(model).__mro__:  # FSDP2 swaps in a subclass of the patched class
        if cls in _CLASS_STATE:
            return _CLASS_STATE[cls]
    raise RuntimeError(f"{type(model).__name__} runs the KD forward but was never patched; call apply_kd_patch")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The Hugging Face *ForCausalLM inside DDP / FSDP1 / PEFT / torch.compile wrappers."""
    seen = 0
    while seen < 8:
        seen += 1
        for attr in ("module", "_fsdp_wrapped_module", "_orig_mod"):
            inner = getattr(model, attr, None)
            if isinstance(inner, nn.Module):
                model = inner
                break
        else:
            base = getattr(model, "base_model", None)  # PEFT: PeftModel.base_model (LoraModel).model
            if base is not None and base is not model and isinstance(getattr(base, "model", None), nn.Module):
                model = base.model
                continue
            return model
    return model


def output_head(model: nn.Module, role: str) -> nn.Linear:
    """The model's lm_head as a plain Linear whose weight is whole (see distributed.py)."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or hasattr(head, "lora_A") or hasattr(head, "base_layer"):
        raise ValueError(
            f"the {role}'s output embedding is {type(head).__name__}, not a plain nn.Linear; the fused loss reads "
            f"lm_head.weight directly, so an adapter on lm_head would be ignored. Exclude lm_head from the adapter's "
            f"target_modules, merge it first, or patch with fused_linear_jsd=False"
        )
    if not hasattr(head.weight, "ds_id"):  # ZeRO-3 partitions are gathered by the caller (gathered_weights)
        check_full_weight(head.weight, (head.out_features, head.in_features), role)
    return head


def shift_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """HF style: row t is scored against token t + 1; the last position has no target."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def resolve_config(model: nn.Module, kd_config: KDLossConfig | dict | None) -> KDLossConfig:
    base = patch_state(model).config
    if kd_config is None:
        return base
    if isinstance(kd_config, KDLossConfig):
        return kd_config
    return KDLossConfig.build(base, **kd_config)


TeacherCallback = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", "float | None"], Any]


@dataclass
class TeacherInputs:
    """The teacher of one call: a live model, its hidden states and lm_head, or its log-probs (exactly one)."""

    model: nn.Module | None = None
    hidden_states: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        sources = {
            "teacher_model": self.model,
            "teacher_hidden_states": self.hidden_states,
            "teacher_token_ids": self.token_ids,
        }
        given = [name for name, value in sources.items() if value is not None]
        if len(given) > 1:
            raise ValueError(
                f"pass one teacher source, not {given}: a live teacher_model, teacher_hidden_states + teacher_weight, "
                f"or teacher_token_ids + teacher_logprobs"
            )
        if self.hidden_states is not None and self.weight is None:
            raise ValueError(
                "teacher_hidden_states needs teacher_weight (the teacher's lm_head weight, (vocab, hidden))"
            )
        if self.token_ids is not None and self.logprobs is None:
            raise ValueError("teacher_token_ids needs teacher_logprobs of the same shape (B, T, K)")

    @property
    def given(self) -> bool:
        return any(t is not None for t in (self.model, self.hidden_states, self.token_ids))


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
    kd_config: KDLossConfig | dict | None = None,
    return_logits: bool = False,
    kd_teacher_callback: TeacherCallback | None = None,
    kd_log_agreement: bool = False,
    **kwargs,
):
    """The patched *ForCausalLM.forward.

    With labels and a teacher (`teacher_model`, or `teacher_hidden_states` + `teacher_weight`, or
    `teacher_token_ids` + `teacher_logprobs` of shape (B, T, K) aligned with the positions like logits are)
    it returns the model's output with `.loss` the distillation loss and `.logits` None (fused) or the logits
    (patched with fused_linear_jsd=False, or return_logits=True). Without labels or a teacher it is the
    original forward, so generation and plain CE training behave exactly as before. `kd_config` (a
    KDLossConfig or a dict of its fields) overrides the options given at patch time for this call.
    `kd_log_agreement` adds `.kd_top1_agreement`: how often the student's most likely token is the teacher's,
    on up to 256 scored rows (one host sync; the trainer asks on logging steps only).
    `kd_teacher_callback` is internal: another model's KD forward asks this model, as its teacher, for its
    last hidden states inside this model's own forward, where FSDP has its parameters gathered.
    """
    state = patch_state(self)
    if kd_teacher_callback is not None:
        return _serve_as_teacher(self, input_ids, attention_mask, kd_teacher_callback, kwargs)
    teacher = TeacherInputs(
        teacher_model, teacher_hidden_states, teacher_weight, teacher_bias, teacher_token_ids, teacher_logprobs
    )
    if labels is None or not teacher.given:
        return state.original_forward(self, input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)

    cfg = resolve_config(self, kd_config).replace(softcap=softcap_of(self.config))
    # a loss needs no KV cache; without one transformers also keeps packed sequences (position ids restarting,
    # no attention mask) from attending across their boundaries
    kwargs.setdefault("use_cache", False)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    given_shift = kwargs.pop("shift_labels", None)  # transformers passes pre-shifted labels for packed sequences
    targets = given_shift if given_shift is not None else shift_labels(labels, cfg.ignore_index)
    if not state.fused or return_logits:
        return _materialised(self, state, teacher, input_ids, attention_mask, targets, cfg, num_items_in_batch, kwargs)

    kwargs.pop("logits_to_keep", None)
    decoder_out = self.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = decoder_out.last_hidden_state
    with gathered_weights(self.get_output_embeddings()):
        head = output_head(self, "student")
        common = dict(student_bias=head.bias, num_items_in_batch=num_items_in_batch, return_components=True)
        agreement = None
        if teacher.token_ids is not None:
            out = fused_linear_topk_kd(
                hidden, head.weight, teacher.token_ids, teacher.logprobs, targets, config=cfg, **common
            )
            if kd_log_agreement:
                agreement = _top1_agreement(hidden, head, targets, cfg, _topk_top1(teacher.token_ids, teacher.logprobs))
        elif teacher.hidden_states is not None:
            out = fused_linear_jsd(
                hidden, head.weight, teacher.hidden_states, teacher.weight, targets, teacher_bias=teacher.bias,
                config=cfg, **common,
            )  # fmt: skip
            if kd_log_agreement:
                top1 = _linear_top1(teacher.hidden_states, teacher.weight, teacher.bias)
                agreement = _top1_agreement(hidden, head, targets, cfg, top1)
        else:
            grad_enabled = torch.is_grad_enabled()
            measured = {}

            def loss_on(h_t, w_t, b_t, cap_t):
                if kd_log_agreement:
                    measured["agreement"] = _top1_agreement(hidden, head, targets, cfg, _linear_top1(h_t, w_t, b_t))
                with torch.set_grad_enabled(grad_enabled):
                    return fused_linear_jsd(
                        hidden, head.weight, h_t, w_t, targets, teacher_bias=b_t,
                        config=cfg.replace(teacher_softcap=cap_t), **common,
                    )  # fmt: skip

            out = call_teacher(teacher.model, input_ids, attention_mask, kwargs, loss_on)
            agreement = measured.get("agreement")
    return _output(out, decoder_out, agreement)


def _linear_top1(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """rows -> the teacher's most likely token on those rows (soft-capping is monotone: argmax unchanged)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return lambda rows: F.linear(flat[rows].to(weight.dtype), weight, bias).argmax(-1)


def _topk_top1(ids: torch.Tensor, logprobs: torch.Tensor):
    flat_ids, flat_lp = ids.reshape(-1, ids.shape[-1]), logprobs.reshape(-1, ids.shape[-1])
    return lambda rows: flat_ids[rows].gather(-1, flat_lp[rows].float().argmax(-1, keepdim=True)).squeeze(-1)


@torch.no_grad()
def _top1_agreement(hidden, head: nn.Linear, targets, cfg: KDLossConfig, teacher_top1, max_rows: int = 256):
    flat_targets = targets.reshape(-1)
    rows = (flat_targets != cfg.ignore_index).nonzero().squeeze(-1)[:max_rows]
    if rows.numel() == 0:
        return torch.zeros((), device=hidden.device)
    student_top1 = head(hidden.reshape(-1, hidden.shape[-1])[rows]).argmax(-1)
    return (student_top1 == teacher_top1(rows).to(student_top1.device)).float().mean()


kd_causal_lm_forward.__liger_kd__ = True


@dataclass
class KDCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus the loss's terms (for logging). They are fields, not attributes set
    afterwards, because wrappers rebuild the output from its fields (FSDP2's forward hooks, accelerate's
    autocast wrapper) and would drop anything else."""

    kd_soft_loss: torch.Tensor | None = None
    kd_hard_loss: torch.Tensor | None = None
    kd_top1_agreement: torch.Tensor | None = None


def _output(out: KDLossOutput, decoder_out, agreement: torch.Tensor | None = None) -> KDCausalLMOutput:
    extras = {k: v for k, v in decoder_out.items() if k not in ("last_hidden_state", "logits", "loss")}
    return KDCausalLMOutput(
        loss=out.loss, logits=None, kd_soft_loss=out.soft, kd_hard_loss=out.hard, kd_top1_agreement=agreement, **extras
    )


def call_teacher(teacher: nn.Module, input_ids, attention_mask, student_kwargs: dict, loss_on: TeacherCallback):
    """Run `loss_on(teacher hidden, teacher lm_head weight, bias, softcap)` inside the teacher's own forward.

    Going through the teacher's top-level call (FSDP1/FSDP2/PEFT wrappers included) is what gathers its
    sharded parameters; the teacher's decoder runs under no_grad, and FSDP registers no backward hooks for it.
    """
    install_teacher_forward(teacher)
    passthrough = {k: student_kwargs[k] for k in ("position_ids", "use_cache") if student_kwargs.get(k) is not None}
    # the loss leaves through this dict, not as the teacher's output: wrappers rebuild a module's outputs inside
    # its call, under the teacher's no_grad (DeepSpeed ZeRO-3 does), which would cut the loss from the graph
    result = {}

    def keep(*args):
        result["loss"] = loss_on(*args)

    with torch.no_grad():
        teacher(input_ids=input_ids, attention_mask=attention_mask, kd_teacher_callback=keep, **passthrough)
    release_root_parameters(teacher)
    return result["loss"]


def install_teacher_forward(teacher: nn.Module) -> None:
    """Give an unpatched teacher the KD forward (fused path only, no kernels): its behaviour is unchanged
    except when it is asked to serve as a teacher."""
    inner = unwrap_model(teacher)
    if _is_kd_forward(inner):
        return
    inner.__dict__[_INSTANCE_ATTR] = PatchState(original_forward=type(inner).forward)
    inner.forward = kd_causal_lm_forward.__get__(inner)


def _is_kd_forward(model: nn.Module) -> bool:
    return getattr(model.forward, "__func__", None) is kd_causal_lm_forward


def _serve_as_teacher(self, input_ids, attention_mask, callback: TeacherCallback, kwargs: dict):
    with torch.no_grad():
        hidden = self.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
    with gathered_weights(self.get_output_embeddings()):
        head = output_head(self, "teacher")
        bias = None if head.bias is None else head.bias.detach()
        return callback(hidden.detach(), head.weight.detach(), bias, softcap_of(self.config))


def _materialised(
    self, state, teacher: TeacherInputs, input_ids, attention_mask, targets, cfg, num_items_in_batch, kwargs
):
    """fused_linear_jsd=False (or return_logits=True): the same objective on materialised logits."""
    out = state.original_forward(self, input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    student_logits = reference.upcast_logits(out.logits)  # already soft-capped by the model's own forward
    cfg = cfg.replace(softcap=None)
    if teacher.token_ids is not None:
        loss = reference.topk_kd_loss(
            student_logits, teacher.token_ids, teacher.logprobs, targets, cfg, num_items_in_batch
        )
    else:
        if teacher.hidden_states is not None:
            teacher_logits = teacher.hidden_states @ teacher.weight.T
            if teacher.bias is not None:
                teacher_logits = teacher_logits + teacher.bias
        else:
            with torch.no_grad():
                teacher_logits = teacher.model(input_ids=input_ids, attention_mask=attention_mask).logits
            cfg = cfg.replace(teacher_softcap=None)  # an HF model's logits already carry its own soft-capping
        loss = reference.kd_loss(
            student_logits, reference.upcast_logits(teacher_logits), targets, cfg, num_items_in_batch
        )
    out.loss = loss
    return out
