"""Running a model's backbone as its own forward does, for text models and vision-language models alike.

Every registered forward calls `self.model(...)` and puts lm_head on its first output (forward_audit.py checks
this). For a causal LM `self.model` is the decoder; for a VLM it is the multimodal model, which runs the vision
tower on the pixel inputs, merges the image features into the text embeddings and runs the language model. The
KD forward calls it with every input the caller gave (pixel_values, image_grid_thw, ... pass through untouched) and
scores the rows whose labels are not ignore_index: the text positions when the collator masks the image
placeholders, as HF's and TRL's VLM collators do.

A live teacher gets the student's tokens and layout (input_ids, attention_mask, position_ids). A VLM teacher also
gets the vision inputs its registry entry names, when the student received them; a text teacher gets none, so
a text model and a VLM sharing a tokenizer can be either student or teacher.

A mixture-of-experts model's router loss (below), kept in the KD loss exactly as the model keeps it in its CE.

The unpatched forward (Mixtral, Qwen3-MoE, GPT-OSS; checked by forward_audit.py) does, when
`output_router_logits` (the argument, else the config) is true:

    aux_loss = load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                        attention_mask)
    loss += self.router_aux_loss_coef * aux_loss

The KD forward calls the same function from the model's own modeling module with the same arguments.

A right-padded batch (every collator here pads on the right) reaches an SDPA backbone without its attention mask
when no scored position is padding (trailing_padding_only, PaddingCheck): causal attention never lets a real
token see the padding after it, so every scored hidden state is the same, and SDPA runs the causal flash kernel
instead of a masked one (slower, and cuDNN's builds a plan per new shape: seconds the first time a sequence length
is seen, which generated micro-batches, of every length, keep paying). The router loss keeps the mask.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .captured_backbone import CAPTURED_ATTR
from .registry import REGISTRY, ArchSpec
from .spec import spec_for_model
from .state import unwrap_model

if TYPE_CHECKING:
    from .facts import ModelFacts


@dataclass
class PaddingCheck:
    """The call's attention mask and scored targets, and whether the mask only pads the end of rows
    (trailing_padding_only): checked at most once per call, by the first backbone that would drop such a mask (the
    student's, or a live teacher's inside its own forward), and reused by the others."""

    attention_mask: torch.Tensor | None
    targets: torch.Tensor
    ignore_index: int
    kwargs: dict[str, Any]
    trailing_only: bool | None = None  # not checked yet


def run_backbone(
    model: nn.Module,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    labels: torch.Tensor | None = None,
    *,
    facts: ModelFacts | None = None,
    padding: PaddingCheck | None = None,
):
    """The backbone's output (last_hidden_state first) on this batch, as the model's forward would compute it.

    `facts` (models.facts.forward_facts) spare the lookups of a model running the KD forward. With `padding` (the
    KD forward's rows, `attention_mask` being theirs) a registered causal text model attending through SDPA runs
    without a mask that only pads the end of rows (see the module docstring)."""
    spec = spec_for_model(model) if facts is None else facts.spec
    if padding is not None and facts is not None and facts.causal_text:
        text = facts.text_config
        if getattr(text, "_attn_implementation", None) == "sdpa" and not getattr(
            text, "use_bidirectional_attention", False
        ):
            if padding.trailing_only is None:  # one host sync, made once per call
                padding.trailing_only = trailing_padding_only(
                    padding.attention_mask, padding.targets, padding.ignore_index, padding.kwargs
                )
            if padding.trailing_only:
                attention_mask = None
    if spec.router_aux_loss:
        kwargs = router_logits_request(model, kwargs)
    backbone = model.model
    # transformers 4.57's Gemma-3 model takes labels: with token_type_ids, training attends within an image both ways
    if labels is not None and (
        facts.backbone_takes_labels
        if facts is not None
        else spec.is_vlm and "labels" in inspect.signature(backbone.forward).parameters
    ):
        kwargs = {**kwargs, "labels": labels}
    captured = model.__dict__.get(CAPTURED_ATTR)  # a teacher replayed from CUDA graphs (captured_backbone.py)
    if captured is not None:
        replayed = captured.replay(model, backbone, input_ids, attention_mask, kwargs)
        if replayed is not None:
            return replayed
    return backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def trailing_padding_only(
    attention_mask: torch.Tensor | None, targets: torch.Tensor, ignore_index: int, kwargs: dict[str, Any]
) -> bool:
    """Whether `attention_mask` (B, T) is 1 then 0 along every row, 1 wherever `targets` (B, T, the label each
    position predicts) is scored, with nothing else shaping attention (no position_ids: with them and no mask
    transformers would read packed sequences; no KV cache, under either of its names). One host sync."""
    if attention_mask is None or attention_mask.dim() != 2 or tuple(targets.shape) != tuple(attention_mask.shape):
        return False
    if any(kwargs.get(k) is not None for k in ("position_ids", "past_key_values", "cache", "cache_position")):
        return False
    with torch.no_grad():
        ones = attention_mask == 1
        binary = (ones | (attention_mask == 0)).all()
        trailing = (ones[:, 1:] <= ones[:, :-1]).all()
        scored_attended = (ones | (targets == ignore_index)).all()
        return bool(binary & trailing & scored_attended)


def teacher_vision_inputs(teacher: nn.Module, student_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The student's vision inputs a VLM teacher takes; {} for a text teacher."""
    inner = unwrap_model(teacher)
    spec = REGISTRY.get(getattr(getattr(inner, "config", None), "model_type", None))
    if spec is None or not isinstance(inner, spec.model_class()):  # any teacher may run its own forward (materialised)
        return {}
    return {k: student_kwargs[k] for k in spec.vision_inputs if student_kwargs.get(k) is not None}


def router_logits_request(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The backbone keywords of a model with a router loss, with `output_router_logits` resolved as the unpatched
    forward resolves it."""
    wanted = kwargs.get("output_router_logits")
    return {**kwargs, "output_router_logits": model.config.output_router_logits if wanted is None else wanted}


def router_aux_loss(
    model: nn.Module, spec: ArchSpec, backbone_out, attention_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """The model's load-balancing loss on this batch, or None when the model (of registry entry `spec`) does not
    ask for it."""
    router_logits = backbone_out.get("router_logits") if hasattr(backbone_out, "get") else None
    if router_logits is None or not spec.router_aux_loss:
        return None
    load_balancing_loss_func = spec.load().load_balancing_loss_func
    aux = load_balancing_loss_func(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)
    return aux if isinstance(aux, torch.Tensor) else None  # it returns 0 when there are no router logits


def with_router_aux_loss(model: nn.Module, loss: torch.Tensor, aux_loss: torch.Tensor | None) -> torch.Tensor:
    """loss + router_aux_loss_coef * aux_loss, as the unpatched forward adds it to its CE."""
    if aux_loss is None:
        return loss
    return loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
