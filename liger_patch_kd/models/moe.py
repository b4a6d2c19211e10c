"""A mixture-of-experts model's router loss, kept in the KD loss exactly as the model keeps it in its CE.

The unpatched forward (Mixtral, Qwen3-MoE, GPT-OSS; checked by forward_audit.py) does, when
`output_router_logits` (the argument, else the config) is true:

    aux_loss = load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                        attention_mask)
    loss += self.router_aux_loss_coef * aux_loss

The KD forward calls the same function from the model's own modeling module with the same arguments.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .spec import spec_for_model


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
