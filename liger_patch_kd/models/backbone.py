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
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .registry import REGISTRY
from .spec import spec_for_model
from .state import unwrap_model


def run_backbone(
    model: nn.Module,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    labels: torch.Tensor | None = None,
):
    """The backbone's output (last_hidden_state first) on this batch, as the model's forward would compute it."""
    spec = spec_for_model(model)
    kwargs = router_logits_request(model, kwargs)
    backbone = model.model
    # transformers 4.57's Gemma-3 model takes labels: with token_type_ids, training attends within an image both ways
    if spec.is_vlm and labels is not None and "labels" in inspect.signature(backbone.forward).parameters:
        kwargs = {**kwargs, "labels": labels}
    return backbone(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def teacher_vision_inputs(teacher: nn.Module, student_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The student's vision inputs a VLM teacher takes; {} for a text teacher."""
    inner = unwrap_model(teacher)
    spec = REGISTRY.get(getattr(getattr(inner, "config", None), "model_type", None))
    if spec is None or not isinstance(inner, spec.model_class()):  # any teacher may run its own forward (materialised)
        return {}
    return {k: student_kwargs[k] for k in spec.vision_inputs if student_kwargs.get(k) is not None}


def router_logits_request(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The backbone keywords with `output_router_logits` resolved as the unpatched forward resolves it."""
    if not spec_for_model(model).router_aux_loss:
        return kwargs
    wanted = kwargs.get("output_router_logits")
    return {**kwargs, "output_router_logits": model.config.output_router_logits if wanted is None else wanted}


def router_aux_loss(model: nn.Module, backbone_out, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The model's load-balancing loss on this batch, or None when the model does not ask for it."""
    router_logits = backbone_out.get("router_logits") if hasattr(backbone_out, "get") else None
    if router_logits is None or not spec_for_model(model).router_aux_loss:
        return None
    load_balancing_loss_func = spec_for_model(model).load().load_balancing_loss_func
    aux = load_balancing_loss_func(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)
    return aux if isinstance(aux, torch.Tensor) else None  # it returns 0 when there are no router logits


def with_router_aux_loss(model: nn.Module, loss: torch.Tensor, aux_loss: torch.Tensor | None) -> torch.Tensor:
    """loss + router_aux_loss_coef * aux_loss, as the unpatched forward adds it to its CE."""
    if aux_loss is None:
        return loss
    return loss + model.router_aux_loss_coef * aux_loss.to(loss.device)
