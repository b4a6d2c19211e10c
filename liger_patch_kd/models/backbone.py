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
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .moe import router_logits_request
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
